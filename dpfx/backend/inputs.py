"""What each input and output of a captured graph is: a parameter (by name), a batch input, a
constant or a size; and which output of aot_autograd's backward is which parameter's gradient.

    inputs = GraphInputs.of(gm, example_inputs, trainable(model), held_constants(model))
    inputs.kinds        # ["param:fc.weight", "param:fc.bias", "input", "constant", "symint"]
    gradient_outputs(backward_gm)     # {backward output index: forward input index}

dynamo's graph lists the model's parameters and buffers among its inputs, beside the call's
tensors. A trainable parameter is named by ``named_parameters``; a buffer, a frozen parameter or
a tensor the model reads from elsewhere is a constant (Note [Tensors the model holds are not
inputs]); every other tensor carries the batch in dim 0. aot_autograd describes each placeholder
and output of its graphs (``desc``), which is how a backward output is tied to the forward input
it is the gradient of.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from dpfx.errors import CaptureError, PrivacyError
from dpfx.loss.captured import TARGETS


def trainable(model: torch.nn.Module) -> dict[int, str]:
    """id -> name of each parameter that requires grad."""
    return {id(p): n for n, p in model.named_parameters() if p.requires_grad}


def held_constants(model: torch.nn.Module) -> set[int]:
    """ids of the model's buffers and frozen parameters: constants to the graph."""
    return {id(b) for b in model.buffers()} | {
        id(p) for p in model.parameters() if not p.requires_grad}


def check_same_parameters(model: torch.nn.Module, names: dict[int, str]) -> None:
    """A capture after compile (dynamo captures again when the model changed) sees the
    parameters dpfx.compile saw (``names``): the clipping groups, the gradient guards and the
    optimizer were set up for those. Buffers may come and go (constants to the graph)."""
    now = trainable(model)
    if now != names:
        added = sorted(set(now.values()) - set(names.values()))
        removed = sorted(set(names.values()) - set(now.values()))
        raise PrivacyError(
            f"the model's trainable parameters changed after dpfx.compile (added: "
            f"{added or 'none'}; removed or replaced: {removed or 'none'}): the clipping "
            f"groups, gradient guards and the optimizer were set up for the parameters at "
            f"compile time. Call dpfx.compile again after changing the model (and build a "
            f"new DPOptimizer).")


# Note [Tensors the model holds are not inputs]
# Every tensor the dpfx call receives carries the batch in dim 0 (compiled_call.py marks it
# unbacked). A tensor the model reads from elsewhere, a closure's cell (a causal mask built once
# and captured by a lambda: ``lambda x, mem: layer(x, mem, tgt_mask=causal)``), a global, an
# attribute that is not a registered buffer, reaches dynamo's graph as an input too, with the same
# size on every call; taken for a batch input, it would be refused as "specialized". dynamo names
# where each graph input comes from (its grapharg's source): those not read from the call's own
# arguments are constants to the graph, like buffers, the same on every call whatever the batch
# (dynamo guards on them). An input without a recorded source stays a batch input.
# (tests/lower/test_inductor_sweep.py, the decoder layer's causal mask)
_CALL_ARGUMENTS = ("L['args']", "L['kwargs']")


def source_name(node: fx.Node) -> str | None:
    """Where dynamo read the graph input ``node`` from (its grapharg's source), if recorded."""
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    try:
        return source.name if isinstance(source.name, str) else source.name()
    except AttributeError:
        return None


def input_kind(x: Any, source: str | None, params: dict[int, str], constants: set[int]) -> str:
    """``"param:<name>"``, ``"input"`` (a batch input), ``"constant"`` or ``"symint"``."""
    if not isinstance(x, torch.Tensor):
        return "symint"
    if id(x) in params:
        return "param:" + params[id(x)]
    if id(x) in constants or isinstance(x, torch.nn.Parameter):
        return "constant"
    if source is not None and not source.startswith(_CALL_ARGUMENTS):
        return "constant"   # Note [Tensors the model holds are not inputs]
    return "input"


@dataclasses.dataclass
class GraphInputs:
    """Each input of dynamo's graph, by position: its kind (``input_kind``), and which are a
    captured loss's targets (Note [The loss inside the graph] in loss/captured.py)."""
    kinds: list[str]
    targets: set[int]

    @classmethod
    def of(cls, gm: fx.GraphModule, example_inputs: list, params: dict[int, str],
           constants: set[int]) -> GraphInputs:
        sources = [source_name(n) for n in gm.graph.find_nodes(op="placeholder")]
        if len(sources) != len(example_inputs):
            sources = [None] * len(example_inputs)
        return cls([input_kind(x, s, params, constants) for x, s in zip(example_inputs, sources)],
                   {i for i, s in enumerate(sources) if s and TARGETS in s})

    @property
    def params(self) -> set[str]:
        """The trainable parameters the graph reads."""
        return {k[len("param:"):] for k in self.kinds if k.startswith("param:")}

    def batch_size(self, gm: fx.GraphModule) -> Any:
        """dim 0 of the first batch input (the unbacked batch symbol), or None."""
        return next((v.shape[0] for v, k in zip(
            (n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")),
            self.kinds) if k == "input" and isinstance(v, torch.Tensor) and v.dim()), None)

    def param_outputs(self, gm: fx.GraphModule) -> dict[int, str]:
        """Backward output index -> the name of the parameter it is the gradient of."""
        return {i: self.kinds[idx][len("param:"):] for i, idx in gradient_outputs(gm).items()
                if self.kinds[idx].startswith("param:")}


def input_index(node: fx.Node) -> int | None:
    """The position, among dynamo's graph inputs, of the input aot_autograd's placeholder
    ``node`` stands for (None: not one of them)."""
    return getattr(node.meta.get("desc"), "idx", None)


def output_descs(output: fx.Node, n: int) -> list:
    """aot_autograd's descriptions of the ``n`` outputs of ``output``."""
    descs = output.meta.get("desc")
    if descs is None or len(descs) != n:
        raise CaptureError(
            "aot_autograd did not describe the backward outputs (torch too old or too new?); "
            "dpfx needs them to know which output is which parameter's gradient")
    return list(descs)


def gradient_outputs(gm: fx.GraphModule) -> dict[int, int]:
    """Backward output index -> the forward input it is the gradient of (outputs that are None
    or no input's gradient left out)."""
    output = gm.graph.find_nodes(op="output")[0]
    found = {}
    for i, desc in enumerate(output_descs(output, len(output.args[0]))):
        idx = getattr(getattr(desc, "grad_of", None), "idx", None)
        if idx is not None and output.args[0][i] is not None:
            found[i] = idx
    return found


def tangent_outputs(gm: fx.GraphModule) -> dict[str, int]:
    """Backward placeholder name -> the forward output it is the tangent of."""
    tangents = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        out_idx = getattr(getattr(desc, "output", None), "idx", None)
        if type(desc).__name__ == "TangentAOTInput" and out_idx is not None:
            tangents[node.name] = out_idx
    return tangents


def device_of(example_inputs) -> torch.device:
    """The device of the first tensor among ``example_inputs`` (CPU if none)."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")
