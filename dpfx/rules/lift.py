"""Lift rules: re-emit a batch-free op on per-sample tensors, with a leading example dim.

Between a frontier (where the batch was reduced away) and the gradient output sit a few ops that
never saw the batch: ``permute`` (``mm`` gives W^T's gradient), ``view`` (a bias' ``[1, 1, d] -> [d]``),
``add`` (the two uses of a tied weight), ``mul`` by a constant. Given per-sample inputs of shape
``(B, *s)`` each rule emits the same op on ``(B, *s)``, the way a vmap batching rule does::

    permute(x, [1, 0])          ->  permute(x_ps, [0, 2, 1])
    view(x, [16])               ->  view(x_ps, [B, 16])
    add(x, y)                   ->  add(x_ps, y_ps)      (both per-sample)
    mul(x, c)                   ->  mul(x_ps, c)         (c data-independent)
    index_put(zeros, [i], v, accumulate=True)
                                ->  index_put(zeros[B, ...], [arange(B)[:, None], i], v_ps, True)
    slice_scatter(zeros, x, d, ...)  ->  slice_scatter(zeros[B, ...], x_ps, d + 1, ...)
    where(mask, x, 0)           ->  where(mask, x_ps, 0)      (triu/tril/masked weights)
    constant_pad_nd(x, pad, 0)  ->  constant_pad_nd(x_ps, pad, 0)   (F.pad of a weight)
    rev(x, dims) / index(x, [None, i])  ->  the same one dim further right   (flip, roll)

Ops that are not linear in the per-example terms (``mul`` of two data-dependent tensors, ``add`` of a
data-dependent and a data-independent tensor) have no per-sample meaning and are refused.
"""
from __future__ import annotations

import operator

import torch

import torch.fx as fx

from dpfx.rules.registry import LiftRule, register_lift

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
    # One node may be both operands (a bias used twice, after CSE: add(v, v)).
    tensors = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
    if len(tensors) != 2 or not set(tensors) <= ps_args.keys():
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
    if sum(a is src for a in node.args) != 1:
        raise LiftRefused("a product of two data-dependent tensors is not linear in the examples")
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


# -- index_put-accumulate into zeros: linear in its values -----------------------------------------
def _is_zero_table(node, ctx) -> bool:
    if not isinstance(node, fx.Node) or node in ctx.analysis.data_dependent:
        return False
    return node.target is aten.zeros.default or (
        node.target is aten.full.default and node.args[1] == 0)


def _scatter_args(node):
    """(base, mask or None, indices, values, accumulate) of the three index_put forms."""
    if node.target is aten._unsafe_masked_index_put_accumulate.default:
        base, mask, indices, values = node.args[:4]
        return base, mask, indices, values, True
    base, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    return base, None, indices, values, accumulate


def _clamp_index(index, size, ctx):
    """clamp(index, -size, size - 1), as the masked op clamps before scattering."""
    if isinstance(size, int):
        low, high = -size, size - 1
    else:
        low, high = ctx.emit(operator.neg, size), ctx.emit(operator.sub, size, 1)
    return ctx.emit(aten.clamp_max.default, ctx.emit(aten.clamp_min.default, index, low), high)


def lift_index_put(node, ps_args, ctx):
    """A scatter-add of batch-free values (the gradient of a table looked up with indices that do
    not depend on the data: ``nn.Embedding(T, d)(arange(T))`` as a positional embedding). It is
    linear in the values, so example i's gradient scatters example i's values with the same
    indices into its own zero table: the indices get a leading ``arange(B)`` index, broadcast
    against them, and the values a leading example dim. Indices, mask and table must be
    data-independent (else one example's gradient would depend on the others' data)."""
    base, mask, indices, values, accumulate = _scatter_args(node)
    if not accumulate:
        raise LiftRefused("index_put without accumulate=True overwrites, it is not linear")
    if set(ps_args) != {values}:
        raise LiftRefused("only the scattered values may depend on the data, not the table, "
                          "indices or mask")
    if not _is_zero_table(base, ctx):
        raise LiftRefused(f"the table {getattr(base, 'name', base)} is not a data-independent "
                          f"zero tensor, so the scatter is not linear in the values")
    if any(i is None or i.meta["val"].dtype not in (torch.int64, torch.int32) for i in indices):
        raise LiftRefused("the rule needs integer index tensors on the leading dims (no None, "
                          "no boolean masks)")
    base_val = base.meta["val"]
    sizes = [ctx.emit.size(s) for s in ctx.analysis.shape(base_val)]
    index_rank = max(i.meta["val"].dim() for i in indices)
    batch = ctx.emit.batch_size()
    rows = ctx.emit(prims.iota.default, batch, start=0, step=1, dtype=torch.int64,
                    device=base_val.device, requires_grad=False)
    rows = ctx.emit(aten.view.default, rows, [batch] + [1] * index_rank)
    ps = _expand_to(ps_args[values], _rank(values),
                    index_rank + base_val.dim() - len(indices), ctx)
    if mask is not None:
        zero = ctx.emit(aten.scalar_tensor.default, 0, dtype=ps.meta["val"].dtype,
                        device=base_val.device)
        ps = ctx.emit(aten.where.self, mask, ps, zero)
        indices = [_clamp_index(i, size, ctx) for i, size in zip(indices, sizes)]
    tables = ctx.emit(aten.full.default, [batch, *sizes], 0, dtype=base_val.dtype,
                      layout=torch.strided, device=base_val.device, pin_memory=False)
    return ctx.emit(aten.index_put.default, tables, [rows, *indices], ps, True)


