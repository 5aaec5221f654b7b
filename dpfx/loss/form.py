"""The captured loss's gradient program in the form Inductor's CPU kernels stream best: exact
rewrites of the softmax cross-entropy pattern, so that no vocabulary-wide tensor but the
gradient itself is written.

# Note [The cross-entropy form]
``_Program.gradient`` (loss/captured.py) traces the loss and its gradient with autograd's own
formulas. For ``F.cross_entropy`` on logits ``x`` (rows of V classes) that is

    out = _log_softmax(x, 1)                  # x - amax - log(sum(exp(x - amax)))
    value = nll_loss_forward(out, t)          # gathers one entry per row
    g = nll_loss_backward(w, out, t)          # -w at (i, t_i), else 0
    G = _log_softmax_backward_data(g, out)    # g - exp(out) * sum(g, 1)

Inductor stores ``out`` as a V-wide buffer (on CPU a pointwise value with a ``log`` inside and
two users is realized), reads it back for the gradient, and reduces ``g`` over V for the row
sums: with V = 8192, three passes over a tensor of 2048 x 8192 floats beyond the two a row
statistic needs. The rewrite (each step exact in real arithmetic, each value rounded at most as
Inductor's own decomposition rounds it):

1. ``out = _log_softmax(x, d)`` becomes ``lse = logsumexp(x, d, keepdim)``, ``out = -(lse - x)``;
   the backward's ``exp(out)`` becomes ``exp(x - lse)``. ``lse`` is one number a row with two
   users, so Inductor stores it; ``out`` is then cheap, computed where the gather reads it, and
   ``exp(x - lse)`` inside the pass that writes G. (``-(lse - x)`` is ``x - lse`` to the bit; it
   is spelled apart so that aot_autograd's common-subexpression pass keeps the two uses apart.)
2. ``sum(nll_loss_backward(...), d)`` becomes the entry at the target, gathered (0 where the
   target is ``ignore_index``): the row has no other nonzero, so the sum is that entry exactly.

A program without the pattern is left as it is (the gradient is the same either way; only the
kernels differ). Tested against the untouched program in tests/loss/test_loss_form.py.
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def _through_detach(node):
    while isinstance(node, fx.Node) and node.op == "call_function" and \
            node.target == aten.detach.default:
        node = node.args[0]
    return node


def cross_entropy_form(gm: fx.GraphModule) -> bool:
    """Note [The cross-entropy form], on ``gm`` in place; whether anything changed."""
    graph = gm.graph
    changed = False
    lse_of: dict[fx.Node, tuple] = {}    # the rewritten log-probabilities -> (x, lse)
    for node in list(graph.find_nodes(op="call_function",
                                      target=aten._log_softmax_backward_data.default)):
        g, out, dim, _dtype = node.args
        source = _through_detach(out)
        if source in lse_of:            # a log_softmax already rewritten, read by a second one
            x, lse = lse_of[source]
        elif (isinstance(source, fx.Node) and source.op == "call_function" and
              source.target == aten._log_softmax.default and source.args[2] is False and
              source.args[1] == dim):
            x = source.args[0]
            with graph.inserting_after(source):
                lse = graph.call_function(aten.logsumexp.default, (x, [dim], True))
            with graph.inserting_after(lse):
                diff = graph.call_function(aten.sub.Tensor, (lse, x))
            with graph.inserting_after(diff):
                neg = graph.call_function(aten.neg.default, (diff,))
            source.replace_all_uses_with(neg)
            graph.erase_node(source)
            lse_of[neg] = (x, lse)
        else:
            continue
        with graph.inserting_before(node):
            p = graph.call_function(aten.exp.default, (graph.call_function(
                aten.sub.Tensor, (x, lse)),))
            rows = _row_sum(graph, g, dim)
            grad = graph.call_function(aten.sub.Tensor, (g, graph.call_function(
                aten.mul.Tensor, (p, rows))))
        node.replace_all_uses_with(grad)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    return changed


def _row_sum(graph: fx.Graph, g: fx.Node, dim) -> fx.Node:
    """``sum(g, dim, keepdim=True)``; for nll_loss's gradient over 2-d input and class dim 1,
    its entry at the target (Note [The cross-entropy form], step 2)."""
    if isinstance(g, fx.Node) and g.op == "call_function" and \
            g.target == aten.nll_loss_backward.default and dim in (1, -1):
        target, ignore_index = g.args[2], g.args[5]
        val = g.meta.get("val")
        tval = target.meta.get("val") if isinstance(target, fx.Node) else None
        if val is not None and val.dim() == 2 and tval is not None and tval.dim() == 1:
            keep = graph.call_function(aten.ne.Scalar, (target, ignore_index))
            safe = graph.call_function(aten.where.ScalarOther, (keep, target, 0))
            at = graph.call_function(aten.gather.default, (g, 1, graph.call_function(
                aten.unsqueeze.default, (safe, 1))))
            return graph.call_function(aten.where.ScalarOther, (graph.call_function(
                aten.unsqueeze.default, (keep, 1)), at, 0.0))
    return graph.call_function(aten.sum.dim_IntList, (g, [dim], True))
