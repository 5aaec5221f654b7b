"""A weight used once per time step: its per-step gradient products stacked into one product.

    lstm = nn.LSTM(64, 128, batch_first=True)    # under dpfx, the recurrence written out (rnn.py)

    captured:  grad[w_hh] = add(add(mm(permute(g_1), h_1), mm(permute(g_2), h_2)), mm(permute(g_3), h_3))
    stacked:   grad[w_hh] = mm(permute(view(cat([g_1, g_2, g_3], 1), [B*3, 4H])),
                               view(cat([h_1, h_2, h_3], 1), [B*3, H]))

with every g_t (B, 4H) and h_t (B, H) batched in dim 0. The two are equal: sum_t g_t^T h_t = G^T H
for G, H the per-step operands stacked along the contracted dim, in any order that pairs g_t
with h_t. Stacking them as (B, T) rows, the batch outer and time inner, gives the layout of a
Linear on a (B, T, d) sequence: one frontier, whose per-sample form is one ``bmm`` over time
instead of T outer products summed per example, and whose ghost form (two (B, T, T) Gram
matrices, book-keeping for the clipped sum) applies, so ``strategy="auto"`` can avoid the
(B, 4H, H) per-sample gradient altogether.

Note [Stacking changes what torch computed, not what dpfx proves]
The pass runs on the captured backward before the batch analysis is redone and the per-sample
rewrite starts, so every later pass and the verifier see the stacked product as the weight's
gradient (its nodes are marked as dpfx's). The equality above is what keeps the result exact;
the pairing of g_t with h_t (one list of leaves, read in one order) is what keeps each example's
rows its own. tests/test_rnn.py checks the gradients against the batch-of-one reference with the
pass on, and that it fired.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .batch import BatchAnalysis, BatchDim
from .emit import Emitter

aten = torch.ops.aten


def _add_leaves(node: fx.Node, root: fx.Node) -> list[fx.Node]:
    """The terms of a tree of ``add(x, y)`` nodes rooted at ``root`` (inner adds used once)."""
    if node.target is aten.add.Tensor and not node.kwargs and len(node.args) == 2 \
            and all(isinstance(a, fx.Node) for a in node.args) \
            and (node is root or len(node.users) == 1):
        return _add_leaves(node.args[0], root) + _add_leaves(node.args[1], root)
    return [node]


def _per_step_operands(mm: fx.Node, an: BatchAnalysis) -> tuple[fx.Node, fx.Node] | None:
    """(g, h) for ``mm(permute(g, [1, 0]) or t(g), h)`` with g, h batched in dim 0 alone (a
    contraction over the examples of one step), else None."""
    if mm.target is not aten.mm.default or len(mm.users) != 1:
        return None
    a, h = mm.args[:2]
    if not (isinstance(a, fx.Node) and isinstance(h, fx.Node)):
        return None
    if not (a.target is aten.t.default
            or (a.target is aten.permute.default and list(a.args[1]) == [1, 0])):
        return None
    g = a.args[0]
    plain = BatchDim(0)
    if an.layout(g) != plain or an.layout(h) != plain:
        return None
    return g, h


def _stackable(root: fx.Node, an: BatchAnalysis) -> list[tuple[fx.Node, fx.Node]] | None:
    leaves = _add_leaves(root, root)
    if len(leaves) < 2:
        return None
    pairs = [_per_step_operands(leaf, an) for leaf in leaves]
    if any(p is None for p in pairs):
        return None
    (g0, h0) = pairs[0]
    same = lambda x, y: x.meta["val"].shape == y.meta["val"].shape \
        and x.meta["val"].dtype == y.meta["val"].dtype
    if not all(same(g, g0) and same(h, h0) for g, h in pairs):
        return None
    return pairs


def _stacked(pairs, emit: Emitter, an: BatchAnalysis) -> fx.Node:
    steps = len(pairs)
    rows = emit.size(an.batch * steps)

    def stack(parts):
        width = an.shape(parts[0].meta["val"])[1]
        return emit(aten.view.default, emit(aten.cat.default, list(parts), 1),
                    [rows, emit.size(width)])   # (B, T*d) -> (B*T, d): row b*T + t is step t

    g = stack([g for g, _ in pairs])
    h = stack([h for _, h in pairs])
    return emit(aten.mm.default, emit(aten.permute.default, g, [1, 0]), h)


def stack_over_time(graph: fx.Graph, an: BatchAnalysis, fake_mode,
                    grads: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Replace every gradient in ``grads`` that is a sum of per-step products (see the module
    doc) by one stacked product. Returns {old gradient node: new one}; the caller re-runs the
    batch analysis when it is not empty."""
    replaced = {}
    for root in dict.fromkeys(grads):
        pairs = _stackable(root, an)
        if pairs is None:
            continue
        new = _stacked(pairs, Emitter(graph, fake_mode, an, before=root), an)
        root.replace_all_uses_with(new)
        replaced[root] = new
    if replaced:
        graph.eliminate_dead_code()
    return replaced
