"""Lift rules: re-emit a batch-free op on per-sample tensors, with a leading example dim.

Between a frontier (where the batch was reduced away) and the gradient output sit a few ops that
never saw the batch: ``permute`` (``mm`` gives W^T's gradient), ``view`` (a bias' ``[1, 1, d] -> [d]``),
``add`` (the two uses of a tied weight), ``mul`` by a constant. Given per-sample inputs of shape
``(B, *s)`` each rule emits the same op on ``(B, *s)``, the way a vmap batching rule does::

    permute(x, [1, 0])          ->  permute(x_ps, [0, 2, 1])
    view(x, [16])               ->  view(x_ps, [B, 16])
    add(x, y)                   ->  add(x_ps, y_ps)      (both per-sample)
    mul(x, c)                   ->  mul(x_ps, c)         (c data-independent)

Ops that are not linear in the per-example terms (``mul`` of two data-dependent tensors, ``add`` of a
data-dependent and a data-independent tensor) have no per-sample meaning and are refused.
"""
from __future__ import annotations

import torch

from . import LiftRule, register_lift

aten = torch.ops.aten
prims = torch.ops.prims


class LiftRefused(Exception):
    pass


def _rank(node) -> int:
    return node.meta["val"].dim()


def _expand_to(ps, orig_rank: int, rank: int, ctx):
    """(B, *s) of rank orig_rank+1 -> (B, 1, ..., 1, *s) of rank rank+1 for right-aligned broadcast."""
    for _ in range(rank - orig_rank):
        ps = ctx.emit(aten.unsqueeze.default, ps, 1)
    return ps


def _single(node, ps_args):
    if len(ps_args) != 1:
        raise LiftRefused("more than one data-dependent input")
    (src, ps), = ps_args.items()
    if node.args[0] is not src:
        raise LiftRefused("the data-dependent input is not the first argument")
    return src, ps


def lift_view(node, ps_args, ctx):
    _, ps = _single(node, ps_args)
    return ctx.emit(aten.reshape.default, ps, [ctx.emit.batch_size(), *node.args[1]])


def lift_permute(node, ps_args, ctx):
    src, ps = _single(node, ps_args)
    rank = _rank(src)
    if node.target is aten.t.default:
        perm = [1, 0] if rank == 2 else list(range(rank))
    elif node.target is aten.transpose.int:
        perm = list(range(rank))
        d0, d1 = (d % rank for d in node.args[1:3])
        perm[d0], perm[d1] = perm[d1], perm[d0]
    else:
        perm = [d % rank for d in node.args[1]]
    return ctx.emit(aten.permute.default, ps, [0] + [d + 1 for d in perm])


def lift_unsqueeze(node, ps_args, ctx):
    src, ps = _single(node, ps_args)
    return ctx.emit(aten.unsqueeze.default, ps, node.args[1] % (_rank(src) + 1) + 1)


def lift_squeeze(node, ps_args, ctx):
    src, ps = _single(node, ps_args)
    rank = _rank(src)
    if node.target is aten.squeeze.default:
        dims = [d for d, s in enumerate(src.meta["val"].shape) if s == 1]
    else:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    return ctx.emit(aten.squeeze.dims, ps, [d % max(rank, 1) + 1 for d in dims])


def lift_sum(node, ps_args, ctx):
    src, ps = _single(node, ps_args)
    rank = _rank(src)
    if node.target is aten.sum.default or not node.args[1]:
        dims, keepdim = list(range(rank)), False
    else:
        dims = [d % rank for d in node.args[1]]
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    kwargs = {"dtype": node.kwargs["dtype"]} if node.kwargs.get("dtype") is not None else {}
    return ctx.emit(aten.sum.dim_IntList, ps, [d + 1 for d in dims], keepdim, **kwargs)


def lift_add(node, ps_args, ctx):
    tensors = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
    if len(ps_args) != 2 or len(tensors) != 2:
        raise LiftRefused(
            "adding a data-independent tensor to a per-example gradient has no per-sample meaning")
    rank = _rank(node)
    a, b = (_expand_to(ps_args[t], _rank(t), rank, ctx) for t in node.args[:2])
    return ctx.emit(node.target, a, b, *node.args[2:], **node.kwargs)


def lift_scale(node, ps_args, ctx):
    """mul/div by a data-independent tensor or scalar."""
    if len(ps_args) != 1:
        raise LiftRefused("a product of two data-dependent tensors is not linear in the examples")
    (src, ps), = ps_args.items()
    if node.target is aten.div.Tensor and node.args[0] is not src:
        raise LiftRefused("dividing by a data-dependent tensor is not linear in the examples")
    ps = _expand_to(ps, _rank(src), _rank(node), ctx)
    args = [ps if a is src else a for a in node.args]
    return ctx.emit(node.target, *args, **node.kwargs)


def lift_unary(node, ps_args, ctx):
    """Ops applied elementwise with no other data input: casts, copies, negation."""
    _, ps = _single(node, ps_args)
    return ctx.emit(node.target, ps, *node.args[1:], **node.kwargs)


def lift_cat(node, ps_args, ctx):
    parts = node.args[0]
    if any(p not in ps_args for p in parts):
        raise LiftRefused("concatenating per-example and data-independent gradients")
    dim = node.args[1] if len(node.args) > 1 else 0
    return ctx.emit(aten.cat.default, [ps_args[p] for p in parts], dim % _rank(node) + 1)


register_lift(LiftRule("view", (aten.view.default, aten._unsafe_view.default, aten.reshape.default),
                       lift_view))
register_lift(LiftRule("permute", (aten.permute.default, aten.t.default, aten.transpose.int),
                       lift_permute))
register_lift(LiftRule("unsqueeze", (aten.unsqueeze.default,), lift_unsqueeze))
register_lift(LiftRule("squeeze", (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default),
                       lift_squeeze))
register_lift(LiftRule("sum", (aten.sum.dim_IntList, aten.sum.default), lift_sum))
register_lift(LiftRule("add", (aten.add.Tensor, aten.sub.Tensor), lift_add))
register_lift(LiftRule("scale", (aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar,
                                 aten.div.Scalar), lift_scale))
register_lift(LiftRule("unary", (aten.neg.default, aten.clone.default, aten.alias.default,
                                 prims.convert_element_type.default, aten._to_copy.default),
                       lift_unary))
register_lift(LiftRule("cat", (aten.cat.default,), lift_cat))
