"""The dpfx compiler, one screen: what happens to the forward and to the backward graph.

Inductor's ``compile_fx`` captures the model with aot_autograd (its own decompositions and
partitioner) and calls dpfx's inner compiler once for the forward and once for the backward graph.

    forward:   find batch dims -> check no op mixes examples -> lower
    backward:  find batch dims -> stack per-step products over time -> per-sample rewrite
               -> clip and noise -> verify -> lower

Every step is a named function of this package; ``Stages`` records the graph text after each one
for ``dpfx.explain`` and ``DPFX_DUMP_DIR``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx as fx

from dpfx.config import DPConfig
from dpfx.errors import CaptureError
from dpfx.graph import tags
from dpfx.graph.printer import format_graph
from dpfx.graph.batch import BatchAnalysis, BatchDim, Layout
from dpfx.passes.clip_noise import CLIP_BOUND, REAL_EXAMPLES, insert_clip_and_noise
from dpfx.graph.emit import Emitter
from dpfx.passes.per_sample import ParamGrad, RewriteContext, rewrite_per_sample
from dpfx.passes.schedule import place_norms_early
from dpfx.passes.stack_time import stack_over_time
from dpfx.passes.verify import (attention_side_output, check_forward, forward_problems, module_of,
                                verify_backward)

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Problem:
    """One reason a model cannot be trained privately as it is (``dpfx.validate``)."""
    kind: str  # "privacy" | "unsupported" | "capture"
    message: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"


@dataclasses.dataclass
class ForwardInfo:
    """What the backward compile needs to know about its forward graph."""
    batch_symbols: set
    layouts: dict[str, Layout]  # forward node name -> layout (saved tensors keep their names)
    output_layouts: list[Layout]
    # outputs of a captured loss without a batch dim: its value, its normalizers (loss/captured.py)
    loss_outputs: set = dataclasses.field(default_factory=set)
    # outputs that are a fused attention kernel's RNG state or book-keeping, saved for its
    # backward (Note [Attention kernels keep the leading dims apart] in verify/forward.py); the
    # self-check does not compare them (Note [Attention kernels' side outputs are not compared])
    side_outputs: set = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class BackwardResult:
    """The rewritten backward graph and what the passes knew about it (for tests and explain)."""
    gm: fx.GraphModule
    analysis: BatchAnalysis
    grads: list[ParamGrad]
    private: dict[str, fx.Node]
    # positions (among the graph's inputs) of batch-free tangents that must be zero at run time
    zero_tangents: list[int] = dataclasses.field(default_factory=list)
    # adaptive clipping (Note [Adaptive clipping] in privacy/adaptive.py): the graph reads C_t
    # as its last input and returns the step's count of unclipped examples as its last output
    adaptive: bool = False
    # batch_buckets (Note [Padded rows contribute zero] in clip_noise.py): the graph reads the
    # count of real examples as its input before C_t's (its last without adaptive clipping)
    padded: bool = False


@dataclasses.dataclass
class Stages:
    """Readable graph text after each pass, in order."""
    graphs: dict[str, str] = dataclasses.field(default_factory=dict)
    on_stage: Callable[[str, str], None] | None = None

    def record(self, name: str, gm: fx.GraphModule, batch_symbols, output_names=None) -> None:
        text = format_graph(gm, name, batch_symbols, output_names)
        self.graphs[name] = text
        if self.on_stage is not None:
            self.on_stage(name, text)


def compile_forward(gm: fx.GraphModule, batch_inputs: dict[str, int], stages: Stages,
                    check: bool = True, problems: list | None = None) -> ForwardInfo:
    """``batch_inputs``: placeholder name -> batch dim, for the user's tensor inputs.
    With a ``problems`` list, refusals are appended to it instead of raised (dpfx.validate)."""
    _check_convolution_layouts(gm)
    symbols = _batch_symbols(gm, batch_inputs)
    seeds = {name: BatchDim(d) for name, d in batch_inputs.items()}
    an = BatchAnalysis(gm.graph, symbols, seeds)
    stages.record("forward", gm, symbols)
    # Note [The loss inside the graph] in loss/captured.py: the captured loss's gradient program
    # was proven before aot_autograd, by the loss check's rules
    for node in gm.graph.nodes:
        if tags.is_loss(node):
            node.meta["dpfx"] = "loss"
    if problems is not None:
        problems.extend(Problem("privacy", m) for m in forward_problems(gm, an, skip={"loss"}))
    elif check:
        check_forward(gm, an, skip={"loss"})
    out = gm.graph.find_nodes(op="output")[0]
    outs = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    return ForwardInfo(
        batch_symbols=symbols,
        layouts={n.name: an.layout(n) for n in gm.graph.nodes},
        output_layouts=[an.layout(o) if isinstance(o, fx.Node) else None for o in outs],
        loss_outputs={i for i, o in enumerate(outs) if isinstance(o, fx.Node) and tags.is_loss(o)
                      and an.layout(o) is None},
        side_outputs={i for i, o in enumerate(outs)
                      if isinstance(o, fx.Node) and attention_side_output(o)},
    )


# Note [Channels-last convolutions are refused]
# With the batch size an unbacked symbol, torch's shape functions give a convolution contiguous
# output strides even where its kernel returns channels-last (an input or a weight in
# channels-last memory format): the graph's next view then fails on real tensors, in the eager
# backend and in the self-check's reference run, and only Inductor's own copies hide it. Rather
# than run a graph whose traced layouts are not the real ones, such convolutions are refused
# with the fix. The input reaches here channels-last only when a model calls torch's convolution
# by a name dpfx does not swap: ``F.conv2d`` and ``F.conv3d`` read ``input.contiguous()`` during
# capture (Note [Channels-last strides made inside the model] in capture/swaps.py); a channels-last
# weight is refused. (tests/rules/test_rule_convolution.py::test_channels_last_weight_is_refused_clearly)
def _check_convolution_layouts(gm: fx.GraphModule) -> None:
    for node in gm.graph.find_nodes(op="call_function", target=aten.convolution.default):
        for operand, what in zip(node.args[:2], ("input", "weight")):
            val = operand.meta.get("val") if isinstance(operand, fx.Node) else None
            if isinstance(val, torch.Tensor) and _channels_last(val):
                raise CaptureError(
                    f"dpfx: the convolution in {module_of(node)} reads its {what} in "
                    f"channels-last memory format (strides {tuple(val.stride())}). With the "
                    f"batch size symbolic, torch traces a convolution's output as contiguous "
                    f"while its kernel returns channels-last, so the traced graph would not be "
                    f"the one that runs. Fix: keep the model and its inputs in the default "
                    f"memory format (model.to(memory_format=torch.contiguous_format), "
                    f"x.contiguous()).")


def _channels_last(val: torch.Tensor) -> bool:
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(val.dim())
    return fmt is not None and val.is_contiguous(memory_format=fmt) and not val.is_contiguous()


def compile_backward(gm: fx.GraphModule, fw: ForwardInfo, param_outputs: dict[int, str],
                     tangent_outputs: dict[str, int], config: DPConfig, fake_mode: Any,
                     device: torch.device, stages: Stages,
                     problems: list | None = None, norm_sink: int | None = None
                     ) -> BackwardResult:
    """Rewrite ``gm`` in place so that every output in ``param_outputs`` (output index ->
    parameter name) is the DP-SGD gradient. Returns what each parameter's rewrite did."""
    output = gm.graph.find_nodes(op="output")[0]
    outs = list(output.args[0])
    names = {i: f"grad[{n}]" for i, n in param_outputs.items()}
    stages.record("backward.captured", gm, fw.batch_symbols, names)

    seeds = dict(fw.layouts)
    for ph, out_idx in tangent_outputs.items():
        seeds[ph] = fw.output_layouts[out_idx] if out_idx < len(fw.output_layouts) else None
    zero_tangents = _assume_zero_tangents(gm, {ph for ph in tangent_outputs if seeds[ph] is None})
    an = BatchAnalysis(gm.graph, fw.batch_symbols, seeds,
                       data_sources={n for n in gm.graph.find_nodes(op="placeholder")
                                     if n.name in tangent_outputs})
    if stack_over_time(gm.graph, an, fake_mode, [outs[i] for i in param_outputs]):
        outs = list(output.args[0])
        an = an.rerun(gm.graph)
    emit = Emitter(gm.graph, fake_mode, an, before=output)
    grads = [ParamGrad(name, i, outs[i]) for i, name in sorted(param_outputs.items())]
    if not grads:
        return BackwardResult(gm, an, grads, {}, zero_tangents)

    errors = [] if problems is not None else None
    rewrite_per_sample(RewriteContext(an, emit, config.strategy), grads, errors)
    if errors:
        problems.extend(Problem("unsupported", str(e)) for e in errors)
        return BackwardResult(gm, an, grads, {}, zero_tangents)
    stages.record("backward.per_sample", gm, fw.batch_symbols, names)
    # Note [Padded rows contribute zero] (clip_noise.py): B, before C_t (which stays last)
    real = _scalar_input(gm, fake_mode, device, REAL_EXAMPLES) \
        if config.batch_buckets is not None else None
    bound = _scalar_input(gm, fake_mode, device, CLIP_BOUND) if config.adaptive else None
    private = insert_clip_and_noise(emit, grads, config, device, norm_sink, bound, real)
    for pg in grads:
        outs[pg.output_index] = private[pg.name]
    if bound is not None:
        outs.append(private.pop(CLIP_BOUND))
    output.args = (tuple(outs),)
    gm.graph.eliminate_dead_code()
    _drop_dead_convolution_outputs(gm.graph)
    if device.type == "cpu":
        _input_gradients_channels_last(gm.graph, fake_mode)
    place_norms_early(gm.graph)
    gm.recompile()
    stages.record("backward.private", gm, fw.batch_symbols, names)

    verify_backward(gm, an, {pg.name: private[pg.name] for pg in grads}, config)
    gm.graph.lint()
    return BackwardResult(gm, an, grads, private, zero_tangents, adaptive=bound is not None,
                          padded=real is not None)


