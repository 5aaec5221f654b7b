"""Per-sample gradients of embedding tables: ``nn.Embedding`` and ``table[idx]``.

With Inductor's decompositions an ``Embedding(V, d)`` weight gradient on (B, T) indices reads::

    zeros = full([V, d], 0)
    grad  = _unsafe_masked_index_put_accumulate(zeros, mask, [idx], g)   # idx (B, T), g (B, T, d)

a scatter-add of every token's output gradient into its row of one shared table: the sum over
examples happens because all B*T tokens land in the same [V, d] table. Giving every example its own
table keeps them apart::

    rows = arange(B).view(B, 1).expand(B, T)
    ps   = index_put(full([B, V, d], 0), [rows, idx], where(mask, g, 0), accumulate=True)

The mask (``padding_idx`` and out-of-range indices) and accumulation (an index repeated within one
example adds up) are the op's own, so the per-sample form inherits them unchanged. The same rewrite
serves ``index_put(zeros, [idx], g, accumulate=True)`` (the backward of ``table[idx]``) and
``embedding_dense_backward`` (graphs captured without Inductor's decomposition of it).

``nn.EmbeddingBag`` on (B, L) ids (one bag per example) is captured through dpfx.capture.swaps's
written-out ``F.embedding_bag`` (a lookup, then the bag's sum/mean/max), so its table gradient
comes to this rule. The 1-D ids + offsets form keeps torch's kernel, whose ``offset2bag``
bookkeeping has no provable batch layout: the forward check refuses it with a PrivacyError
(tests/rules/test_rule_embedding.py).

Refused, with the reason in the UnsupportedOpError: ``scale_grad_by_freq=True`` (it divides by how
often an index occurs in the *whole batch*, so example i's gradient depends on the others' data;
any batch-reducing op upstream of the values is refused for that reason), ``sparse=True``, and an
index whose batch layout is not proven or differs from the values' (Note [The index's batch
layout]).

Strategies: "materialize" builds a dense (B, V, d) tensor, B*V*d memory. The ghost form of the
masked index_put and index_put rules (``_ghost_scatter``, chosen by "auto" when B*T*(T+d) < B*V*d)
never builds it: example i's squared norm is ``sum_{t, t'} [idx_t == idx_t'] <g_t, g_t'>``, a (T, T)
Gram matrix masked by index equality, and the clipped sum is one scatter-add of the clip-scaled
token gradients; the ids may hold the examples in any proven layout, (B, T), time-first (T, B) or
either flattened (``torch.index_select(table, 0, ids.reshape(-1))``): each example's tokens are read
in front (``_examples_first``). Both give their factors, so a table that is also an LM head is
clipped without per-sample tables either way its backward is written (torch 2.13's decomposition of
the embedding's backward is the masked op; earlier ones, and ``table[idx]``, give index_put).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpfx.rules.registry import Ghost, Rows, Rule, at_least_float32, register
from dpfx.graph.batch import BatchDim

aten = torch.ops.aten
prims = torch.ops.prims



# -- checks shared by every form -------------------------------------------------------------------
def _tokens(idx, ctx):
    """Index elements per example (sympy): the index's size over the batch size."""
    lay = ctx.layout(idx)
    shape = ctx.analysis.shape(idx.meta["val"])
    return lay.outer * lay.inner * _product(s for i, s in enumerate(shape) if i != lay.dim)


def _examples_first(node, lay: BatchDim, ctx) -> fx.Node:
    """``node`` (the index, or rows laid out like it in its leading dims) with its examples in
    front: dim ``lay.dim`` split into (outer, B, inner) and B moved to dim 0, so that a reshape
    to [B, -1] reads each example's elements in the index's order."""
    if lay.dim == 0 and lay.outer == 1:
        return node
    shape = ctx.analysis.shape(node.meta["val"])
    d = lay.dim
    split = [*shape[:d], lay.outer, ctx.analysis.batch, lay.inner, *shape[d + 1:]]
    node = ctx.emit(aten.reshape.default, node, [ctx.emit.size(s) for s in split])
    return ctx.emit(aten.permute.default, node,
                    [d + 1] + [i for i in range(len(split)) if i != d + 1])


