"""The loss check: is the loss a scalar times a sum over examples of per-example terms?

    out = dp_model(x)                      # tracked (loss/track.py) in training mode
    loss = F.cross_entropy(out, y)         # recorded: one call
    loss.backward()                        # replayed here with a symbolic batch, then released

``loss/track.py`` records the torch calls that lead from dpfx's outputs to the loss, and
``loss/replay.py`` replays them under ``make_fx`` on fake tensors whose dim 0 is one batch symbol.
This module proves on that ATen graph (``analyze``):

1. No op mixes examples: the forward check's rules (``verify.mixing_ops``: a reduction over the
   batch, an op whose ``dim`` names the batch, a layout that cannot be proven) plus indexing
   along the batch dim (``out[perm]``), anywhere, also on the labels' side (a batch statistic of
   the labels that reaches a per-example term couples examples just the same).
2. The terminal rule: from the loss down, only linear ops (add, sub, neg, views, sums and means
   over any dims, products with values that do not depend on the outputs) until a ``sum``/``mean``
   whose input carries the batch. So ``loss = sum_k c_k * sum_i t_k(out_i)``.
3. Each term's scale ``c_k`` is ``s_k * v_k * B^p * prod_j N_j^q_j``: ``s_k`` from the sizes of
   means over an example's own positions (a mean over (B, K) divides by K), ``v_k`` the Python
   numbers the term is multiplied or divided by (replayed as scalar inputs: Note [Python numbers
   in the loss]), a power of the batch size (a mean over it, ``len(out)`` inside torch's
   ``kl_div``), and *normalizers* N_j, scalars computed from the labels or other inputs (the
   count of non-ignored tokens of a token mean, ``mask.sum()``, HF's ``num_items_in_batch``).
   The exceptions to rule 1 are the reductions that only feed the normalizers.

The answer is a ``Verdict``, which ``loss/scale.py`` evaluates on each step's values to remove
the batch-dependent part of each c_k. A model input that user code computed from the
batch's tensors is proven per row the same way (``analyze_rows``).

Note [The per-example term]
dpfx clips each example's gradient of its own term ``l_i = sum_k (v_k / v) * s_k * t_k(z_i)``,
``v = max_k |v_k|``: every scalar applied after the batch reduction is removed, whatever it is,
since dpfx cannot tell ``0.5`` from ``1 / len(y)`` and a factor that depends on the batch couples
examples even when the terms do not (a token mean divides every example's gradient by the whole
batch's token count N: one added example changes N, and with N inside each example's term the
release moves by more than C; a ``sum / len(y)`` clips each gradient at C * B). So the batch
size written any way (a mean, ``size(0)``, ``len(y)``, a Python int, ``reduction="batchmean"``),
a token count and a constant factor on the whole loss all give the same release; a mean over an
example's own positions stays a mean (Opacus's "mean" semantics). Terms may be weighted against
each other by Python numbers (``ce + 0.3 * mse``, a KL weight annealed by a schedule): those
ratios are the objective's, taken as given like any constant inside an example's term. Not
proven: that such a number does not depend on the batch (``ce.sum() / len(y) + aux.sum()``
weighs the terms by B); a ratio that changes between steps by powers of the batch size's change
is refused, which catches that only once the batch size has changed. Write the batch size as a
common factor of the whole loss, or with tensor ops (``.mean()``), where it is removed exactly.
dpfx evaluates the removed part on the step's real inputs and multiplies the backward's
starting gradient by its inverse (times 1/B for
loss_reduction="mean", whose graph undoes a 1/B); terms whose batch-dependent parts differ (a
token mean plus a mean over examples) each lose their own (Note [Terms on their own scales]).
The loss value the user sees is untouched, and a changed scale is warned about once
(``LossScaleWarning``).
(tests/loss/test_loss_corpus.py::test_one_added_example_moves_the_release_by_at_most_C_over_D)
"""
from __future__ import annotations

import operator
from typing import Callable

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from dpfx.graph.batch import BatchAnalysis, BatchDim, product, sym_expr
from dpfx.loss.replay import Placeholder, free_symbols
from dpfx.loss.scale import Term, Verdict
from dpfx.passes.verify import mixing_ops

aten = torch.ops.aten
prims = torch.ops.prims

_SUMS = {aten.sum.default, aten.sum.dim_IntList}
_MEANS = {aten.mean.default, aten.mean.dim}
_PASS_THROUGH = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                 aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
                 aten.unsqueeze.default, aten.clone.default, aten.alias.default,
                 aten.permute.default, aten.expand.default, prims.convert_element_type.default,
                 aten._to_copy.default, aten.detach.default, aten.neg.default,
                 aten.select.int, aten.slice.Tensor, aten.t.default, aten.transpose.int}
_PRODUCTS = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
_IN_PLACE_PRODUCTS = {aten.mul_.Tensor: aten.mul.Tensor, aten.mul_.Scalar: aten.mul.Scalar,
                      aten.div_.Tensor: aten.div.Tensor, aten.div_.Scalar: aten.div.Scalar}