def _scalar_input(gm: fx.GraphModule, fake_mode: Any, device: torch.device,
                  name: str) -> fx.Node:
    """A new last input of the backward, a 0-d float32 tensor tagged ``name``: adaptive
    clipping's bound C_t (CLIP_BOUND), or the real examples of a padded batch (REAL_EXAMPLES)."""
    last = list(gm.graph.find_nodes(op="placeholder"))[-1]
    with gm.graph.inserting_after(last):
        node = gm.graph.placeholder(name)
    with fake_mode:
        node.meta["val"] = torch.empty((), dtype=torch.float32, device=device)
    node.meta["dpfx"] = name
    return node


# Note [Batch-free forward outputs: gradient zero or refused]
# A forward output without a batch dim that is computed from parameters (the weight that the
# deprecated nn.utils.weight_norm hook stores on its module each forward, which dynamo returns so
# it can set the attribute) gets a tangent in the backward, added to the gradient of that tensor's
# uses inside the graph. Its value is whatever the loss does with the output outside dpfx; no
# example's share of it can be told apart, so it cannot be clipped. In a normal step nothing uses
# the stored weight and autograd feeds zeros. dpfx drops ``add(tangent, x)`` to ``x`` (exact when
# the tangent is zero) and the backend checks at run time, before the graph runs, that every such
# tangent is zero, refusing the step with a PrivacyError otherwise (a regularizer on the stored
# weight, say). A batch-free tangent used any other way stays in the graph and is refused while
# compiling (per_sample._chain).
def _assume_zero_tangents(gm: fx.GraphModule, batch_free: set[str]) -> list[int]:
    """Drop the batch-free tangents that only feed ``add``s of their own shape; returns their
    positions among the graph's inputs (to be checked zero at run time)."""
    positions = []
    for pos, ph in enumerate(gm.graph.find_nodes(op="placeholder")):
        val = ph.meta.get("val")
        if ph.name not in batch_free or not ph.users or not isinstance(val, torch.Tensor):
            continue
        adds = list(ph.users)
        if not all(a.target == torch.ops.aten.add.Tensor and len(a.args) == 2 and not a.kwargs
                   and a.args[0] is not a.args[1] and isinstance(a.args[0], fx.Node)
                   and isinstance(a.args[1], fx.Node)
                   and a.args[0].meta.get("val") is not None
                   and a.args[1].meta.get("val") is not None
                   and a.args[0].meta["val"].shape == a.args[1].meta["val"].shape
                   and a.args[0].meta["val"].dtype == a.args[1].meta["val"].dtype
                   for a in adds):
            continue
        for a in adds:
            other = a.args[1] if a.args[0] is ph else a.args[0]
            a.replace_all_uses_with(other)
            gm.graph.erase_node(a)
        positions.append(pos)
    if positions:
        gm.recompile()
    return positions