def _is_zeros(node) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.target is aten.zeros.default:
        return True
    return node.target is aten.full.default and node.args[1] == 0


def _batch_reduction_upstream(nodes, ctx) -> fx.Node | None:
    """A data-dependent ancestor of ``nodes`` that reduces over the batch, if any: its output mixes
    examples, so a per-sample form built from it would let example j's data into example i's
    gradient (``scale_grad_by_freq`` counts indices over the whole batch this way)."""
    an = ctx.analysis
    seen: set[fx.Node] = set()
    stack = [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen or node not in an.data_dependent:
            continue
        seen.add(node)
        if (node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor)
                and not an.is_batched(node)
                and any(an.is_batched(a) for a in node.all_input_nodes)):
            return node
        stack.extend(node.all_input_nodes)
    return None


def _mixing_reason(nodes, ctx) -> str | None:
    mixer = _batch_reduction_upstream(nodes, ctx)
    if mixer is None:
        return None
    return (f"the gradient values depend on {mixer.name} ({mixer.target}), which reduces over the "
            f"batch, so one example's gradient would depend on the others' data (is "
            f"scale_grad_by_freq=True? it counts indices over the whole batch)")


def _check_scatter(base, idx, values, mask, ctx) -> str | None:
    """The common checks of a scatter-add of (B, ...) values into a zero table."""
    if not _is_zeros(base) or ctx.analysis.is_batched(base):
        return f"the accumulated-into tensor {getattr(base, 'name', base)} is not a zero table"
    if not isinstance(idx, fx.Node) or idx.meta["val"].dtype not in (torch.int64, torch.int32):
        return "the index is not an integer tensor"
    reason = _index_layout_reason(idx, values, ctx)
    if reason is not None:
        return reason
    if values.meta["val"].dim() != idx.meta["val"].dim() + base.meta["val"].dim() - 1:
        return "the values are not one row of the table per index"
    if mask is not None and ctx.layout(mask) is not None and not (
            ctx.layout(mask) == ctx.layout(idx)
            and mask.meta["val"].dim() == values.meta["val"].dim()):
        return f"the mask has batch layout {ctx.layout(mask)}; need the index's {ctx.layout(idx)}"
    return _mixing_reason([idx, values, mask], ctx)


# Note [The index's batch layout]
# The examples may sit in any dim of the index: (B, T) ids, (T, B) ids of a time-first model
# (``emb(x.t())``), or a flattened (T*B,) view. The per-sample scatter only needs, for every
# index element, the example it belongs to (``_example_rows``), so any proven BatchDim of the
# index works, provided the values (one row per index element) carry the batch in the same dim
# with the same layout. (tests/rules/test_rule_embedding.py::test_time_first_ids_match_reference)
def _index_layout_reason(idx, values, ctx) -> str | None:
    lay = ctx.layout(idx)
    if not isinstance(lay, BatchDim):
        return f"the index has batch layout {lay}; it must carry the batch in one proven dim"
    if ctx.layout(values) != lay:
        return (f"the values have batch layout {ctx.layout(values)}; need the index's layout "
                f"{lay} (one row of values per index element)")
    return None


# -- emitting the per-sample scatter ---------------------------------------------------------------
def _sizes(node, ctx) -> list:
    return [ctx.emit.size(s) for s in ctx.analysis.shape(node.meta["val"])]


def _example_rows(idx, ctx) -> fx.Node:
    """The example each element of ``idx`` belongs to: arange(B) placed at the index's batch dim
    (split into its (outer, B, inner) flattening), broadcast to the index's shape."""
    batch = ctx.emit.batch_size()
    val, lay = idx.meta["val"], ctx.layout(idx)
    shape = ctx.analysis.shape(val)
    d = lay.dim
    split = [*shape[:d], lay.outer, ctx.analysis.batch, lay.inner, *shape[d + 1:]]
    rows = _iota(batch, val.dtype, val.device, ctx)
    rows = ctx.emit(aten.view.default, rows, [1] * (d + 1) + [batch] + [1] * (len(split) - d - 2))
    rows = ctx.emit(aten.expand.default, rows, [ctx.emit.size(s) for s in split])
    return ctx.emit(aten.reshape.default, rows, _sizes(idx, ctx))