def lift_scatter_into_zeros(node, ps_args, ctx):
    """``slice_scatter``/``select_scatter`` of a per-sample gradient into a zero tensor (the
    gradient of ``pos[:, :T]`` or ``pos[0]``): linear in the source, so each example's source goes
    into its own zero tensor, one dim further right."""
    base, src, dim = node.args[:3]
    if set(ps_args) != {src}:
        raise LiftRefused("only the scattered source may depend on the data")
    if not _is_zero_table(base, ctx):
        raise LiftRefused(f"the tensor scattered into, {getattr(base, 'name', base)}, is not a "
                          f"data-independent zero tensor")
    val = base.meta["val"]
    sizes = [ctx.emit.size(s) for s in ctx.analysis.shape(val)]
    zeros = ctx.emit(aten.full.default, [ctx.emit.batch_size(), *sizes], 0, dtype=val.dtype,
                     layout=torch.strided, device=val.device, pin_memory=False)
    return ctx.emit(node.target, zeros, ps_args[src], dim % val.dim() + 1, *node.args[3:],
                    **node.kwargs)


# -- data movement and masking of a weight before its use: triu/tril, F.pad, flip, roll ---------
def _is_zero_constant(node) -> bool:
    """A data-independent scalar zero: ``full([], 0)``, ``scalar_tensor(0)`` or a Python 0."""
    if not isinstance(node, fx.Node):
        return node == 0
    return node.target in (aten.full.default, aten.scalar_tensor.default) and \
        node.meta["val"].dim() == 0 and node.args[-1] == 0


def lift_where(node, ps_args, ctx):
    """``where(mask, g, 0)``: the gradient of ``triu(w)``, ``tril(w)`` or any fixed mask. Linear in
    g when the mask is data-independent and the other branch is zero."""
    cond, a, b = node.args[:3]
    if cond in ps_args or len(ps_args) != 1:
        raise LiftRefused("the mask depends on the data, or both branches do")
    (src, ps), = ps_args.items()
    if not _is_zero_constant(b if src is a else a):
        raise LiftRefused("the other branch is not zero: an affine, not linear, map of the "
                          "per-example gradient")
    ps = _expand_to(ps, _rank(src), _rank(node), ctx)
    return ctx.emit(aten.where.self, cond, ps if src is a else a, ps if src is b else b)


def lift_constant_pad(node, ps_args, ctx):
    """``constant_pad_nd(g, pad, 0)``: the gradient of ``F.pad(w, ...)`` (negative pads, a slice).
    Pads count from the last dim, so a leading example dim leaves them in place."""
    _, ps = _single(node, ps_args)
    pad = node.args[1]
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    if any(p > 0 for p in pad) and value != 0:
        raise LiftRefused(f"padding with {value} adds a data-independent constant")
    return ctx.emit(aten.constant_pad_nd.default, ps, pad, value)


def lift_rev(node, ps_args, ctx):
    """``rev(g, dims)``: the gradient of ``flip(w, dims)``."""
    _, ps = _single(node, ps_args)
    return ctx.emit(node.target, ps, [d % _rank(node) + 1 for d in node.args[1]])


def lift_index(node, ps_args, ctx):
    """``index(g, [None, idx])``: the gradient of ``roll(w, ...)`` and other fixed gathers.
    The indices must not depend on the data; the example dim is kept with a leading None."""
    _, ps = _single(node, ps_args)
    return ctx.emit(aten.index.Tensor, ps, [None, *node.args[1]])


register_lift(LiftRule("where", (aten.where.self,), lift_where))
register_lift(LiftRule("constant_pad", (aten.constant_pad_nd.default,), lift_constant_pad))
register_lift(LiftRule("rev", (prims.rev.default,), lift_rev))
register_lift(LiftRule("index", (aten.index.Tensor,), lift_index))
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
register_lift(LiftRule("index_put", (aten._unsafe_masked_index_put_accumulate.default,
                                     aten.index_put.default, aten._unsafe_index_put.default),
                       lift_index_put))
register_lift(LiftRule("scatter_into_zeros", (aten.slice_scatter.default,
                                              aten.select_scatter.default),
                       lift_scatter_into_zeros))