_SUMS_OF_TWO = {aten.add.Tensor, aten.sub.Tensor}
# Ops that pick rows by data: along the batch dim they give example i another example's row.
_INDEXING = {aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_put.default,
             aten.index_put_.default, aten._unsafe_index_put.default}


class LossRefused(Exception):
    """A reason the loss is not a per-example sum, at the recorded call that caused it."""

    def __init__(self, record: int | None, op: str, reason: str, at_replay: bool = False):
        super().__init__(reason)
        self.record, self.op, self.reason = record, op, reason
        self.at_replay = at_replay      # the replay itself failed (not the check)


# Note [A stack of batch sums]
# A loss written per position, ``torch.stack([F.cross_entropy(o[:, t], y[:, t], reduction="sum")
# for t in range(T)]).sum() / B``, stacks scalars that are each a sum over the batch: ATen
# writes the stack as ``cat`` of unsqueezed scalars. A cat is linear (each entry of its result
# is one entry of one input), so above the batch reductions it is walked like an add: each
# input becomes its own term with the scale of the whole cat, and what follows the cat must
# itself pass the terminal rule (sums, means, selections, constant weights). So the loss stays
# ``sum_k c_k sum_i t_k(z_i)`` with public c_k; a max, a product, a softmax or a logsumexp over
# the stacked vector is refused at that op, an index tensor at ``index``, and a selection whose
# position is a number read from the data (``s[int(y[0, 0])]`` in the captured loss, an
# unbacked symbol) is refused at the selection: it would make each example's term depend on
# another example's values. An input of the cat that still carries the batch is refused as a
# value that reaches the loss without a sum over the batch. A batch reduction reached along
# several paths (``s.sum() + s[0]``; a selection walks every input of the cat) is one term per
# path in the verdict, all with the same batch-dependent part, so the same factor: where each
# term is scaled on its own, its node is scaled once (``scaled_terms``, as loss_graph's dict of
# scaled copies does), and the paths' linear part above it adds the rest.
# (tests/loss/test_loss_check.py::test_stacked_batch_sums_match_reference,
# tests/loss/test_loss_check.py::test_stacks_that_mix_examples_are_refused)
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
        if t in _IN_PLACE_PRODUCTS:
            # ``loss *= k`` (HF Trainer scales its loss so): the product of its operand, sound
            # only while nothing else aliases the operand (a view taken before would see the
            # scaled value in the backward but the unscaled one here)
            if len(node.args[0].users) != 1:
                refuse(node, "scales in place a value that another op also reads; write the "
                             "product out of place (`loss = loss * k`)")
            t = _IN_PLACE_PRODUCTS[t]
        if an.is_batched(node):
            refuse(node, "reaches the loss without a sum or mean over the batch")
        if t in _SUMS or t in _MEANS:
            src = node.args[0]
            if t in _MEANS:
                scale = scale * product(an.shape(node.meta["val"])) / \
                    product(an.shape(src.meta["val"]))
            if an.is_batched(src):
                terms.append((scale, norms, node))
                return
            return walk(src, scale, norms)
        if t in _PASS_THROUGH:
            if any(_is_size(a) and not free_symbols(a.meta["val"]) <= {batch}
                   for a in pytree.tree_leaves(node.args[1:])):
                # Note [A stack of batch sums]: which entries a selection keeps is public
                refuse(node, "selects entries by a number read from the data (example i's "
                             "term would depend on another example's values)")
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
            if not divide and _is_size(a):
                a, b = b, a
            if _is_size(b):
                # a size of the batch's tensors (``reduced / input.size(0)`` inside torch's
                # kl_div "batchmean"): a power of the batch size, removed like a mean's
                size = sympy.sympify(sym_expr(b.meta["val"]))
                if not size.free_symbols <= {batch}:
                    refuse(node, f"scales the loss by {size}, which depends on the data")
                return walk(a, scale / size if divide else scale * size, norms)
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
                    if any(an.is_batched(x) for x in ancestors(b)):
                        refuse(node, "weights the batch's sum with values computed over the "
                                     "whole batch")
                    return walk(a, scale, norms)        # a constant weight tensor
                return walk(a, scale, norms + ((b, -1 if divide else 1),))
            return walk(a, scale, norms)                # a tensor constant: a weight
        if t is aten.cat.default:
            # See Note [A stack of batch sums]
            for part in node.args[0]:
                walk(part, scale, norms)
            return
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
    for node in _rows_by_index(gm, an):
        if node not in exempt:
            refuse(node, _BY_INDEX)
    if structure is not None:
        raise structure
    scalars = {ph for ph, p in zip(phs, placeholders) if p.is_scalar}
    return _verdict(gm, terms, batch, scalars, outputs, record_of)