def _iota(length, dtype, device, ctx) -> fx.Node:
    """arange(length). Emitted ops must be ones that survive Inductor's decompositions (the graph
    is already decomposed): ``prims.iota``, not ``aten.arange``."""
    return ctx.emit(prims.iota.default, length, start=0, step=1, dtype=dtype, device=device,
                    requires_grad=False)


def _per_example_tables(table_shape: list, val: torch.Tensor, ctx) -> fx.Node:
    """full([B, *table_shape], 0) with ``val``'s dtype and device."""
    return ctx.emit(aten.full.default, [ctx.emit.batch_size(), *table_shape], 0, dtype=val.dtype,
                    layout=torch.strided, device=val.device, pin_memory=False)


def _scatter_per_example(base_shape, dtype_of, rows, idx, values, mask, ctx) -> fx.Node:
    """index_put(full([B, *base_shape], 0), [rows, idx], values, accumulate=True), with the masked
    op's semantics when ``mask`` is given: masked-out values are zeroed and indices clamped into
    the table. (Emitting ``_unsafe_masked_index_put_accumulate`` itself would not trace: its fake
    implementation asks whether the (B, V, d) base is empty, a guard on the unbacked batch size.)"""
    tables = _per_example_tables(base_shape, dtype_of, ctx)
    if mask is not None:
        val = values.meta["val"]
        zero = ctx.emit(aten.scalar_tensor.default, 0, dtype=val.dtype, device=val.device)
        values = ctx.emit(aten.where.self, mask, values, zero)
        idx = ctx.emit(aten.clamp_min.default, idx, -base_shape[0])
        idx = ctx.emit(aten.clamp_max.default, idx, base_shape[0] - 1)
    return ctx.emit(aten.index_put.default, tables, [rows, idx], values, True)


def _product(exprs):
    out = 1
    for e in exprs:
        out = out * e
    return out


def _scatter_cost(kind: str, values, table_shape, ctx) -> dict:
    """One add per value element; a (B, *table_shape) tensor held (the materialize strategy)."""
    table = ", ".join(str(s) for s in table_shape)
    return {"form": f"{kind} into [B, {table}] (materialize)",
            "flops": _product(ctx.analysis.shape(values.meta["val"])),
            "memory": ctx.analysis.batch * _product(table_shape)}


# -- _unsafe_masked_index_put_accumulate(zeros, mask, [idx], values) -------------------------------
def _masked_args(node):
    base, mask, indices, values = node.args[:4]
    return base, mask, indices, values


def check_masked_put(node, ctx) -> str | None:
    base, mask, indices, values = _masked_args(node)
    if len(indices) != 1 or indices[0] is None:
        return f"it indexes {len(indices)} dims; the rule handles one index tensor on dim 0"
    return _check_scatter(base, indices[0], values, mask, ctx)


def rewrite_masked_put(node, ctx):
    base, mask, (idx,), values = _masked_args(node)
    return _scatter_per_example(_sizes(base, ctx), base.meta["val"], _example_rows(idx, ctx), idx,
                                values, mask, ctx)


def cost_masked_put(node, ctx) -> dict:
    base, _, (idx,), values = _masked_args(node)
    return _with_ghost_cost(_scatter_cost("masked index_put", values, ctx.analysis.shape(
        base.meta["val"]), ctx), idx, values, ctx)


def _with_ghost_cost(cost: dict, idx, values, ctx) -> dict:
    """``cost`` with the index-equality Gram form's (``_ghost_scatter``)."""
    shape = ctx.analysis.shape(values.meta["val"])
    tokens, width = _tokens(idx, ctx), _product(shape[idx.meta["val"].dim():])
    batch = ctx.analysis.batch
    cost.update(ghost_form=f"index-equality Gram [B, {tokens}, {tokens}]",
                ghost_flops=batch * tokens * tokens * (2 * width + 1),
                ghost_memory=batch * tokens * (tokens + width))
    return cost


