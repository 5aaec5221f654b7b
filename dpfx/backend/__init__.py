"""The torch.compile backend: Inductor's own capture, with dpfx's passes as its inner compiler.

``compile_fx(gm, inputs, inner_compile=...)`` runs aot_autograd with Inductor's decompositions,
joint-graph passes and partitioner, then calls the inner compiler for the forward and the backward
graph. dpfx rewrites those graphs (see ``dpfx.passes``) and then lowers them with Inductor's
``compile_fx_inner`` (backend="inductor") or runs them as plain FX (backend="eager"), so both
backends execute the same rewritten graphs.

    backend = DPBackend(model, config, ReleaseGate())
    torch.compile(entry, backend=backend, fullgraph=True)

``DPBackend`` composes the package's parts: ``inputs.py`` says what each graph input and
output is, ``runtime.py`` builds the runners of the compiled graphs, ``checks.py`` the self-check
of Inductor's code, and lower/trust.py decides which compiled graphs a cache entry may run as they
are.

# Note [No caches that skip the inner compiler]
AOTAutogradCache returns compiled artifacts without calling the inner compiler; a hit for a graph
first compiled without dpfx would hand back *non-private* gradients. So it serves a dpfx compile
only as Note [A warm start without the joint trace] (lower/warm.py) sets it up: on CPU, in its bundled
mode, holding dpfx's own output code, which runs the code dpfx proved and lowered, under its
digest and the self-check's verdict (Note [A trusted warm start]), or calls dpfx's inner compiler
again when it is loaded, under a key that carries dpfx's source digest and every private setting;
a hit after which dpfx compiled nothing is refused. On a GPU it stays off. Inductor's FX graph
cache stays on: its key is the rewritten graph itself.
(tests/lower/test_inductor.py::test_plain_torch_compile_first_does_not_leak,
tests/lower/test_warm_start.py)
"""
from __future__ import annotations

import dataclasses
import os
import re
import weakref
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.compile_fx import compile_fx

from dpfx.backend import checks
from dpfx.backend.inputs import (GraphInputs, check_same_parameters, device_of, held_constants,
                                 input_index, tangent_outputs, trainable)
from dpfx.backend.runtime import BackwardPlan, Runners, refuse_to_run
from dpfx.config import DPConfig
from dpfx.errors import CaptureError, PrivacyError
from dpfx.graph.batch import sym_expr
from dpfx.loss.captured import capture_loss
from dpfx.loss.gate import ReleaseGate
from dpfx.lower import warm
from dpfx.lower.trust import Trust, TrustedGrad, trustable
from dpfx.lower.codegen_patches import optimization_hints_once
from dpfx.lower.inductor import cache_key_pass, inductor_patches, lower
from dpfx.ops.norms import NormStats
from dpfx.passes import ForwardInfo, Stages, compile_backward, compile_forward
from dpfx.privacy.adaptive import AdaptiveClip


# Note [Saved activations carry no dynamo marks]
# aot_autograd's runtime stamps each tensor the forward saves for the backward, whose batch dim is
# symbolic, with the dims dynamo should treat as dynamic if the tensor ever reached another
# compiled graph (``_dynamo_propagated_dynamic_indices``: a Python attribute set per tensor per
# step). dpfx's graphs have a symbolic batch, so every activation carries it: 32 stamps a step
# on a two-layer GPT-2, about 16 more for each layer, Python on the steady call's path that
# torch.compile with static shapes never pays. A saved activation only ever reaches the
# compiled backward, which takes it as it is; so the forward's compile clears that list, read
# once per call by the runtime (its outputs keep their stamps: they reach user code). The list is
# cleared before AOTAutogradCache stores the entry, so a warm start has none either.
# (tests/lower/test_warm_start.py::test_saved_activations_carry_no_dynamo_marks)
def _no_saved_marks() -> None:
    """Clear the forward being compiled's list of saved tensors to stamp."""
    context = torch._guards.TracingContext.try_get()
    stamped = getattr(getattr(context, "fw_metadata", None), "dynamic_saved_tensors_idxs", None)
    if stamped:
        stamped.clear()


