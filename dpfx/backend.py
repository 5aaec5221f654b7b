"""The torch.compile backend: Inductor's own capture, with dpfx's passes as its inner compiler.

``compile_fx(gm, inputs, inner_compile=...)`` runs aot_autograd with Inductor's decompositions,
joint-graph passes and partitioner, then calls the inner compiler for the forward and the backward
graph. dpfx rewrites those graphs (see ``dpfx.passes``) and then lowers them with Inductor's
``compile_fx_inner`` (backend="inductor") or runs them as plain FX (backend="eager"), so both
backends execute the same rewritten graphs.

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

import copy
import dataclasses
import math
import os
import re
import secrets
import weakref
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.compile_fx import compile_fx

from dpfx.config import DPConfig
from dpfx.errors import CaptureError, PrivacyError
from dpfx.loss.captured import TARGETS, capture_loss
from dpfx.lower import warm
from dpfx.lower.fast import optimization_hints_once
from dpfx.lower.inductor import cache_key_pass, inductor_patches, lower
from dpfx.graph.batch import sym_expr
from dpfx.lower.selfcheck import GraphCheck, Half, Release, pair_verdict, verdict_path
from dpfx.passes import ForwardInfo, Stages, compile_backward, compile_forward
from dpfx.loss.gate import ReleaseGate
from dpfx.ops import blocks as block_ops
from dpfx.ops.norms import NormStats
from dpfx.privacy.adaptive import AdaptiveClip


class DPBackend:
    """One per ``dpfx.compile`` call: knows the model's parameters and the DP options."""

    def __init__(self, model: torch.nn.Module, config: DPConfig, gate: ReleaseGate):
        self.config = config
        self.gate = gate    # asked by the graphs' runners; the release state is its alone
        self._model = weakref.ref(model)
        self.param_names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        self.buffer_ids = self._constants(model)
        self._forward: dict[Any, ForwardInfo] = {}
        self.compiles = 0
        self._checks: dict[Any, GraphCheck] = {}
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
        self.adaptive_clip = AdaptiveClip(config.max_grad_norm, config.target_quantile,
                                          config.clip_lr, config.count_noise_multiplier) \
            if config.adaptive else None
        if self.norm_stats is not None and self.adaptive_clip is not None:
            self.norm_stats.follow(lambda: self.adaptive_clip.bound)
        self.graph_params: set[str] | None = None  # trainable parameters the last graph reads
        self.decisions: list = []  # batch-size decisions of the entry being compiled (api.py)
        # Note [A trusted warm start] in lower/warm.py: what a cache entry needs to run the code
        # it holds without the passes (the lowered code, its plan), set by the last compile
        self._made: tuple | None = None
        self._outputs: dict = {}   # graph id -> the forward's output code, until its backward
        self._lowered_forwards: dict = {}    # graph id -> a trustable forward's lowered code

    # -- dynamo entry point ----------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Any:
        self._check_same_parameters()
        sources = [_source_name(n) for n in gm.graph.find_nodes(op="placeholder")]
        if len(sources) != len(example_inputs):
            sources = [None] * len(example_inputs)
        self._input_kinds = [self._kind(x, s) for x, s in zip(example_inputs, sources)]
        self._targets = {i for i, s in enumerate(sources) if s and TARGETS in s}
        self.graph_params = {k[len("param:"):] for k in self._input_kinds
                             if k.startswith("param:")}
        # Note [The loss inside the graph] in loss/captured.py
        batch = next((v.shape[0] for v, k in zip(
            (n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")),
            self._input_kinds) if k == "input" and isinstance(v, torch.Tensor) and v.dim()), None)
        if batch is not None:
            capture_loss(gm, self.config.loss_reduction, sym_expr(batch))
        # force_non_lazy_backward_lowering: compile the backward now, so that a refusal is raised
        # at the first forward, not suppressed until (or skipped before) the first backward.
        # ban_recompute_reductions: a captured loss's reductions over the batch stay in the
        # forward, whatever the user's setting (Note [The loss inside the graph], step 4).
        # Note [Optimization hints, computed once per expression] in lower/fast.py.
        # Note [A warm start without the joint trace] (lower/warm.py): on CPU, AOTAutogradCache holds
        # dpfx's own output code, which runs dpfx's inner compiler again when it is loaded.
        # (torch's own switch for that cache, enable_autograd_cache, turns it off here too)
        cached = self.config.backend == "inductor" and _device_of(example_inputs).type == "cpu" \
            and torch._functorch.config.enable_autograd_cache
        patches = inductor_patches(example_inputs)
        if cached:
            # Note [A trusted warm start] (lower/warm.py): the key names every setting the
            # rewritten graphs depend on, so an entry's code serves only the same settings
            patches = {**patches, "post_grad_custom_post_pass": cache_key_pass(
                torch._inductor.config.post_grad_custom_post_pass,
                extra=repr(([str(d) for d in self.decisions], self.config, self._input_kinds,
                            sorted(self._targets))))}
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

    @staticmethod
    def _constants(model: torch.nn.Module) -> set[int]:
        return {id(b) for b in model.buffers()} | {
            id(p) for p in model.parameters() if not p.requires_grad}

    def _check_same_parameters(self) -> None:
        """A capture after compile (dynamo captures again when the model changed) sees the
        parameters dpfx.compile saw: the clipping groups, the gradient guards and the optimizer
        were set up for those. Buffers may come and go (constants to the graph)."""
        model = self._model()
        if model is None:
            return
        now = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        if now != self.param_names:
            added = sorted(set(now.values()) - set(self.param_names.values()))
            removed = sorted(set(self.param_names.values()) - set(now.values()))
            raise PrivacyError(
                f"the model's trainable parameters changed after dpfx.compile (added: "
                f"{added or 'none'}; removed or replaced: {removed or 'none'}): the clipping "
                f"groups, gradient guards and the optimizer were set up for the parameters at "
                f"compile time. Call dpfx.compile again after changing the model (and build a "
                f"new DPOptimizer).")
        self.buffer_ids = self._constants(model)

    def _kind(self, x: Any, source: str | None) -> str:
        if not isinstance(x, torch.Tensor):
            return "symint"
        if id(x) in self.param_names:
            return "param:" + self.param_names[id(x)]
        if id(x) in self.buffer_ids or isinstance(x, torch.nn.Parameter):
            return "constant"
        if source is not None and not source.startswith(_CALL_ARGUMENTS):
            return "constant"   # Note [Tensors the model holds are not inputs]
        return "input"

    # -- inner compiler: one call for the forward, one for the backward --------------------------
    def _inner(self, gm: fx.GraphModule, example_inputs: list, **kwargs) -> Any:
        if self.config.backend != "inductor" or _device_of(example_inputs).type != "cpu":
            return self.compile_graph(gm, example_inputs, kwargs)
        graph = warm.snapshot(gm)     # before dpfx's passes rewrite it
        stages = dict(self.stages.graphs)
        self._made = None
        code = warm.DPOutputCode(self.compile_graph(gm, example_inputs, kwargs), graph, kwargs)
        if self._made is not None:     # Note [A trusted warm start] in lower/warm.py
            lowered, plan = self._made
            plan["stages"] = {k: v for k, v in self.stages.graphs.items() if stages.get(k) != v}
            code.trust(lowered, plan)
            if kwargs.get("is_backward"):
                forward = self._outputs.pop(kwargs.get("graph_id"), None)
                if forward is not None and forward.plan is not None:
                    forward.plan["pair"] = plan["pair"]
            else:
                self._outputs[kwargs.get("graph_id")] = code
        return code

    def compile_graph(self, gm: fx.GraphModule, example_inputs: list, kwargs: dict) -> Any:
        """dpfx's inner compiler proper: on a fresh trace, or on a graph loaded from
        AOTAutogradCache (lower/warm.py)."""
        self.compiles += 1
        warm.state.compiled += 1
        if kwargs.get("is_backward"):
            runner = self._backward(gm, example_inputs, kwargs)
        else:
            runner = self._forward_graph(gm, example_inputs, kwargs)
        return runner

    def _forward_graph(self, gm, example_inputs, kwargs):
        batch_inputs = {}
        for node in gm.graph.find_nodes(op="placeholder"):
            idx = _input_index(node)
            if idx is not None and self._input_kinds[idx] == "input":
                batch_inputs[node.name] = 0
        info = compile_forward(gm, batch_inputs, self.stages,
                               check=not kwargs.get("is_inference", False),
                               problems=self.problems)
        self._forward[kwargs.get("graph_id")] = info
        reference = Half.of(gm, None) if self._checking() else None
        compiled = self._lower(gm, example_inputs, kwargs)
        if self._trustable(gm, info):
            self._made = (compiled, {"kind": "forward"})
            self._lowered_forwards[kwargs.get("graph_id")] = compiled
        check = None
        if reference is not None:
            reference.compiled = compiled
            # the captured loss's value: a sum over the batch by design (loss/captured.py)
            layouts = ["loss" if i in info.loss_outputs else
                       "side" if i in info.side_outputs else lay
                       for i, lay in enumerate(info.output_layouts)]
            targets = {n.name for n in gm.graph.find_nodes(op="placeholder")
                       if _input_index(n) in self._targets}
            check = GraphCheck(reference, layouts, info.batch_symbols,
                               set(batch_inputs), _device_of(example_inputs), self.decisions,
                               targets, always=self.config.self_check == "always")
            self._checks[kwargs.get("graph_id")] = check

        return self._forward_runner(compiled, check)

    def _forward_runner(self, compiled, check):
        def run_forward(args):
            if check is not None and check.ready(args):
                # Note [Checking what Inductor generated]; its synthetic norms are not the user's.
                saved = copy.deepcopy(self.norm_stats.__dict__) if self.norm_stats else None
                with block_ops.stand_ins():
                    check.run(args)
                if saved is not None:
                    self.norm_stats.__dict__.update(saved)
            self.gate.graph_forward()
            with block_ops.live():
                return compiled(args)

        run_forward._boxed_call = True
        return run_forward

    def _backward(self, gm, example_inputs, kwargs):
        fw = self._forward.get(kwargs.get("graph_id"))
        if fw is None:
            raise CaptureError("dpfx saw a backward graph without its forward graph")
        output = gm.graph.find_nodes(op="output")[0]
        param_outputs = {}
        for i, desc in enumerate(_descs(output, len(output.args[0]))):
            idx = getattr(getattr(desc, "grad_of", None), "idx", None)
            if idx is None or output.args[0][i] is None:
                continue
            kind = self._input_kinds[idx]
            if kind.startswith("param:"):
                param_outputs[i] = kind[len("param:"):]
        tangents = {}
        for node in gm.graph.find_nodes(op="placeholder"):
            desc = node.meta.get("desc")
            out_idx = getattr(getattr(desc, "output", None), "idx", None)
            if type(desc).__name__ == "TangentAOTInput" and out_idx is not None:
                tangents[node.name] = out_idx
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        device = _device_of(example_inputs)
        _loss_tangent_is_one(gm, [ph for ph, i in tangents.items() if i in fw.loss_outputs])
        sink = self.norm_stats.sink if self.norm_stats is not None else None
        self.last_backward = compile_backward(gm, fw, param_outputs, tangents, self.config,
                                              fake_mode, device, self.stages, self.problems,
                                              norm_sink=sink)
        self.param_grads = self.last_backward.grads
        if self.problems:
            return _refuse_to_run
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
        check = self._checks.get(kwargs.get("graph_id"))
        reference = Half.of(gm, None) if check is not None else None
        adaptive = self.last_backward.adaptive
        padded = self.last_backward.padded
        # the graph's last inputs: B of a padded batch, then C_t (passes/__init__._scalar_input)
        added = list(gm.graph.find_nodes(op="placeholder"))[-(padded + adaptive):] \
            if padded or adaptive else []
        example_inputs = [*example_inputs, *(p.meta["val"] for p in added)]
        with torch._inductor.config.patch(fallback_random=not native_noise):
            compiled = self._lower(gm, example_inputs, kwargs)
        if check is not None:
            reference.compiled = compiled
            check.backward = reference
            # Inductor's GPU Philox stream is not eager's: noise in the graph would differ.
            check.compare_backward = not native_noise or self.config.noise == "optimizer"
        positions = {pg.name: pg.output_index for pg in self.param_grads}
        if check is not None and not adaptive and not padded:
            # Note [The second size grows the first] (lower/selfcheck.py)
            config = self.config
            divisor = 1.0 if config.noise == "optimizer" or config.loss_reduction == "sum" \
                else float(config.expected_batch_size) if config.expected_batch_size else None
            check.release = Release(frozenset(positions.values()), divisor, math.sqrt(
                sum(c * c for c in config.clip_bounds.values())),
                mean=config.loss_reduction == "mean")
        zero_tangents = self.last_backward.zero_tangents
        forward = self._lowered_forwards.pop(kwargs.get("graph_id"), None)
        if forward is not None and not native_noise:
            plan = {"kind": "backward", "positions": positions, "zero_tangents": zero_tangents,
                    "adaptive": adaptive, "padded": padded}
            plan["pair"] = pair_verdict(forward, compiled, check)
            if plan["pair"] is not None:
                self._made = (compiled, plan)
                if check is not None:
                    check.verdict = plan["pair"]
        return self._backward_runner(compiled, positions, zero_tangents, adaptive, device,
                                     padded)

    def _backward_runner(self, compiled, positions: dict, zero_tangents: list, adaptive: bool,
                         device: torch.device, padded: bool = False):
        """The compiled backward's runner: the gate's admission, the noise seed, the released
        gradients handed to the gate."""
        if adaptive:
            compiled = self._with_bound(compiled, device)
        if padded:      # appended before C_t: the outer wrapper
            compiled = self._with_real_examples(compiled, device)
        elsewhere = [i for name, i in positions.items() if name in self.released_elsewhere]
        positions = {name: i for name, i in positions.items()
                     if name not in self.released_elsewhere}

        def produced(outs):
            # for the gate's check_gradient: Note [Every gradient a parameter receives is dpfx's]
            if elsewhere and not isinstance(outs, list):
                outs = list(outs)
            for i in elsewhere:
                outs[i] = None      # zeros without storage: the sum went to its block's place
            self.gate.produced({name: outs[i] for name, i in positions.items()})
            return outs

        if self.config.noise == "optimizer":     # no random op in the graph
            def run_deferred(args):
                self.gate.admit_backward()
                _check_zero_tangents(args, zero_tangents)
                with block_ops.live():
                    return produced(compiled(args))

            run_deferred._boxed_call = True
            return run_deferred

        # Note [Where the graph's noise seed comes from]
        # Every step runs under a fresh seed: from the OS's CSPRNG (secrets) by default, so the
        # noise cannot be predicted from the user's torch.manual_seed (torch's default generator
        # starts from a fixed seed in every process); from a generator seeded with ``seed`` when
        # one is given, for reproducible runs. The stream itself is torch's (MT19937 on CPU,
        # Philox on GPU): for noise from a cryptographic source use DPOptimizer(secure_mode=True).
        generator = _device_generator(device)

        def run_backward(args):
            self.gate.admit_backward()
            _check_zero_tangents(args, zero_tangents)
            if self._generator is None:
                step_seed = secrets.randbits(62)
            else:
                step_seed = int(torch.randint(2**62, (1,), generator=self._generator))
            # Save, reseed and restore the one generator the graph draws from: ~5 us, where
            # fork_rng + torch.manual_seed cost ~250 us on CPU (it visits every device type).
            saved = generator.get_state()
            generator.manual_seed(step_seed)
            try:
                with block_ops.live():
                    return produced(compiled(args))
            finally:
                generator.set_state(saved)

        run_backward._boxed_call = True
        return run_backward

    # -- Note [A trusted warm start] in lower/warm.py --------------------------------------------
    def _trustable(self, gm: fx.GraphModule, info: ForwardInfo) -> bool:
        """Whether a cache entry of this forward (and its backward) may run without the passes
        in a later process: the code holds nothing of this process (a block's kernels, a norm
        sink) and the self-check's verdict does not depend on sizes read at run time."""
        if self.config.backend != "inductor" or self.problems is not None \
                or self.config.track_norms or self.config.self_check == "always":
            return False
        if any(str(n.target).startswith("dpfx.block_") for n in gm.graph.nodes
               if n.op == "call_function"):
            return False
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta.get("val")
            sizes = value.shape if isinstance(value, torch.Tensor) else \
                [value] if isinstance(value, torch.SymInt) else []
            for size in sizes:
                if isinstance(size, torch.SymInt) and \
                        not size.node.expr.free_symbols <= set(info.batch_symbols):
                    return False
        return True

    def trusts(self, plan: dict) -> bool:
        """Whether this compile runs a cache entry's code as it is: its self-check passed
        before (or is off) and nothing here asks for the passes to run again."""
        if self.config.backend != "inductor" or self.problems is not None \
                or self.config.track_norms or self.config.self_check == "always":
            return False
        if not self._checking():
            return True
        pair = plan.get("pair")
        return pair is not None and os.path.exists(verdict_path(pair))

    def load_trusted(self, plan: dict, compiled, kwargs: dict):
        """The runner of a trusted entry's lowered code, as a compile of its graph would have
        made it."""
        self.compiles += 1
        for name, text in plan.get("stages", {}).items():
            self.stages.graphs[name] = text
            if self.stages.on_stage is not None:
                self.stages.on_stage(name, text)
        if plan["kind"] == "forward":
            return self._forward_runner(compiled, None)
        self.param_grads = [TrustedGrad(name, i) for name, i in plan["positions"].items()]
        self.last_backward = None
        return self._backward_runner(compiled, plan["positions"], plan["zero_tangents"],
                                     plan["adaptive"], torch.device("cpu"), plan["padded"])

    def _with_bound(self, compiled, device: torch.device):
        """The compiled backward called with C_t appended to its arguments; its last output, the
        step's count of unclipped examples, goes to the adaptive bound's owner: noised
        (noise="graph": C_{t+1} is set at once) or raw (noise="optimizer": DPOptimizer.step
        noises the logical batch's count once). Note [Adaptive clipping] in
        privacy/adaptive.py."""
        state, config, gate = self.adaptive_clip, self.config, self.gate

        def run(args):
            examples = gate.pending
            args.append(state.tensor(device))
            outs = list(compiled(args))
            count = outs.pop()
            if config.noise == "optimizer":
                state.add_count(count)
            else:
                state.released(float(count), config.expected_batch_size or examples)
            return outs

        run._boxed_call = True
        return run

    def _with_real_examples(self, compiled, device: torch.device):
        """The compiled backward called with the count of real examples of its forward's padded
        batch appended to its arguments (Note [Padded rows contribute zero] in
        passes/clip_noise.py); ``norm_stats`` records those rows' norms only."""
        gate, stats = self.gate, self.norm_stats

        def run(args):
            real = gate.pending
            args.append(torch.tensor(float(real), dtype=torch.float32, device=device))
            if stats is None:
                return compiled(args)
            stats.rows = real
            try:
                return compiled(args)
            finally:
                stats.rows = None

        run._boxed_call = True
        return run

    def _checking(self) -> bool:
        return self.config.self_check is not False and self.config.backend == "inductor" \
            and self.problems is None

    def _lower(self, gm, example_inputs, kwargs):
        return lower(gm, example_inputs, kwargs, self.config.backend)

    def _dump(self, stage: str, text: str) -> None:
        directory = os.environ.get("DPFX_DUMP_DIR")
        if not directory:
            return
        os.makedirs(directory, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", stage)
        with open(os.path.join(directory, f"{self.compiles:03d}_{safe}.txt"), "w") as f:
            f.write(text)


@dataclasses.dataclass(frozen=True)
class TrustedGrad:
    """A parameter's gradient output in a graph loaded from a trusted cache entry."""
    name: str
    output_index: int


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


def _check_zero_tangents(args, positions: list[int]) -> None:
    """Note [Batch-free forward outputs: gradient zero or refused] in passes/__init__.py."""
    for i in positions:
        t = args[i]
        if isinstance(t, torch.Tensor) and t.numel() and bool(t.ne(0).any()):
            raise PrivacyError(
                "a forward output without a batch dim, computed from parameters, received a "
                "nonzero gradient: a tensor the forward returns or stores on a module (such as "
                "the weight the deprecated nn.utils.weight_norm hook sets each forward) was used "
                "by the loss outside the dpfx-compiled module. No example's share of that "
                "gradient can be told apart, so it cannot be clipped. Compute such terms inside "
                "the module's forward from the data, or use "
                "torch.nn.utils.parametrizations.weight_norm. dpfx's graph has written no "
                "gradient.")


# Note [Tensors the model holds are not inputs]
# Every tensor the dpfx call receives carries the batch in dim 0 (api.py marks it unbacked). A
# tensor the model reads from elsewhere, a closure's cell (a causal mask built once and captured
# by a lambda: ``lambda x, mem: layer(x, mem, tgt_mask=causal)``), a global, an attribute that is
# not a registered buffer, reaches dynamo's graph as an input too, with the same size on every
# call; taken for a batch input, it would be refused as "specialized". dynamo names where
# each graph input comes from (its grapharg's source): those not read from the call's own
# arguments are constants to the graph, like buffers, the same on every call whatever the batch
# (dynamo guards on them). An input without a recorded source stays a batch input.
# (tests/lower/test_inductor_sweep.py, the decoder layer's causal mask)
_CALL_ARGUMENTS = ("L['args']", "L['kwargs']")


def _source_name(node: fx.Node) -> str | None:
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    try:
        return source.name if isinstance(source.name, str) else source.name()
    except AttributeError:
        return None


def _input_index(node: fx.Node) -> int | None:
    return getattr(node.meta.get("desc"), "idx", None)


def _descs(output: fx.Node, n: int) -> list:
    descs = output.meta.get("desc")
    if descs is None or len(descs) != n:
        raise CaptureError(
            "aot_autograd did not describe the backward outputs (torch too old or too new?); "
            "dpfx needs them to know which output is which parameter's gradient")
    return list(descs)


def _device_of(example_inputs) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _device_generator(device: torch.device) -> torch.Generator:
    """The default generator that ``randn`` (or Inductor's Philox seeds) on ``device`` reads."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


def _refuse_to_run(args):
    raise RuntimeError("dpfx.validate compiled this graph only to inspect it; it does not run")


_refuse_to_run._boxed_call = True