def ghost_masked_put(node, ctx) -> Ghost:
    """Example i's squared norm without its (V, d) table: tokens t, t' of one example land in the
    same row iff their indices are equal, so ||G_i||^2 = sum_{t,t'} [idx_t == idx_t'] <v_t, v_t'>,
    a (T, T) Gram matrix masked by index equality (Li et al. 2022). The clipped sum is the op itself
    with each example's values scaled by its clip coefficient (book-keeping, Bu et al. 2023)."""
    base, mask, (idx,), values = _masked_args(node)

    def put(into, scaled):
        return ctx.emit(aten._unsafe_masked_index_put_accumulate.default, into, mask, [idx],
                        scaled, tag="clipped_sum")

    return _ghost_scatter(base, idx, values, mask, put, True, ctx)


def _ghost_scatter(base, idx, values, mask, put, into_base: bool, ctx) -> Ghost:
    """The index-equality Gram form of a scatter-add of token rows ``values`` into the zero
    table ``base`` at ``idx`` (``mask``: the tokens kept, or None), whose clipped sum is
    ``put(into, scaled values)``; ``into_base``: the op may accumulate into another tensor than
    a zero table (the verifier reads it so: ``Ghost.clipped_into``)."""
    emit, val = ctx.emit, values.meta["val"]
    batch = emit.batch_size()
    shape = ctx.analysis.shape(val)
    tokens = emit.size(_tokens(idx, ctx))
    width = emit.size(_product(shape[idx.meta["val"].dim():]))
    zero = emit(aten.scalar_tensor.default, 0, dtype=val.dtype, device=val.device)
    kept = values if mask is None else emit(aten.where.self, mask, values, zero)
    lay = ctx.layout(idx)   # the values' and the mask's too (_check_scatter)
    rows = emit(aten.reshape.default, _examples_first(kept, lay, ctx), [batch, tokens, width])
    gram = emit(aten.bmm.default, rows, emit(aten.permute.default, rows, [0, 2, 1]))
    flat_idx = emit(aten.reshape.default, _examples_first(idx, lay, ctx), [batch, tokens])
    table_rows = ctx.analysis.shape(base.meta["val"])[0]
    if mask is None:
        # A negative index names row idx + V, as the op reads it: equal rows, equal indices.
        flat_idx = emit(aten.remainder.Scalar, flat_idx, emit.size(table_rows))
    same = emit(aten.eq.Tensor, emit(aten.unsqueeze.default, flat_idx, 2),
                emit(aten.unsqueeze.default, flat_idx, 1))
    norm_sq = emit(aten.sum.dim_IntList, emit(aten.where.self, same, gram, zero), [1, 2])

    def clipped_into(clip, into):
        scaled = clip.scale(emit, values, ctx.layout(values))
        into_wide, scaled = at_least_float32(emit, into, scaled)
        return put(into_wide, scaled)

    def factors():
        # One-hot rows at the tokens' indices; a masked token's row is zero on the other side,
        # so its index only needs to be in range for a gather (Rows). An index out of range
        # makes the op itself fail.
        last = emit.size(table_rows - 1)
        clamped = emit(aten.clamp_max.default, emit(aten.clamp_min.default, flat_idx, 0), last)
        return Rows(index=clamped), Rows(dense=rows)

    return Ghost(norm_sq, lambda clip: clipped_into(clip, base),
                 clipped_into if into_base else None, factors=factors)


# -- index_put(zeros, [idx], values, accumulate=True) ----------------------------------------------
def _put_args(node):
    base, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    return base, indices, values, accumulate


def check_index_put(node, ctx) -> str | None:
    base, indices, values, accumulate = _put_args(node)
    if not accumulate:
        return "accumulate=False overwrites instead of summing the per-token gradients"
    if len(indices) != 1 or indices[0] is None:
        return f"it indexes {len(indices)} dims; the rule handles one index tensor on dim 0"
    return _check_scatter(base, indices[0], values, None, ctx)


def rewrite_index_put(node, ctx):
    base, (idx,), values, _ = _put_args(node)
    return _scatter_per_example(_sizes(base, ctx), base.meta["val"], _example_rows(idx, ctx), idx,
                                values, None, ctx)


def cost_index_put(node, ctx) -> dict:
    base, (idx,), values, _ = _put_args(node)
    return _with_ghost_cost(_scatter_cost("index_put", values, ctx.analysis.shape(
        base.meta["val"]), ctx), idx, values, ctx)


