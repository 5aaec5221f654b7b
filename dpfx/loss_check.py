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
import torch.utils._pytree as pytree
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from .passes.batch import BatchAnalysis, BatchDim, sym_expr
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
_INDEXING = {aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_put.default,
             aten.index_put_.default, aten._unsafe_index_put.default}


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
    shape: tuple            # an output's dim 0 is None (the batch)
    dtype: torch.dtype
    device: torch.device
    is_output: bool


def replay(calls: list, placeholders: list[Placeholder], loss_ref: tuple, batch: int
           ) -> tuple[fx.GraphModule, dict, list]:
    """make_fx of the recorded calls on fake inputs with one batch symbol. Returns the graph,
    node -> call index, and for each placeholder the multiple of the batch its dim 0 holds
    (None: no batch).

    Note [Which inputs of the loss carry the batch]
    The model's outputs carry it in dim 0. Another tensor the loss reads (labels, a mask) carries
    it when, in the first call that uses it, a tracked argument's dim 0 is ``k * B`` and the
    tensor's dim 0 is k times the step's batch size: ``F.cross_entropy(logits.view(-1, V),
    y.view(-1))`` pairs y's B*T rows with the logits' rows. Such a dim is taken as the batch
    flattened with each example's k rows together (``y.view(-1)`` of (B, T)). A first pass on
    fake tensors finds these sizes; the second is traced."""
    from torch._inductor.decomposition import select_decomp_table

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    symbol = env.create_symbol(_BATCH_HINT, ConstantSource("dpfx_loss_batch"), DimDynamic.DYNAMIC)
    sym_batch = env.create_symintnode(symbol, hint=_BATCH_HINT)
    factors: list = [1 if ph.is_output else None for ph in placeholders]
    record_of: dict[str, int] = {}
    with mode:
        fakes: dict[int, torch.Tensor] = {
            i: torch.empty((sym_batch, *ph.shape[1:]), dtype=ph.dtype, device=ph.device)
            for i, ph in enumerate(placeholders) if ph.is_output}

        def first_use(j: int, call_values: list) -> torch.Tensor:
            if j not in fakes:
                ph = placeholders[j]
                for v in call_values:
                    if not (isinstance(v, torch.Tensor) and v.dim() and ph.shape):
                        continue
                    size = sympy.sympify(sym_expr(v.shape[0]))
                    k = sympy.simplify(size / symbol)
                    if symbol in size.free_symbols and k.is_Integer and int(k) * batch == \
                            ph.shape[0]:
                        factors[j] = int(k)
                        fakes[j] = torch.empty((v.shape[0], *ph.shape[1:]), dtype=ph.dtype,
                                               device=ph.device)
                        break
                else:
                    fakes[j] = torch.empty(ph.shape, dtype=ph.dtype, device=ph.device)
            return fakes[j]

        run_calls(calls, first_use, lambda i: None)
        inputs = [fakes[i] for i in range(len(placeholders))]

        def on_record(index: int) -> None:
            for node in get_proxy_mode().tracer.graph.nodes:
                record_of.setdefault(node.name, index)

        def traced(*xs):
            return run_calls(calls, lambda j, _: xs[j], on_record)[loss_ref[0]][loss_ref[1]]

        gm = make_fx(traced, decomposition_table=select_decomp_table(),
                     tracing_mode="real")(*inputs)
    gm.graph.eliminate_dead_code()    # nll_loss's total_weight of a sum: computed, never used
    return gm, {n: record_of.get(n.name) for n in gm.graph.nodes}, factors


def run_calls(calls: list, placeholder: Callable, on_record: Callable) -> list:
    """Execute recorded calls: ("in", j) is placeholder j; (func, spec, leaves) a call whose
    leaves are ("p", j) placeholders, ("r", call, leaf) earlier results, ("c", value)."""
    values: list = []
    for i, call in enumerate(calls):
        if call[0] == "in":
            values.append([placeholder(call[1], [])])
            continue
        func, spec, descr = call
        results = [values[d[1]][d[2]] for d in descr if d[0] == "r"]
        leaves = [placeholder(d[1], results) if d[0] == "p" else values[d[1]][d[2]]
                  if d[0] == "r" else d[1] for d in descr]
        a, kw = unflatten(leaves, spec)
        values.append(pytree.tree_leaves(func(*a, **kw)))
        on_record(i)
    return values


def flatten(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """pytree's flatten, with a cheaper form for the common call without containers."""
    if not any(isinstance(a, (list, tuple, dict)) for a in args) and not any(
            isinstance(v, (list, tuple, dict)) for v in kwargs.values()):
        return [*args, *kwargs.values()], ("flat", len(args), tuple(kwargs))
    return pytree.tree_flatten((args, kwargs))


def unflatten(leaves: list, spec) -> tuple[tuple, dict]:
    if isinstance(spec, tuple):
        n = spec[1]
        return tuple(leaves[:n]), dict(zip(spec[2], leaves[n:]))
    return pytree.tree_unflatten(leaves, spec)


def analyze(gm: fx.GraphModule, placeholders: list[Placeholder], record_of: dict,
            factors: list) -> Verdict:
    phs = list(gm.graph.find_nodes(op="placeholder"))
    outputs = {ph for ph, p in zip(phs, placeholders) if p.is_output}
    symbols = {next(iter(outputs)).meta["val"].shape[0].node.expr}
    loss = gm.graph.find_nodes(op="output")[0].args[0]
    an = BatchAnalysis(gm.graph, symbols, {ph.name: BatchDim(0, inner=sympy.Integer(k))
                                           for ph, k in zip(phs, factors) if k is not None})
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
    exempt = _only_feeding(gm.graph, linear, on_outputs) | {
        n for n in gm.graph.find_nodes(op="call_function", target=aten.slice.Tensor)
        if _whole_slice(n)}
    for node, reason in mixing_ops(gm, an, skip=set()):
        # a sum over the batch that the loss then uses non-linearly: the structure says why
        if node not in exempt and not (structure and node.target in _SUMS | _MEANS):
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
    return _verdict(gm, terms, batch)


def _verdict(gm, terms, batch) -> Verdict:
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
    for node in graph.find_nodes(op="call_function", target=prims.convert_element_type.default):
        # the same cast through aten: prims' Python wrapper costs ~15 us a call
        node.target, node.args = aten._to_copy.default, (node.args[0],)
        node.kwargs = {"dtype": node.meta["val"].dtype}
    # its forward, called directly: Module.__call__'s hooks machinery costs more than the ops
    return fx.GraphModule(gm, graph).forward


def _whole_slice(node: fx.Node) -> bool:
    """``x[:, 0]`` slices every dim before the one it selects: start 0, step 1, no end."""
    start, end, step = (list(node.args[2:]) + [None, None, None])[:3]
    return start in (None, 0) and step in (None, 1) and (end is None or (
        isinstance(end, int) and end >= 2**62))


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