class DPBackend:
    """One per ``dpfx.compile`` call: knows the model's parameters and the DP options, and
    compiles each graph dynamo hands over: the forward and backward graphs aot_autograd makes
    of it go through dpfx's passes and the lowering, then get their runners."""

    def __init__(self, model: torch.nn.Module, config: DPConfig, gate: ReleaseGate):
        self.config = config
        self.gate = gate    # asked by the graphs' runners; the release state is its alone
        self._model = weakref.ref(model)
        self.param_names = trainable(model)
        self.buffer_ids = held_constants(model)
        self._forward: dict[Any, ForwardInfo] = {}
        self.compiles = 0
        self._checks: dict = {}     # graph id -> its self-check (backend/checks.py)
        self.stages = Stages(on_stage=self._dump)
        self.param_grads: list = []
        self.last_backward = None
        # parameters whose clipped sums leave the graph by their block's place (Note [Sharded
        # blocks] in loop/fsdp.py): the graph's outputs for them are dropped
        self.released_elsewhere: set[str] = set()
        self.problems: list | None = None  # a list while dpfx.validate collects refusals
        self._generator = None
        if config.seed is not None:
            self._generator = torch.Generator().manual_seed(config.seed)
        self.norm_stats = NormStats(config.clip_bounds) if config.track_norms else None
        # Note [Adaptive clipping] in privacy/adaptive.py: C_t, which every backward reads
        self.adaptive_clip = AdaptiveClip(config.max_grad_norm, config.target_unclipped_quantile,
                                          config.clip_lr, config.count_noise_multiplier) \
            if config.adaptive else None
        if self.norm_stats is not None and self.adaptive_clip is not None:
            self.norm_stats.follow(lambda: self.adaptive_clip.bound)
        self.runners = Runners(config, gate, self._generator, self.adaptive_clip,
                               self.norm_stats)
        # batch-size decisions of the entry being compiled (compiled_call.py)
        self.decisions: list = []
        self.inputs: GraphInputs | None = None     # of the graph being compiled
        self.trust = Trust()      # Note [A trusted warm start] in lower/trust.py

    @property
    def graph_params(self) -> set[str] | None:
        """The trainable parameters the last graph reads (the gate's, which checks them)."""
        return self.gate.graph_params

    # -- dynamo entry point ----------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Any:
        model = self._model()
        if model is not None:
            check_same_parameters(model, self.param_names)
            self.buffer_ids = held_constants(model)
        self.inputs = GraphInputs.of(gm, example_inputs, self.param_names, self.buffer_ids)
        self.gate.reads(self.inputs.params)
        # Note [The loss inside the graph] in loss/captured.py
        batch = self.inputs.batch_size(gm)
        if batch is not None:
            capture_loss(gm, self.config.loss_reduction, sym_expr(batch))
        # force_non_lazy_backward_lowering: compile the backward now, so that a refusal is raised
        # at the first forward, not suppressed until (or skipped before) the first backward.
        # ban_recompute_reductions: a captured loss's reductions over the batch stay in the
        # forward, whatever the user's setting (Note [The loss inside the graph], step 4).
        # Note [Optimization hints, computed once per expression] in lower/codegen_patches.py.
        # Note [A warm start without the joint trace] (lower/warm.py): on CPU, AOTAutogradCache holds
        # dpfx's own output code, which runs dpfx's inner compiler again when it is loaded.
        # (torch's own switch for that cache, enable_autograd_cache, turns it off here too)
        cached = self.config.backend == "inductor" and device_of(example_inputs).type == "cpu" \
            and torch._functorch.config.enable_autograd_cache
        patches = inductor_patches(example_inputs)
        if cached:
            # Note [A trusted warm start] (lower/trust.py): the key names every setting the
            # rewritten graphs depend on, so an entry's code serves only the same settings
            patches = {**patches, "post_grad_custom_post_pass": cache_key_pass(
                torch._inductor.config.post_grad_custom_post_pass,
                extra=repr(([str(d) for d in self.decisions], self.config, self.inputs.kinds,
                            sorted(self.inputs.targets))))}
        with torch._functorch.config.patch(enable_autograd_cache=cached,
                                           bundled_autograd_cache=cached,
                                           force_non_lazy_backward_lowering=True,
                                           ban_recompute_reductions=True), \
                optimization_hints_once(), warm.compiling(self) as compiling:
            compiled = compile_fx(gm, example_inputs, inner_compile=self._inner,
                                  config_patches=patches)
        if compiling.compiled == 0 and compiling.hits:
            raise PrivacyError("dpfx: a compiled graph came back from a cache without dpfx's "
                               "passes having run on it; dpfx refuses to train with it (a dpfx "
                               "bug: please report)")
        return compiled

    # -- inner compiler: one call for the forward, one for the backward --------------------------
    def _inner(self, gm: fx.GraphModule, example_inputs: list, **kwargs) -> Any:
        if not kwargs.get("is_backward"):
            _no_saved_marks()   # Note [Saved activations carry no dynamo marks]
        if self.config.backend != "inductor" or device_of(example_inputs).type != "cpu":
            return self.compile_graph(gm, example_inputs, kwargs)
        return warm.output_code(
            self.trust, gm, kwargs, self.stages,
            lambda: self.compile_graph(gm, example_inputs, kwargs))

    def compile_graph(self, gm: fx.GraphModule, example_inputs: list, kwargs: dict) -> Any:
        """dpfx's inner compiler proper: on a fresh trace, or on a graph loaded from
        AOTAutogradCache (lower/warm.py)."""
        self.compiles += 1
        warm.state.compiled += 1
        if kwargs.get("is_backward"):
            return self._backward(gm, example_inputs, kwargs)
        return self._forward_graph(gm, example_inputs, kwargs)

    def _forward_graph(self, gm, example_inputs, kwargs):
        batch_inputs = {}
        for node in gm.graph.find_nodes(op="placeholder"):
            idx = input_index(node)
            if idx is not None and self.inputs.kinds[idx] == "input":
                batch_inputs[node.name] = 0
        info = compile_forward(gm, batch_inputs, self.stages,
                               check=not kwargs.get("is_inference", False),
                               problems=self.problems)
        graph_id = kwargs.get("graph_id")
        self._forward[graph_id] = info
        validating = self.problems is not None
        reference = checks.forward_reference(gm, self.config, validating)
        compiled = self._lower(gm, example_inputs, kwargs)
        if trustable(gm, info.batch_symbols, self.config, validating):
            self.trust.forward(graph_id, compiled)
        check = checks.forward_check(reference, compiled, gm, info, set(batch_inputs),
                                     self.inputs.targets, device_of(example_inputs),
                                     self.decisions, self.config)
        if check is not None:
            self._checks[graph_id] = check
        return self.runners.forward(compiled, check)

    def _backward(self, gm, example_inputs, kwargs):
        graph_id = kwargs.get("graph_id")
        fw = self._forward.get(graph_id)
        if fw is None:
            raise CaptureError("dpfx saw a backward graph without its forward graph")
        param_outputs = self.inputs.param_outputs(gm)
        tangents = tangent_outputs(gm)
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        device = device_of(example_inputs)
        _loss_tangent_is_one(gm, [ph for ph, i in tangents.items() if i in fw.loss_outputs])
        sink = self.norm_stats.sink if self.norm_stats is not None else None
        self.last_backward = compile_backward(gm, fw, param_outputs, tangents, self.config,
                                              fake_mode, device, self.stages, self.problems,
                                              norm_sink=sink)
        self.param_grads = self.last_backward.grads
        if self.problems:
            return refuse_to_run
        if self.norm_stats is not None:
            groups = {self.config.group_of(pg.name) for pg in self.param_grads}
            self.norm_stats.set_groups([k for k in self.config.clip_bounds if k in groups])
        native_noise = self.config.backend == "inductor" and device.type != "cpu"
        if native_noise:
            from torch._inductor.fx_passes.replace_random import replace_random_passes
            from torch._inductor.virtualized import V

            with V.set_fake_mode(fake_mode):
                replace_random_passes(gm)
            gm.recompile()
        # Note [Noise from ATen's generator on CPU]
        # Inductor's fused Philox randn is about 15 times slower than ATen's torch.randn on CPU,
        # and ATen's is single-threaded MT19937. On CPU the graph's noise is
        # dpfx::standard_normal (ops/noise.py: Philox + Box-Muller on every core), an extern
        # kernel for Inductor; fallback_random keeps any other random op on ATen's kernels.
        check = self._checks.get(graph_id)
        reference = checks.backward_reference(gm, check)
        plan = BackwardPlan({pg.name: pg.output_index for pg in self.param_grads},
                            self.last_backward.zero_tangents, self.last_backward.adaptive,
                            self.last_backward.padded)
        # the graph's last inputs: B of a padded batch, then C_t (passes/__init__._scalar_input)
        added = list(gm.graph.find_nodes(op="placeholder"))[-(plan.padded + plan.adaptive):] \
            if plan.padded or plan.adaptive else []
        example_inputs = [*example_inputs, *(p.meta["val"] for p in added)]
        with torch._inductor.config.patch(fallback_random=not native_noise):
            compiled = self._lower(gm, example_inputs, kwargs)
        checks.attach_backward(check, reference, compiled, self.config, plan.positions,
                               native_noise, plan.adaptive, plan.padded)
        self.trust.backward(graph_id, compiled, check,
                            None if native_noise else dataclasses.asdict(plan))
        return self.runners.backward(compiled, plan, device, self.released_elsewhere)

    def load_trusted(self, plan: dict, compiled, kwargs: dict):
        """The runner of a trusted entry's lowered code, as a compile of its graph would have
        made it (Note [A trusted warm start] in lower/trust.py)."""
        self.compiles += 1
        for name, text in plan.get("stages", {}).items():
            self.stages.graphs[name] = text
            if self.stages.on_stage is not None:
                self.stages.on_stage(name, text)
        if plan["kind"] == "forward":
            return self.runners.forward(compiled, None)
        self.param_grads = [TrustedGrad(name, i) for name, i in plan["positions"].items()]
        self.last_backward = None
        return self.runners.backward(compiled, BackwardPlan(
            plan["positions"], plan["zero_tangents"], plan["adaptive"], plan["padded"]),
            torch.device("cpu"), self.released_elsewhere)

    def _lower(self, gm, example_inputs, kwargs):
        return lower(gm, example_inputs, kwargs, self.config.backend)

    def _dump(self, stage: str, text: str) -> None:
        dump_stage(self.compiles, stage, text)


def dump_stage(number: int, stage: str, text: str) -> None:
    """A stage's graph text written to ``$DPFX_DUMP_DIR/NNN_<stage>.txt`` where that variable is
    set (``number``: the compile it belongs to)."""
    directory = os.environ.get("DPFX_DUMP_DIR")
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", stage)
    with open(os.path.join(directory, f"{number:03d}_{safe}.txt"), "w") as f:
        f.write(text)


def _loss_tangent_is_one(gm: fx.GraphModule, names: list[str]) -> None:
    """The captured loss's tangent is 1: CapturedLoss's backward starts there with exactly that
    (Note [The loss inside the graph] in loss/captured.py). Read as the constant, it is no input
    whose value the proof would have to follow."""
    for ph in gm.graph.find_nodes(op="placeholder"):
        if ph.name in names and ph.users:
            first = next(n for n in gm.graph.nodes if n.op != "placeholder")
            with gm.graph.inserting_before(first):
                one = gm.graph.call_function(torch.ops.aten.full.default, ([], 1.0), {
                    "dtype": ph.meta["val"].dtype, "device": ph.meta["val"].device})
            one.meta["val"] = ph.meta["val"]
            ph.replace_all_uses_with(one)
    gm.recompile()