def _drop_dead_convolution_outputs(graph: fx.Graph) -> None:
    """The captured convolution_backward still computes the weight and bias gradients that the
    per-sample forms replaced (its output_mask); ask it only for the outputs still read. DCE
    cannot do this: the op returns a tuple. Measured 10-12% of a GroupNorm-CNN DP step."""
    import operator

    for node in graph.find_nodes(op="call_function",
                                 target=torch.ops.aten.convolution_backward.default):
        used = {u.args[1] for u in node.users if u.target is operator.getitem}
        mask = [bool(m) and i in used for i, m in enumerate(node.args[10])]
        if mask != list(node.args[10]):
            node.args = (*node.args[:10], mask)
            node.meta["val"] = tuple(v if keep else None
                                     for v, keep in zip(node.meta["val"], mask))


def _input_gradients_channels_last(graph: fx.Graph, fake_mode) -> None:
    """Route each input-gradient-only ``convolution_backward`` of a 2-D float32 convolution
    through ``dpfx::conv2d_input_grad`` (Note [Conv2d input gradients in channels-last] in
    ops/conv.py): the same gradient, computed channels-last, without ATen's NCHW
    conversions. CPU graphs only (the caller checks)."""
    import operator

    from dpfx.rules.convolution import ConvArgs

    op = torch.ops.dpfx.conv2d_input_grad.default
    for node in graph.find_nodes(op="call_function",
                                 target=torch.ops.aten.convolution_backward.default):
        grad_out, image, weight = (a.meta.get("val") if isinstance(a, fx.Node) else None
                                   for a in node.args[:3])
        if (list(node.args[10]) != [True, False, False]
                or not all(isinstance(t, torch.Tensor) for t in (grad_out, image, weight))
                or weight.dim() != 4 or grad_out.dtype != torch.float32):
            continue
        args = ConvArgs.of(node)
        users = list(node.users)
        if (args.transposed
                or not all(isinstance(c, int) for c in (*args.stride, *args.padding,
                                                        *args.dilation, args.groups))
                or not all(u.target is operator.getitem and u.args[1] == 0 for u in users)):
            continue
        op_args = (args.grad_out, args.input, args.weight, args.stride, args.padding,
                   args.dilation, args.groups)
        with graph.inserting_before(node):
            grad = graph.call_function(op, op_args)
        grad.meta.update({k: node.meta[k] for k in ("stack_trace", "nn_module_stack",
                                                     "source_fn_stack") if k in node.meta})
        with fake_mode:
            grad.meta["val"] = op(grad_out, image, weight, *op_args[3:])
        for u in users:
            u.replace_all_uses_with(grad)
            graph.erase_node(u)
        graph.erase_node(node)


def _batch_symbols(gm: fx.GraphModule, batch_inputs: dict[str, int]) -> set:
    from dpfx.errors import CaptureError
    from dpfx.graph.batch import sym_expr
    import sympy

    symbols = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        if node.name in batch_inputs:
            size = sym_expr(node.meta["val"].shape[batch_inputs[node.name]])
            if not isinstance(size, sympy.Symbol):
                raise CaptureError(
                    f"the batch dim of input {node.name} was specialized to {size}; dpfx needs it "
                    f"symbolic (do not call torch._dynamo.mark_static on inputs)")
            symbols.add(size)
    if not symbols:
        raise CaptureError("the captured forward has no batched tensor input")
    return symbols