def ghost_check_index_put(node, ctx) -> str | None:
    _, (idx,), _, _ = _put_args(node)
    return None if isinstance(ctx.layout(idx), BatchDim) else \
        "the ghost form needs the index's batch layout"


def ghost_index_put(node, ctx) -> Ghost:
    """``ghost_masked_put``'s form without a mask: every token kept, a negative index read as
    the op reads it. The clipped sum is the op on the clip-scaled values into its zero table."""
    base, (idx,), values, _ = _put_args(node)

    def put(into, scaled):
        return ctx.emit(node.target, into, [idx], scaled, True, tag="clipped_sum")

    return _ghost_scatter(base, idx, values, None, put, False, ctx)


# -- embedding_dense_backward(grad_output, indices, V, padding_idx, scale_grad_by_freq) -----------
def check_dense_backward(node, ctx) -> str | None:
    grad_output, idx, _, _, scale_grad_by_freq = node.args[:5]
    if scale_grad_by_freq:
        return ("scale_grad_by_freq=True divides by index counts over the whole batch, so one "
                "example's gradient would depend on the others' data")
    return _index_layout_reason(idx, grad_output, ctx) or _mixing_reason([idx, grad_output], ctx)


def _valid_token_mask(idx, num_weights: int, padding_idx: int, rank: int, ctx) -> fx.Node:
    """(0 <= idx < V) & (idx != padding_idx), unsqueezed to ``rank`` dims, as the decomposition."""
    valid = ctx.emit(aten.bitwise_and.Tensor, ctx.emit(aten.ge.Scalar, idx, 0),
                     ctx.emit(aten.lt.Scalar, idx, num_weights))
    mask = ctx.emit(aten.bitwise_and.Tensor, valid, ctx.emit(aten.ne.Scalar, idx, padding_idx))
    for _ in range(rank - idx.meta["val"].dim()):
        mask = ctx.emit(aten.unsqueeze.default, mask, -1)
    return mask


def rewrite_dense_backward(node, ctx):
    grad_output, idx, num_weights, padding_idx, _ = node.args[:5]
    if idx.meta["val"].dtype != torch.int64:
        idx = ctx.emit(prims.convert_element_type.default, idx, torch.int64)
    gval = grad_output.meta["val"]
    mask = _valid_token_mask(idx, num_weights, padding_idx, gval.dim(), ctx)
    row_shape = _sizes(grad_output, ctx)[idx.meta["val"].dim():]
    ps = _scatter_per_example([num_weights, *row_shape], gval, _example_rows(idx, ctx), idx,
                              grad_output, mask, ctx)
    if gval.dtype != node.meta["val"].dtype:
        ps = ctx.emit(prims.convert_element_type.default, ps, node.meta["val"].dtype)
    return ps


def cost_dense_backward(node, ctx) -> dict:
    return _scatter_cost("masked index_put", node.args[0], ctx.analysis.shape(node.meta["val"]),
                         ctx)


def ghost_check_masked_put(node, ctx) -> str | None:
    """The ghost form reads each example's tokens as rows [B, tokens, width], from any proven
    batch layout of the index (Note [The index's batch layout])."""
    _, _, (idx,), _ = _masked_args(node)
    return None if isinstance(ctx.layout(idx), BatchDim) else \
        "the ghost form needs the index's batch layout"


MASKED_PUT = register(Rule("embedding", (aten._unsafe_masked_index_put_accumulate.default,),
                           check_masked_put, rewrite_masked_put, cost_masked_put,
                           ghost=ghost_masked_put, ghost_check=ghost_check_masked_put,
                           ghost_factors=True))
INDEX_PUT = register(Rule("index_put", (aten.index_put.default, aten._unsafe_index_put.default),
                          check_index_put, rewrite_index_put, cost_index_put,
                          ghost=ghost_index_put, ghost_check=ghost_check_index_put,
                          ghost_factors=True))
DENSE_BACKWARD = register(Rule("embedding_dense_backward", (aten.embedding_dense_backward.default,),
                               check_dense_backward, rewrite_dense_backward, cost_dense_backward))