def analyze_rows(gm: fx.GraphModule, placeholders: list[Placeholder], record_of: dict,
                 factors: list) -> None:
    """A model input computed from the batch's tensors (Note [The batch's own tensors are
    followed too] in loss/track.py) must keep examples apart: no op mixes them, and the result
    carries the batch in dim 0, example i's row computed from example i's rows only."""
    phs = list(gm.graph.find_nodes(op="placeholder"))
    batched = {ph for ph, k in zip(phs, factors) if k is not None}
    if not batched:
        return
    symbols = {next(iter(batched)).meta["val"].shape[0].node.expr}
    an = BatchAnalysis(gm.graph, symbols, {ph.name: BatchDim(0, inner=sympy.Integer(k))
                                           for ph, k in zip(phs, factors) if k is not None})
    for node, reason in mixing_ops(gm, an, skip=set()):
        raise LossRefused(record_of.get(node), _op_name(node), reason)
    for node in _rows_by_index(gm, an):
        raise LossRefused(record_of.get(node), _op_name(node), _BY_INDEX)
    result = gm.graph.find_nodes(op="output")[0].args[0]
    lay = an.layout(result) if isinstance(result, fx.Node) else None
    if not (isinstance(lay, BatchDim) and lay.dim == 0 and lay.is_plain):
        raise LossRefused(None, "input", "does not carry the batch's examples in dim 0, one row "
                                         "each")


_BY_INDEX = "picks rows along the batch dim by index (example i would use another example's row)"


def _rows_by_index(gm: fx.GraphModule, an: BatchAnalysis) -> list[fx.Node]:
    """Indexing ops whose index names the batch dim of a tensor with a proven layout, by
    anything but each row's own number (an arange over the rows: ``logp[arange(B), y]``, whose
    other indices the forward rule of passes/indexing.py, run by ``mixing_ops``, checks)."""
    found = []
    for node in gm.graph.nodes:
        if node.target in _INDEXING:
            src = an.layout(node.args[0]) if isinstance(node.args[0], fx.Node) else None
            idx = node.args[1]
            if isinstance(src, BatchDim) and src.dim < len(idx) and idx[src.dim] is not None:
                own = an.layout(idx[src.dim]) if isinstance(idx[src.dim], fx.Node) else None
                if not (isinstance(own, BatchDim) and own.index_of is not None):
                    found.append(node)
    return found


def _verdict(gm, terms, batch, scalars: set, outputs: set, record_of: dict) -> Verdict:
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
    # a normalizer may read an output's size (a class-weight mean's expand to (B, K)), never
    # its values: the outputs are handed in as expanded stand-ins of their shape
    phs = list(gm.graph.find_nodes(op="placeholder"))
    sized = {}
    if norm_nodes:
        needed = set().union(*(ancestors(n) for n in norm_nodes))
        sized = {i: tuple(ph.meta["val"].shape[1:]) for i, ph in enumerate(phs)
                 if ph in needed and ph in outputs}
    return Verdict(out_terms, evaluate, declared.pop() if len(declared) == 1 else "mixed",
                   frozenset(i for i, n in enumerate(norm_nodes) if n in scalars), sized=sized,
                   replayed=gm, term_nodes=[node.name for _, _, node in terms],
                   normalizer_calls=tuple(record_of.get(n) for n in norm_nodes),
                   term_calls=tuple(record_of.get(node) for _, _, node in terms))


def _extract(gm: fx.GraphModule, nodes: list[fx.Node]) -> Callable:
    """A graph computing the normalizers from the real inputs (they never read the outputs)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    needed = set().union(*(ancestors(n) | {n} for n in nodes))
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node in needed:
            env[node] = graph.node_copy(node, lambda a: env[a])
    # a normalizer's own last cast (an int count to float) is left out: eval_scale reads each
    # value as a Python float anyway, and every op here is paid on every step
    outs = [env[n] for n in nodes]
    outs = [o.args[0] if o.target in (prims.convert_element_type.default,
                                      aten._to_copy.default) and len(o.users) == 0 else o
            for o in outs]
    graph.output(tuple(outs))
    graph.eliminate_dead_code()
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


def _is_size(node) -> bool:
    """A node whose value is a Python number computed from sizes (a SymInt of the batch)."""
    return isinstance(node, fx.Node) and isinstance(
        node.meta.get("val"), (torch.SymInt, torch.SymFloat, int, float))


def _descendants(graph: fx.Graph, roots: set) -> set:
    """Nodes computed from ``roots``' values; a size (``sym_size`` of an output, and numbers
    computed from sizes) carries no value of theirs, so it does not pass the relation on."""
    found = set(roots)
    for node in graph.nodes:
        if any(a in found for a in node.all_input_nodes) and not _is_size(node):
            found.add(node)
    return found




def ancestors(node: fx.Node) -> set:
    """Every node ``node`` reads, directly or through others."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _depends_on_inputs(node: fx.Node) -> bool:
    return any(a.op == "placeholder" for a in ancestors(node) | {node})


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
