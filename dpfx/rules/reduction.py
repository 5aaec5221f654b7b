"""Per-sample gradients that are sums over the batch dim.

Biases, normalization affine parameters, learned elementwise scales and parameters broadcast over
the batch (a positional embedding ``nn.Parameter(torch.zeros(1, T, d))``) all get their gradient as
``sum(x, dims)`` where ``dims`` contains the batch dim: the parameter was broadcast over examples in
the forward, so autograd sums over them in the backward. Dropping the batch dim from ``dims`` (after
moving it to the front) keeps one gradient per example; this one rule therefore covers every
parameter that is used without a batch dim, with no per-layer special case.
"""
from __future__ import annotations

import torch

from dpfx.rules.registry import Rule, register
from dpfx.graph.batch import BatchDim

aten = torch.ops.aten


def _reduced_dims(node) -> list[int]:
    rank = node.args[0].meta["val"].dim()
    if node.target is aten.sum.default or not node.args[1]:
        return list(range(rank))
    return sorted({d % rank for d in node.args[1]})


def check_sum(node, ctx) -> str | None:
    lay = ctx.layout(node.args[0])
    if not isinstance(lay, BatchDim):
        return f"the input's batch layout is {lay}"
    if lay.dim not in _reduced_dims(node):
        return f"the sum over dims {_reduced_dims(node)} keeps the batch dim {lay.dim}"
    return None


def rewrite_sum(node, ctx):
    x = node.args[0]
    front = ctx.emit.batch_to_front(x, ctx.layout(x))
    dims = [d + 1 for d in _reduced_dims(node)]
    keepdim = node.target is aten.sum.dim_IntList and (
        node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    kwargs = {"dtype": node.kwargs["dtype"]} if node.kwargs.get("dtype") is not None else {}
    shape = ctx.analysis.shape(front.meta["val"])
    if not kwargs and all(shape[d] == 1 for d in dims):
        # A bias on (B, d) features: each example's gradient is its own row, a reshape (so that
        # its norm is the one the weight's ghost norm takes of the same rows: Note [One squared
        # norm per tensor] in graph/emit.py).
        out = [ctx.analysis.batch, *ctx.analysis.shape(node.meta["val"])]
        if out == shape:
            return front
        return ctx.emit(aten.reshape.default, front, [ctx.emit.size(s) for s in out])
    return ctx.emit(aten.sum.dim_IntList, front, dims, keepdim, **kwargs)


def cost_sum(node, ctx) -> dict:
    shape = ctx.analysis.shape(node.args[0].meta["val"])
    numel = 1
    for s in shape:
        numel = numel * s
    out = node.meta["val"].numel()
    return {"form": f"sum over non-batch dims of {ctx.analysis.pretty(shape)}", "flops": numel,
            "memory": ctx.analysis.batch * out}


SUM = register(Rule("sum", (aten.sum.dim_IntList, aten.sum.default), check_sum, rewrite_sum, cost_sum))
