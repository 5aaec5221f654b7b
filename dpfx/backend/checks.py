"""The self-check factory: which compiled graph gets a check of Inductor's code, and what the
check is told (Note [Checking what Inductor generated] in lower/selfcheck/__init__.py).

    reference = forward_reference(gm, config, validating)      # before lowering
    check = forward_check(reference, compiled, gm, info, ...)    # after; None if unwanted
    reference = backward_reference(gm, check)
    attach_backward(check, reference, compiled, config, positions, ...)

A forward is checked where the self-check is on, the backend is Inductor and the compile is no
``dpfx.validate``; its backward is checked with it, as one pair. The check compares each output
of the compiled code with its FX graph's (the graph the proof read), read by its layout: a
captured loss is a sum over the batch and a side output is no example's, so neither is compared
per example. The backward's release is compared as a clipped sum under the bound (the config's
``sensitivity``) where nothing in the graph reads a value chosen at run time (the adaptive bound,
a padded batch's count).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpfx.backend.inputs import input_index
from dpfx.config import DPConfig
from dpfx.lower.selfcheck import GraphCheck, Half, Release
from dpfx.passes import ForwardInfo


def wanted(config: DPConfig, validating: bool) -> bool:
    """Whether this compile's graphs get a self-check."""
    return config.self_check is not False and config.backend == "inductor" and not validating


def forward_reference(gm: fx.GraphModule, config: DPConfig, validating: bool) -> Half | None:
    """The rewritten forward as the check will run it, taken before lowering (None: unchecked)."""
    return Half.of(gm, None) if wanted(config, validating) else None


def forward_check(reference: Half | None, compiled, gm: fx.GraphModule, info: ForwardInfo,
                  batch_inputs: set[str], targets: set[int], device: torch.device,
                  decisions: list, config: DPConfig) -> GraphCheck | None:
    """The check of a lowered forward against ``reference``. ``targets``: the positions of the
    captured loss's targets among dynamo's graph inputs."""
    if reference is None:
        return None
    reference.compiled = compiled
    # the captured loss's value: a sum over the batch by design (loss/captured.py)
    layouts = ["loss" if i in info.loss_outputs else
               "side" if i in info.side_outputs else lay
               for i, lay in enumerate(info.output_layouts)]
    names = {n.name for n in gm.graph.find_nodes(op="placeholder") if input_index(n) in targets}
    return GraphCheck(reference, layouts, info.batch_symbols, batch_inputs, device, decisions,
                      names, always=config.self_check == "always")


def backward_reference(gm: fx.GraphModule, check: GraphCheck | None) -> Half | None:
    """The rewritten backward as the check will run it, taken before lowering."""
    return Half.of(gm, None) if check is not None else None


def attach_backward(check: GraphCheck | None, reference: Half | None, compiled,
                    config: DPConfig, positions: dict[str, int], native_noise: bool,
                    adaptive: bool, padded: bool) -> None:
    """The lowered backward joins its forward's check."""
    if check is None:
        return
    reference.compiled = compiled
    check.backward = reference
    # Inductor's GPU Philox stream is not eager's: noise in the graph would differ.
    check.compare_backward = not native_noise or config.noise == "optimizer"
    if not adaptive and not padded:
        # Note [The second size grows the first] (lower/selfcheck/)
        divisor = 1.0 if config.noise == "optimizer" or config.loss_reduction == "sum" \
            else float(config.expected_batch_size) if config.expected_batch_size else None
        check.release = Release(frozenset(positions.values()), divisor, config.sensitivity,
                                mean=config.loss_reduction == "mean")
