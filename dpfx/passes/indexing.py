"""The forward check's rule for ops that index a batch dim with a tensor of indices.

    mask[arange(U*k)[:, None, None, None], positions]   # HF's padding mask under per_user: kept
    x[U*k - 1 - arange(U*k)]                             # row p reads another user's row: refused
    x[zeros(B)]                                          # every row reads example 0: refused

``index(x, [I, J])`` reads, at position p of its result, x's row I[p]; ``index_put(x, [I, J],
v)`` writes v[p] into x's row I[p]. Whatever the layouts of x and I, the values of I decide which
example's row is read or written, so the layouts alone (which the batch analysis proves) say
nothing about whether the op keeps examples apart. It does when I[p] is p's own row (an arange
over the rows, moved but not computed on: ``BatchDim.index_of == "row"``, of the same size and
layout as x's batch dim), or p's own unit where x holds one row per unit (``"unit"``). Note [An
arange over the rows] in graph/batch.py says how those values are proven. Every other index
tensor, the written values and the mask must then be batch-free or hold the batch where I does,
laid out alike. An index that leaves x's batch dim alone must be batch-free (a batched index
into a feature dim would write each row at positions other rows chose). A boolean index over
x's batch dim keeps rows chosen by the data, and is refused.

``embedding(table, ids)`` is ``index(table, [ids])``; a table that holds the batch is checked
so. ``take`` reads a flattened tensor, across every dim: it is a dim op of the forward check
(``_READS_ACROSS`` in verify/forward.py).
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from dpfx.graph.batch import BatchAnalysis, BatchDim, sizes_equal

aten = torch.ops.aten

# op -> (position of the index list, positions of tensors broadcast against the indexed result:
# the values written, the mask)
_INDEXING = {
    aten.index.Tensor: (1, ()),
    aten._unsafe_index.Tensor: (1, ()),
    aten._unsafe_masked_index.default: (2, (1,)),
    aten.index_put.default: (1, (2,)),
    aten.index_put_.default: (1, (2,)),
    aten._unsafe_index_put.default: (1, (2,)),
    aten._index_put_impl_.default: (1, (2,)),
    aten._unsafe_masked_index_put_accumulate.default: (2, (1, 3)),
    aten.embedding.default: (1, ()),
}


def index_problem(node: fx.Node, an: BatchAnalysis) -> str | None:
    """Why ``node``, an op that indexes a batched tensor, reads or writes across examples; None
    when it does not, or when ``node`` is no such op."""
    spec = _INDEXING.get(node.target)
    if spec is None or not an.is_batched(node.args[0]):
        return None        # a batch-free table read at any positions holds no example's data
    x, (at, aligned) = node.args[0], spec
    lay = an.layout(x)
    if not isinstance(lay, BatchDim):
        return None        # refused where its layout was lost
    indices = node.args[at] if isinstance(node.args[at], (list, tuple)) else [node.args[at]]
    given = {d: i for d, i in enumerate(indices) if isinstance(i, fx.Node)}
    if not given:
        return None
    vals = {d: i.meta["val"] for d, i in given.items()}
    if any(v.dtype in (torch.bool, torch.uint8) for v in vals.values()):
        return f"indexes {x.name} with a boolean mask, which keeps the rows the data chooses"
    rank = max(v.dim() for v in vals.values())
    dims = sorted(given)
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    front = dims[0] if adjacent else 0
    result_rank = x.meta["val"].dim() - len(dims) + rank
    shape = an.shape(x.meta["val"])
    if lay.dim in given:
        rows = given[lay.dim]
        own = an.layout(rows)
        fits = isinstance(own, BatchDim) and (
            (own.index_of == "row" and sizes_equal(an.shape(vals[lay.dim])[own.dim], shape[lay.dim])
             and sizes_equal(own.outer, lay.outer) and sizes_equal(own.inner, lay.inner))
            or (own.index_of == "unit" and lay.is_plain))
        if not fits:
            return (f"indexes the batch dim {lay.dim} of {x.name} with {rows.name}, which is not "
                    f"proven to hold each row's own index (an arange over the rows, unchanged), "
                    f"so a row may read or write another example's row")
        where = front + rank - vals[lay.dim].dim() + own.dim
        size = an.shape(vals[lay.dim])[own.dim]
        for d, i in given.items():
            if d != lay.dim and not _aligned(i, where, rank, front, own, size, an):
                return (f"indexes {x.name} with {i.name}, whose rows are not {rows.name}'s, so a "
                        f"row reads or writes positions another example's data chose")
    else:
        batched = [i.name for i in given.values() if an.is_batched(i)]
        if batched:
            return (f"indexes feature dims of {x.name} with the batched {', '.join(batched)}, "
                    f"so a row reads or writes positions other examples' data chose")
        kept = [d for d in range(x.meta["val"].dim()) if d not in given]
        where = (lay.dim if lay.dim < front else lay.dim - len(dims) + rank) if adjacent \
            else rank + kept.index(lay.dim)
        own, size = lay, shape[lay.dim]
    for pos in aligned:
        t = node.args[pos] if pos < len(node.args) else None
        if isinstance(t, fx.Node) and not _aligned(t, where, result_rank, 0, own, size, an):
            return (f"writes {t.name} into {x.name} at rows other than its own")
    return None


def _aligned(t: fx.Node, where: int, rank: int, front: int, own: BatchDim, size: sympy.Expr,
             an: BatchAnalysis) -> bool:
    """``t``, broadcast (right-aligned) to ``rank`` dims placed from ``front``, is batch-free or
    holds the batch at dim ``where`` with ``own``'s layout and ``size``."""
    if not an.is_batched(t):
        return True
    lay, val = an.layout(t), t.meta["val"]
    return isinstance(lay, BatchDim) and front + rank - val.dim() + lay.dim == where and \
        sizes_equal(an.shape(val)[lay.dim], size) and sizes_equal(lay.outer, own.outer) and \
        sizes_equal(lay.inner, own.inner)
