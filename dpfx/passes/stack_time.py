"""A weight used once per time step: its per-step gradient products stacked into one product.

    lstm = nn.LSTM(64, 128, batch_first=True)    # under dpfx, the recurrence written out (capture/rnn.py)

    captured:  grad[w_hh] = add(add(mm(permute(g_1), h_1), mm(permute(g_2), h_2)), mm(permute(g_3), h_3))
    stacked:   grad[w_hh] = mm(permute(view(cat([g_1, g_2, g_3], 1), [B*3, 4H])),
                               view(cat([h_1, h_2, h_3], 1), [B*3, H]))
    likewise   grad[b_hh] = sum(g_1, [0]) + sum(g_2, [0]) + ...  ->  sum(view(cat(g_t, 1), [B*3, 4H]), [0])

with every g_t (B, 4H) and h_t (B, H) batched in dim 0. The two are equal: sum_t g_t^T h_t = G^T H
for G, H the per-step operands stacked along the contracted dim, in any order that pairs g_t
with h_t. Stacking them as (B, T) rows, the batch outer and time inner, gives the layout of a
Linear on a (B, T, d) sequence: one frontier, whose per-sample form is one ``bmm`` over time
instead of T outer products summed per example (for the bias, one reduction over time instead
of T per-example terms and T - 1 adds), and whose ghost form (two (B, T, T) Gram
matrices, book-keeping for the clipped sum) applies, so ``strategy="auto"`` can avoid the
(B, 4H, H) per-sample gradient altogether.

Note [Stacking changes what torch computed, not what dpfx proves]
The pass runs on the captured backward before the batch analysis is redone and the per-sample
rewrite starts, so every later pass and the verifier see the stacked product as the weight's
gradient (its nodes are marked as dpfx's). The equality above is what keeps the result exact;
the pairing of g_t with h_t (one list of leaves, read in one order) is what keeps each example's
rows its own. tests/capture/test_rnn.py checks the gradients against the batch-of-one reference with the
pass on, and that it fired.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpfx.graph.batch import BatchAnalysis, BatchDim
from dpfx.graph.emit import Emitter

aten = torch.ops.aten


def _add_leaves(node: fx.Node, root: fx.Node) -> list[fx.Node]:
    """The terms of a tree of ``add(x, y)`` nodes rooted at ``root`` (inner adds used once)."""
    if node.target is aten.add.Tensor and not node.kwargs and len(node.args) == 2 \
            and all(isinstance(a, fx.Node) for a in node.args) \
            and (node is root or len(node.users) == 1):
        return _add_leaves(node.args[0], root) + _add_leaves(node.args[1], root)
    return [node]


def _step_term(leaf: fx.Node, an: BatchAnalysis) -> tuple[tuple, list[fx.Node]] | None:
    """(form, operands) of one step's term, its operands batched in dim 0 alone (a reduction
    over the examples of one step), else None. Forms:

        ("mm",)                  mm(permute(g, [1, 0]) or t(g), h)      a weight
        ("sum", keepdim, shape)  view(sum(g, [0], keepdim), shape)      its bias (view optional)
    """
    plain = BatchDim(0)
    if leaf.target is aten.mm.default and len(leaf.users) == 1:
        a, h = leaf.args[:2]
        transposed = isinstance(a, fx.Node) and (
            a.target is aten.t.default
            or (a.target is aten.permute.default and list(a.args[1]) == [1, 0]))
        if transposed and an.layout(a.args[0]) == plain and an.layout(h) == plain:
            return ("mm",), [a.args[0], h]
        return None
    shape, node = None, leaf
    if leaf.target is aten.view.default and len(leaf.users) == 1:
        shape, node = tuple(leaf.args[1]), leaf.args[0]
    if node.target is aten.sum.dim_IntList and len(node.users) == 1 \
            and list(node.args[1]) == [0] and not node.kwargs.get("dtype") \
            and an.layout(node.args[0]) == plain:
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim"))
        return ("sum", keepdim, shape), [node.args[0]]
    return None


def _stackable(root: fx.Node, an: BatchAnalysis) -> tuple[tuple, list[list[fx.Node]]] | None:
    """The terms' common form and, per operand position, that operand of every step."""
    leaves = _add_leaves(root, root)
    if len(leaves) < 2:
        return None
    terms = [_step_term(leaf, an) for leaf in leaves]
    if any(t is None for t in terms) or len({form for form, _ in terms}) != 1:
        return None
    columns = [list(c) for c in zip(*(ops for _, ops in terms))]
    for column in columns:
        vals = [x.meta["val"] for x in column]
        if vals[0].dim() != 2 or any(v.shape != vals[0].shape or v.dtype != vals[0].dtype
                                     for v in vals):
            return None
    return terms[0][0], columns


def _stacked(form: tuple, columns: list[list[fx.Node]], emit: Emitter,
             an: BatchAnalysis, stacks: dict[tuple, fx.Node]) -> fx.Node:
    rows = emit.size(an.batch * len(columns[0]))

    def stack(parts):
        # A bias and its weight read the same per-step output gradients: one stacked copy
        # serves both (``stacks`` holds those emitted before an earlier gradient, so they
        # dominate this one).
        if tuple(parts) not in stacks:
            width = an.shape(parts[0].meta["val"])[1]
            stacks[tuple(parts)] = emit(aten.view.default, emit(aten.cat.default, parts, 1),
                                        [rows, emit.size(width)])   # row b*T + t is step t
        return stacks[tuple(parts)]

    stacked = [stack(column) for column in columns]
    if form[0] == "mm":
        return emit(aten.mm.default, emit(aten.permute.default, stacked[0], [1, 0]), stacked[1])
    _, keepdim, shape = form
    total = emit(aten.sum.dim_IntList, stacked[0], [0], keepdim)
    return total if shape is None else emit(aten.view.default, total, list(shape))


def stack_over_time(graph: fx.Graph, an: BatchAnalysis, fake_mode,
                    grads: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Replace every gradient in ``grads`` that is a sum of per-step products (see the module
    doc) by one stacked product. Returns {old gradient node: new one}; the caller re-runs the
    batch analysis when it is not empty."""
    replaced, stacks = {}, {}
    order = {node: i for i, node in enumerate(graph.nodes)}
    for root in sorted(dict.fromkeys(grads), key=order.__getitem__):
        found = _stackable(root, an)
        if found is None:
            continue
        new = _stacked(*found, Emitter(graph, fake_mode, an, before=root), an, stacks)
        root.replace_all_uses_with(new)
        replaced[root] = new
    if replaced:
        graph.eliminate_dead_code()
    return replaced
