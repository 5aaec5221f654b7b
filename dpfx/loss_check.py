"""The loss check: is the loss a constant times a sum over examples of per-example terms?

    out = dp_model(x)                      # tracked (loss_track.py) in training mode
    loss = F.cross_entropy(out, y)         # recorded: one call
    loss.backward()                        # replayed here with a symbolic batch, then released

``loss_track.py`` records the torch calls that lead from dpfx's outputs to the loss. This module
replays them under ``make_fx`` with Inductor's decompositions, on fake tensors whose dim 0 is one
batch symbol (the model's outputs, and every other tensor the loss used whose dim 0 has the batch
size), and proves on the ATen graph:

1. No op mixes examples: the forward check's rules (``verify.mixing_ops``: a reduction over the
   batch, an op whose ``dim`` names the batch, a layout that cannot be proven) plus indexing
   along the batch dim (``out[perm]``), anywhere, also on the labels' side (a batch statistic of
   the labels that reaches a per-example term couples examples just the same).
2. The terminal rule: from the loss down, only linear ops (add, sub, neg, views, sums and means
   over any dims, products with values that do not depend on the outputs) until a ``sum``/``mean``
   whose input carries the batch. So ``loss = sum_k c_k * sum_i t_k(out_i)``.
3. Each term's scale ``c_k`` is ``w_k * B^p * prod_j N_j^q_j``: a constant weight ``w_k``, a power
   of the batch size, and *normalizers* N_j, scalars computed from the labels or other inputs
   (the count of non-ignored tokens of a token mean, ``mask.sum()``, HF's
   ``num_items_in_batch``). The exceptions to rule 1 are the reductions that only feed these.

Note [Batch-dependent scales are removed, constant weights kept]
A scale that depends on the batch couples examples even when the terms do not: a token mean
divides every example's gradient by the whole batch's token count N, and one added example
changes N, so the release moves by more than C. dpfx evaluates ``B^p * prod N_j^q_j`` on the
step's real inputs and multiplies the backward's starting gradient by its inverse (times B for
loss_reduction="mean", whose graph undoes a 1/B): every example's gradient is then that of its
own ``w_k * t_k``, a token mean's becomes the example's token *sum*, whatever the batch holds.
The loss value the user sees is untouched; a scale that differs from the declared reduction
(a sum with "mean") is warned about once (``LossScaleWarning``).
(tests/test_loss_check.py::test_token_mean_neighbours_move_at_most_C)
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from .passes.batch import BatchAnalysis, BatchDim
from .passes.verify import mixing_ops

aten = torch.ops.aten
prims = torch.ops.prims

# A batch size that no other size of a loss computation is likely to equal: make_fx's symbolic
# shapes need a hint, and a Python number equal to it (the batch size written as a number) is
# then a shape error rather than a silent match.
_BATCH_HINT = 7919

_SUMS = {aten.sum.default, aten.sum.dim_IntList}
_MEANS = {aten.mean.default, aten.mean.dim}
_PASS_THROUGH = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                 aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
                 aten.unsqueeze.default, aten.clone.default, aten.alias.default,
                 aten.permute.default, aten.expand.default, prims.convert_element_type.default,
                 aten._to_copy.default, aten.detach.default, aten.neg.default,
                 aten.select.int, aten.slice.Tensor, aten.t.default, aten.transpose.int}
_PRODUCTS = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
_SUMS_OF_TWO = {aten.add.Tensor, aten.sub.Tensor}
# Ops that pick rows by data: along the batch dim they give example i another example's row.
_INDEXING = {aten.index.Tensor, aten._unsafe_index.Tensor}


class LossRefused(Exception):
    """A reason the loss is not a per-example sum, at the recorded call that caused it."""

    def __init__(self, record: int | None, op: str, reason: str):
        super().__init__(reason)
        self.record, self.op, self.reason = record, op, reason


@dataclasses.dataclass(frozen=True)
class Term:
    weight_power: int           # p in B^p
    normalizers: tuple          # ((index into Verdict.normalizer outputs, power q), ...)


@dataclasses.dataclass
class Verdict:
    """What the check proved: the terms' batch-dependent scales, and how to evaluate them."""
    terms: list[Term]
    evaluate_normalizers: Callable | None   # real inputs -> tuple of scalar tensors
    declared: str                           # "mean" | "sum": the scale the loss itself has


@dataclasses.dataclass(frozen=True)
class Placeholder:
    shape: tuple            # dim 0 replaced by None when ``batched``
    dtype: torch.dtype
    device: torch.device
    batched: bool
    is_output: bool


