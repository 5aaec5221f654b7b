"""A block's sizes as expressions in its one batch symbol, evaluated at a call's batch size.

    expr = size_expr(node.meta["val"])       # s0 * 64, as a sympy expression
    evaluate(expr, 3)                        # 192; at a SymInt batch, a SymInt

A block's graphs are captured once with a symbolic batch and called at every batch size: the
sizes its graphs read and the shapes and strides of their outputs are kept as polynomials in the
batch symbol (Note [A block op's shapes come from its graphs' metadata] in blocks/kernels.py).
"""
from __future__ import annotations

from typing import Any

import torch

from dpfx.errors import CaptureError


def size_expr(val) -> Any:
    import sympy

    return sympy.sympify(val.node.expr) if isinstance(val, torch.SymInt) else sympy.Integer(val)


def evaluate(expr, batch) -> Any:
    """``expr``, a polynomial in the one batch symbol (or a max or min of them), at ``batch``
    (an int or a SymInt)."""
    import sympy
    from torch.utils._sympy.functions import Max, Min

    if expr.is_Integer:
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        return batch
    parts = [evaluate(a, batch) for a in expr.args]
    if isinstance(expr, sympy.Mul):
        out = parts[0]
        for p in parts[1:]:
            out = out * p
        return out
    if isinstance(expr, sympy.Add):
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and expr.exp > 0:
        return parts[0] ** int(expr.exp)
    if isinstance(expr, (Max, Min)):     # a stride of a dim that may be empty
        pick = torch.sym_max if isinstance(expr, Max) else torch.sym_min
        out = parts[0]
        for p in parts[1:]:
            out = pick(out, p)
        return out
    raise CaptureError(f"a dpfx block's graph needs the size {expr}, which is not a polynomial "
                       f"in the batch size")


def batch_of(tensors: list, positions) -> Any:
    for pos in positions:
        return tensors[pos].shape[0]
    raise CaptureError("a dpfx block needs at least one argument with the batch in dim 0")


def batch_of_reads(kinds: list, reads: list, batched) -> Any:
    """The batch size of part A's reads ``reads`` (of kinds ``kinds``): an output gradient's
    dim 0, else a batched argument's."""
    for (kind, _), t in zip(kinds, reads):
        if kind == "grad" and t.dim():
            return t.shape[0]
    for (kind, i), t in zip(kinds, reads):
        if kind == "arg" and i in batched:
            return t.shape[0]
    raise CaptureError("a dpfx block's backward reads no tensor with the batch in dim 0")


def resized(t: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` rows of ``t`` (its rows repeated; zeros where it has none)."""
    if t.dim() == 0:
        return t
    if t.shape[0] == 0:
        return t.new_zeros((n, *t.shape[1:]))
    return t[torch.arange(n, device=t.device) % t.shape[0]]
