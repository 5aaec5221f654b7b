"""Per-sample gradients of matrix products: ``nn.Linear`` weights through ``mm``.

In the backward graph a Linear weight gradient on a (B, T, d) input reads
``mm(permute(view(g, [T*B, out])), view(a, [T*B, in]))``: the contraction runs over B*T. Keeping the
example dim means splitting that contraction into (B, T) and contracting only T::

    g_i^T a_i  for every i  ==  bmm(g.view(B, T, out).transpose(1, 2), a.view(B, T, in))

which is the per-sample gradient of Goodfellow (2015) / Opacus' linear rule, but derived from the
graph: the same rule serves any rank of input and any flattening order, since the batch layout of
both operands comes from `passes.batch`.

The rule also has a ghost form (``ghost_mm``): per-sample norms from the operands alone and the
clipped sum as one mm with clip-scaled rows, so the (B, out, in) tensor is never built. The
compiler picks it per parameter when its memory is smaller (``strategy="auto"``).
"""
from __future__ import annotations

import torch

from dpfx.rules.registry import Ghost, Rows, Rule, at_least_float32, register
from dpfx.graph.batch import BatchDim

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
    r = k / batch
    # Besides the two Grams, the ghost form is charged R*N for the second operand in (B, R, N),
    # and, when the flattening is time-major (T*B), R*M for the copy of the first in (B, M, R).
    held = r * n if ctx.layout(b).outer == 1 else r * (m + n)
    return {
        "form": f"bmm([B, {m}, {r}], [B, {r}, {n}])",
        "flops": 2 * m * k * n,
        "memory": batch * m * n,
        "ghost_form": "|a|^2 |g|^2" if r == 1 else f"<Gram [B, {r}, {r}], Gram [B, {r}, {r}]>",
        "ghost_flops": 2 * k * r * (m + n) + 2 * m * k * n,
        "ghost_memory": batch * (2 * r * r + held) if r != 1 else batch * (n + 2),
    }


def ghost_mm(node, ctx) -> Ghost:
    """||A_i^T G_i||_F^2 without the (B, M, N) per-sample gradients. With one row per example
    (R = 1) it factorizes as ||a_i||^2 ||g_i||^2; with R rows (a sequence) it is
    <A_i A_i^T, G_i G_i^T>, two (B, R, R) Gram matrices (Li et al. 2022). The clipped sum is the
    same mm as the original weight gradient with the second operand's rows scaled by c_i."""
    emit = ctx.emit
    a, b = node.args[:2]
    # Both Gram operands read b3 (and a3) twice, as itself and transposed: one copy each
    # (Note [One batch-major copy per operand], emit.py).
    b3 = emit.batch_to_front(b, ctx.layout(b), copy=True)  # (B, R, N)
    r = ctx.analysis.shape(b3.meta["val"])[1]
    if r == 1:     # shared with the bias's norm: Note [One squared norm per tensor] (emit.py)
        norm_sq = emit(aten.mul.Tensor, emit.squared_norm(a, ctx.layout(a), widen=False),
                       emit.squared_norm(b, ctx.layout(b), widen=False))
    else:
        a3 = emit.batch_to_front(a, ctx.layout(a), copy=True)  # (B, M, R)
        gram_a = emit(aten.bmm.default, emit(aten.permute.default, a3, [0, 2, 1]), a3)
        gram_b = emit(aten.bmm.default, b3, emit(aten.permute.default, b3, [0, 2, 1]))
        norm_sq = emit(aten.sum.dim_IntList, emit(aten.mul.Tensor, gram_a, gram_b), [1, 2])

    def clipped_sum(clip):
        # The rows are scaled where they are: each example's rows, wherever the flattening puts
        # them (batch-major (B*T, N) or time-major (T*B, N), as a seq-first layer or the LSTM's
        # stacked input projection has), so the mm keeps the original contraction.
        rows = clip.scale(emit, b, ctx.layout(b))
        a_wide, rows = at_least_float32(emit, a, rows)
        return emit(aten.mm.default, clip.mask(emit, a_wide, ctx.layout(a)), rows,
                    tag="clipped_sum")

    def factors():     # G_i = A_i B_i = sum_r A_i[:, r] (x) B_i[r, :]
        a3 = emit.batch_to_front(a, ctx.layout(a), copy=True)
        return Rows(dense=emit(aten.permute.default, a3, [0, 2, 1])), Rows(dense=b3)

    return Ghost(norm_sq, clipped_sum, factors=factors)


MM = register(Rule("mm", (aten.mm.default,), check_mm, rewrite_mm, cost_mm,
                   ghost=ghost_mm, ghost_factors=True))