def replay(records: list, placeholders: list[Placeholder], loss_ref: tuple, run: Callable
           ) -> tuple[fx.GraphModule, dict]:
    """make_fx of the recorded calls on fake inputs with one batch symbol. ``run(records,
    inputs, loss_ref, on_record)`` executes them. Returns the graph and node -> record index."""
    from torch._inductor.decomposition import select_decomp_table

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=False)
    batch = env.create_symintnode(
        env.create_symbol(_BATCH_HINT, ConstantSource("dpfx_loss_batch"), DimDynamic.DYNAMIC),
        hint=_BATCH_HINT)
    record_of: dict[str, int] = {}

    def on_record(index: int) -> None:
        for node in get_proxy_mode().tracer.graph.nodes:
            record_of.setdefault(node.name, index)

    with mode:
        inputs = [torch.empty(((batch,) + ph.shape[1:]) if ph.batched else ph.shape,
                              dtype=ph.dtype, device=ph.device) for ph in placeholders]
        gm = make_fx(lambda *xs: run(records, xs, loss_ref, on_record),
                     decomposition_table=select_decomp_table(), tracing_mode="real")(*inputs)
    return gm, {n: record_of.get(n.name) for n in gm.graph.nodes}


def analyze(gm: fx.GraphModule, placeholders: list[Placeholder], record_of: dict) -> Verdict:
    phs = list(gm.graph.find_nodes(op="placeholder"))
    batch_ph = [ph for ph, p in zip(phs, placeholders) if p.batched]
    outputs = {ph for ph, p in zip(phs, placeholders) if p.is_output}
    symbols = {batch_ph[0].meta["val"].shape[0].node.expr} if batch_ph else set()
    loss = gm.graph.find_nodes(op="output")[0].args[0]
    if not symbols:
        return Verdict([], None, "sum")
    an = BatchAnalysis(gm.graph, symbols, {ph.name: BatchDim(0) for ph in batch_ph})
    batch = an.batch
    on_outputs = _descendants(gm.graph, outputs)

    def refuse(node, reason):
        raise LossRefused(record_of.get(node), _op_name(node), reason)

    val = loss.meta.get("val") if isinstance(loss, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.numel() != 1:
        raise LossRefused(None, "backward", "the loss is not a single number: call backward on "
                          "the mean or the sum over dim 0 of per-example losses")

    terms: list[tuple] = []        # (scale sympy expr, ((normalizer node, power), ...))
    linear: set[fx.Node] = set()

    def walk(node: fx.Node, scale, norms: tuple) -> None:
        if node not in on_outputs:
            return                  # an added constant: no gradient reaches the outputs
        linear.add(node)
        t = node.target
        if an.is_batched(node):
            refuse(node, "reaches the loss without a sum or mean over the batch")
        if t in _SUMS or t in _MEANS:
            src = node.args[0]
            if t in _MEANS:
                scale = scale * _prod(an.shape(node.meta["val"])) / _prod(an.shape(src.meta["val"]))
            if an.is_batched(src):
                terms.append((scale, norms, node))
                return
            return walk(src, scale, norms)
        if t in _PASS_THROUGH:
            sign = -1 if t is aten.neg.default else 1
            return walk(node.args[0], scale * sign, norms)
        if t in _SUMS_OF_TWO:
            alpha = node.kwargs.get("alpha", 1)
            walk(node.args[0], scale, norms)
            if isinstance(node.args[1], fx.Node):
                walk(node.args[1], scale * (-alpha if t is aten.sub.Tensor else alpha), norms)
            return
        if t in _PRODUCTS:
            a, b = node.args[:2]
            divide = t in (aten.div.Tensor, aten.div.Scalar)
            if isinstance(b, fx.Node) and b in on_outputs:
                if divide or (isinstance(a, fx.Node) and a in on_outputs):
                    refuse(node, "multiplies or divides two values computed from the model's "
                                 "outputs over the batch (the loss is not a sum of per-example "
                                 "terms)")
                a, b = b, a
            if node.kwargs.get("rounding_mode") is not None:
                refuse(node, "rounds a value computed from the model's outputs")
            if not isinstance(b, fx.Node):
                factor = sympy.nsimplify(b) if isinstance(b, (int, float)) else None
                if factor is None:
                    refuse(node, f"scales the loss by {b!r}")
                return walk(a, scale / factor if divide else scale * factor, norms)
            if _depends_on_inputs(b):
                if b.meta["val"].numel() != 1:
                    if any(an.is_batched(x) for x in _ancestors(b)):
                        refuse(node, "weights the batch's sum with values computed over the "
                                     "whole batch")
                    return walk(a, scale, norms)        # a constant weight tensor
                return walk(a, scale, norms + ((b, -1 if divide else 1),))
            return walk(a, scale, norms)                # a tensor constant: a weight
        refuse(node, "is not a sum or mean over the batch of per-example terms (only sums, means, "
                     "constant weights and normalizers may combine examples)")

    try:
        walk(loss, sympy.Integer(1), ())
        for node in linear:
            if any(u not in linear and u.op != "output" for u in node.users):
                refuse(node, "combines the batch's examples into a value that the loss then "
                             "uses per example (e.g. centering or scaling by a batch statistic)")
        structure = None
    except LossRefused as e:
        structure = e
    # A mixing op is the more useful report: it is where the examples meet.
    exempt = _only_feeding(gm.graph, linear, on_outputs)
    for node, reason in mixing_ops(gm, an, skip=set()):
        if node not in exempt:
            refuse(node, reason)
    for node in gm.graph.nodes:
        if node.target in _INDEXING and node not in exempt:
            src = an.layout(node.args[0]) if isinstance(node.args[0], fx.Node) else None
            idx = node.args[1]
            if isinstance(src, BatchDim) and src.dim < len(idx) and idx[src.dim] is not None:
                refuse(node, "picks rows along the batch dim by index (example i would use "
                             "another example's row)")
    if structure is not None:
        raise structure
    return _verdict(gm, terms, batch, placeholders)


def _verdict(gm, terms, batch, placeholders) -> Verdict:
    norm_nodes: list[fx.Node] = []
    out_terms, declared = [], set()
    for scale, norms, node in terms:
        scale = sympy.powsimp(sympy.nsimplify(scale))
        weight, power = scale.as_coeff_exponent(batch)
        if batch in sympy.sympify(weight).free_symbols or not power.is_integer:
            raise LossRefused(None, "scale", f"the loss's scale {scale} depends on the batch size "
                                             f"in a way dpfx cannot undo")
        refs = []
        for n, q in norms:
            if n not in norm_nodes:
                norm_nodes.append(n)
            refs.append((norm_nodes.index(n), q))
        declared.add("mean" if power < 0 or any(q < 0 for _, q in refs) else "sum")
        out_terms.append(Term(int(power), tuple(refs)))
    evaluate = _extract(gm, norm_nodes) if norm_nodes else None
    return Verdict(out_terms, evaluate, declared.pop() if len(declared) == 1 else "mixed")


def _extract(gm: fx.GraphModule, nodes: list[fx.Node]) -> Callable:
    """A graph computing the normalizers from the real inputs (they never read the outputs)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    needed = set().union(*(_ancestors(n) | {n} for n in nodes))
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node in needed:
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[n] for n in nodes))
    module = fx.GraphModule(gm, graph)
    return module


def _prod(sizes) -> sympy.Expr:
    out = sympy.Integer(1)
    for s in sizes:
        out = out * s
    return out


def _descendants(graph: fx.Graph, roots: set) -> set:
    found = set(roots)
    for node in graph.nodes:
        if any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _ancestors(node: fx.Node) -> set:
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _depends_on_inputs(node: fx.Node) -> bool:
    return any(a.op == "placeholder" for a in _ancestors(node) | {node})


def _only_feeding(graph: fx.Graph, linear: set, on_outputs: set) -> set:
    """The linear part, plus every node not computed from the outputs whose every use is in the
    set (the normalizers' own computation: a count over the batch's labels). A reduction that
    also feeds a per-example term is not exempt."""
    exempt = set(linear)
    for node in reversed(graph.nodes):
        if node.op in ("placeholder", "output") or node in exempt or node in on_outputs:
            continue
        if node.users and all(u in exempt for u in node.users):
            exempt.add(node)
    return exempt


def _op_name(node: fx.Node) -> str:
    target = node.target
    if target is operator.getitem:
        return "getitem"
    return str(getattr(target, "__name__", target)).replace(".default", "")


def eval_scale(verdict: Verdict, batch: int, inputs: list, reduction: str
               ) -> tuple[float, bool] | str:
    """The factor by which the backward's starting gradient is multiplied on this step so that
    each example's gradient is that of its own term (Note [Batch-dependent scales are removed,
    constant weights kept]), and whether it differs from 1; or why the terms cannot be put on
    one scale. ``reduction="mean"`` targets 1/B, which the backward graph undoes."""
    if batch == 0 or not verdict.terms:
        return 1.0, False
    values = verdict.evaluate_normalizers(*inputs) if verdict.evaluate_normalizers else ()
    scales = []
    for term in verdict.terms:
        s = float(batch) ** term.weight_power
        for i, q in term.normalizers:
            s *= float(values[i]) ** q
        scales.append(s)
    first = scales[0]
    if any(abs(s - first) > 1e-6 * max(abs(first), abs(s)) for s in scales[1:]):
        return ("the loss adds terms whose scales depend on the batch differently (for example "
                "a token mean over the batch's non-ignored tokens plus a mean over examples)")
    if first == 0 or first != first or first in (float("inf"), -float("inf")):
        return 1.0, False
    factor = (1.0 / batch if reduction == "mean" else 1.0) / first
    return factor, abs(factor - 1.0) > 1e-6
