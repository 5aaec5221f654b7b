"""dpfx's normalized graph printer: one line a node, symbolic shapes, no addresses or traces.

Example::

    graph backward
      input  %view: f32[6*B, 8]
      input  %tangents_1: f32[B, 6, 4]
      %bmm: f32[B, 4, 6] = aten.bmm(%permute_9, %view_12)
      %clip_factor: f32[B] = aten.where.self(%keep, %clamp_max, %zero)  # dpfx: clip_factor
      return grad[l2.weight]=%mul_7, grad[l2.bias]=%mul_9

The batch symbol prints as ``B`` whatever shape-env name it had (``u0``, ``s0``), so goldens read
the same across runs and are easy to review.
"""
from __future__ import annotations

import functools
from typing import Any

import sympy
import torch
import torch.fx as fx

from dpfx.graph.batch import sym_expr

_DTYPES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.bool: "b8", torch.uint8: "u8", torch.int8: "i8",
}


def _size(s: Any, subs: dict) -> str:
    if isinstance(s, int):
        return str(s)
    return _symbolic_size(sym_expr(s), tuple(subs.items()))


@functools.lru_cache(maxsize=4096)
def _symbolic_size(expr: Any, subs: tuple) -> str:
    """Printing a size substitutes and prints a sympy expression, about 0.1 ms each; a graph
    repeats few distinct ones (GPT's stage texts printed 3.7k sizes a compile)."""
    return str(sympy.sympify(expr).subs(dict(subs)))


def describe_val(val: Any, subs: dict) -> str:
    if isinstance(val, torch.Tensor):
        dims = ", ".join(_size(s, subs) for s in val.shape)
        return f"{_DTYPES.get(val.dtype, str(val.dtype))}[{dims}]"
    if isinstance(val, torch.SymInt):
        return f"sym {_size(val, subs)}"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(describe_val(v, subs) for v in val) + ")"
    return type(val).__name__ if val is not None else "?"


def _arg(a: Any, subs: dict) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x, subs) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.SymInt):
        return _size(a, subs)
    if isinstance(a, torch.dtype):
        return _DTYPES.get(a, str(a))
    if isinstance(a, torch.device):
        return a.type
    if isinstance(a, float):
        return repr(round(a, 9))
    if isinstance(a, str):
        return repr(a)
    return str(a)


def _target(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        ns = t.namespace
        name = t._opname if t._overloadname == "default" else f"{t._opname}.{t._overloadname}"
        return f"{ns}.{name}"
    return getattr(t, "__name__", str(t))


def format_graph(gm: fx.GraphModule, title: str, batch_symbols=(),
                 output_names: dict[int, str] | None = None) -> str:
    subs = {s: sympy.Symbol("B") for s in batch_symbols}
    lines = [f"graph {title}"]
    for node in gm.graph.nodes:
        val = describe_val(node.meta.get("val"), subs)
        if node.op == "placeholder":
            lines.append(f"  input  %{node.name}: {val}")
        elif node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
            parts = []
            for i, o in enumerate(outs):
                label = (output_names or {}).get(i)
                text = _arg(o, subs)
                parts.append(f"{label}={text}" if label else text)
            lines.append("  return " + ", ".join(parts))
        else:
            args = [_arg(a, subs) for a in node.args]
            args += [f"{k}={_arg(v, subs)}" for k, v in node.kwargs.items()]
            line = f"  %{node.name}: {val} = {_target(node)}({', '.join(args)})"
            tag = node.meta.get("dpfx")
            lines.append(f"{line}  # dpfx: {tag}" if tag else line)
    return "\n".join(lines) + "\n"
