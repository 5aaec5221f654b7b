"""Per-sample gradients of matrix products: ``nn.Linear`` weights through ``mm``.

In the backward graph a Linear weight gradient on a (B, T, d) input reads
``mm(permute(view(g, [T*B, out])), view(a, [T*B, in]))``: the contraction runs over B*T. Keeping the
example dim means splitting that contraction into (B, T) and contracting only T::

    g_i^T a_i  for every i  ==  bmm(g.view(B, T, out).transpose(1, 2), a.view(B, T, in))

which is the per-sample gradient of Goodfellow (2015) / Opacus' linear rule, but derived from the
graph: the same rule serves any rank of input and any flattening order, since the batch layout of
both operands comes from `passes.batch`.
"""
from __future__ import annotations

import torch

from . import Rule, register
from ..passes.batch import BatchDim

aten = torch.ops.aten


def check_mm(node, ctx) -> str | None:
    a, b = node.args[:2]
    la, lb = ctx.layout(a), ctx.layout(b)
    if not (isinstance(la, BatchDim) and isinstance(lb, BatchDim)):
        return f"operands' batch layouts are {la} and {lb}; both must be known"
    if la.dim != 1 or lb.dim != 0:
        return f"the batch dim is not the contracted dim (layouts {la}, {lb})"
    if (la.outer, la.inner) != (lb.outer, lb.inner):
        return f"the operands flatten the batch differently ({la} vs {lb})"
    return None


def rewrite_mm(node, ctx):
    a, b = node.args[:2]
    a3 = ctx.emit.batch_to_front(a, ctx.layout(a))  # (B, M, R)
    b3 = ctx.emit.batch_to_front(b, ctx.layout(b))  # (B, R, N)
    return ctx.emit(aten.bmm.default, a3, b3)


def cost_mm(node, ctx) -> dict:
    a, b = node.args[:2]
    m, k = ctx.analysis.shape(a.meta["val"])
    n = ctx.analysis.shape(b.meta["val"])[1]
    batch = ctx.analysis.batch
    return {
        "form": f"bmm([B, {m}, {k / batch}], [B, {k / batch}, {n}])",
        "flops": 2 * m * k * n,
        "memory": batch * m * n,
    }


MM = register(Rule("mm", (aten.mm.default,), check_mm, rewrite_mm, cost_mm))
