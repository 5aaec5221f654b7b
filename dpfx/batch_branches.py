"""Branches of the model's code on the batch size: decided per call, asserted, routed.

    decisions = []
    with deciding(3, decisions):      # while dynamo captures the call
        compiled(x)                   # `if B != 1:` is decided True at B = 3, and asserted
    holds(decisions, 1)               # False: B = 1 needs its own graph

# Note [Deciding a branch on the batch size]
dpfx keeps the batch an unbacked symbol u0 (Note [Why the batch dim is marked unbacked] in
api.py), so code that compares it with a number cannot be traced: ``if batch_size !=
position_ids.shape[0]`` in transformers' masking code (``Ne(u0, 1)``), ``self.keys.numel() == 0``
in its cache (``Eq(160*u0, 0)``), a size check in a torch kernel. torch's own answers do not fit:
``guard_or_false`` and size-oblivious reasoning pick one branch for every size (right only when
that branch happens to compute the same thing at B = 0 and 1), and backed sizes specialize 0 and
1 and every equality with another dim.

dpfx decides each such comparison as the current call's batch size would, exactly what eager
PyTorch does for that call, and keeps the batch symbolic otherwise:

1. While capturing, a comparison whose only unknown is the batch symbol is evaluated at the real
   batch size. The answer becomes a runtime assertion in the graph (it raises rather than compute
   another branch's result) and a recorded decision, with the model's source line.
2. The graph serves every later batch size for which all its decisions come out the same
   (``holds``). For a batch size that flips one, dpfx captures another graph (its own dynamo
   entry), deciding as that size would. GPT-2 without a mask gets one graph for B != 1 and
   one for B = 1; a model without such branches keeps one graph for all sizes.

Sound for every batch size: each graph computes what the model computes at every size it serves
(the decisions are the model's own answers there), and the privacy proof of each graph is
independent of the decisions (it holds for every value of the symbol). Only comparisons in the
batch alone are decided: one that also involves a data-dependent value or another dynamic size
is still refused (api.py's CaptureError, naming the model's line).
(tests/test_model_families.py::test_causal_lm_without_mask, test_batch_branch_routing)
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import traceback

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

_evaluate_expr = ShapeEnv._evaluate_expr
_state = threading.local()


@dataclasses.dataclass(frozen=True)
class Decision:
    """``expr`` (in the batch symbol ``symbol``) was ``value`` at the batch size of capture."""
    expr: sympy.Basic
    symbol: sympy.Symbol
    value: bool
    where: str          # the model's source line that asked

    def holds(self, batch: int) -> bool:
        return bool(self.expr.xreplace({self.symbol: batch})) == self.value

    def __str__(self) -> str:
        return f"{self.expr} = {self.value} ({self.where})"


def holds(decisions: list[Decision], batch: int) -> bool:
    return all(d.holds(batch) for d in decisions)


@contextlib.contextmanager
def deciding(batch: int, decisions: list[Decision]):
    """Comparisons in the batch alone are decided at ``batch`` while this is active, and
    appended to ``decisions``."""
    _state.active = (batch, decisions)
    ShapeEnv._evaluate_expr = _evaluate_or_decide
    try:
        yield
    finally:
        ShapeEnv._evaluate_expr = _evaluate_expr
        _state.active = None


def _evaluate_or_decide(self, orig_expr, hint=None, fx_node=None, size_oblivious=False,
                        fallback_value=None, *, forcing_spec=False):
    try:
        return _evaluate_expr(self, orig_expr, hint, fx_node, size_oblivious, fallback_value,
                              forcing_spec=forcing_spec)
    except GuardOnDataDependentSymNode as e:
        active = getattr(_state, "active", None)
        symbol = _batch_symbol(self, orig_expr)
        if active is None or symbol is None:
            e.dpfx_expr, e.dpfx_model_stack = orig_expr, _model_stack()   # for api.py's error
            raise
        if not _in_model_code():
            generic = self._maybe_evaluate_static(orig_expr, size_oblivious=True)
            if generic is not None:
                return generic
        batch, decisions = active
        value = orig_expr.xreplace({symbol: batch})
        if value not in (sympy.true, sympy.false):
            e.dpfx_expr, e.dpfx_model_stack = orig_expr, _model_stack()
            raise
        decisions.append(Decision(orig_expr, symbol, bool(value), _model_line()))
        return value


def _batch_symbol(shape_env: ShapeEnv, expr) -> sympy.Symbol | None:
    """The one free symbol of a boolean ``expr`` if it is an input's unbacked dim (dpfx marks
    only the batch dim of inputs unbacked); ``None`` for anything else."""
    if not (expr.is_Relational or isinstance(expr, sympy.logic.boolalg.BooleanFunction)) \
            or len(expr.free_symbols) != 1:
        return None
    (symbol,) = expr.free_symbols
    return symbol if symbol in shape_env.unbacked_inputs else None


# Frames of torch's kernels, decompositions, autograd formulas and compilers (as opposed to
# dynamo interpreting the model's own bytecode).
_TORCH_INTERNALS = ("torch/_subclasses/", "torch/_meta_registrations", "torch/_refs/",
                    "torch/_decomp/", "torch/_prims", "torch/_functorch/", "torch/_inductor/",
                    "torch/autograd/", "torch/_higher_order_ops/")


def _in_model_code() -> bool:
    """Whether the comparison is made by the model's code (dynamo interpreting a line outside
    torch), not by a torch kernel or a torch Python function dynamo inlined."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.endswith("torch/_dynamo/symbolic_convert.py"):
            traced = _traced_frames()
            return bool(traced) and "/torch/" not in traced[-1].filename
        if any(part in frame.filename for part in _TORCH_INTERNALS):
            return False
    return False


def _model_stack() -> list[str]:
    """The model's frames dynamo was tracing, outermost first (dpfx's entry left out)."""
    return [f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
            for f in _traced_frames() if "/dpfx/" not in f.filename]


def _traced_frames() -> list:
    from torch._guards import TracingContext

    try:
        return list(TracingContext.extract_stack())
    except Exception:
        return []


def _model_line() -> str:
    """The innermost frame dynamo was tracing in the user's code, as ``file:line in fn``."""
    for frame in reversed(_traced_frames()):
        if "/torch/" not in frame.filename and "/dpfx/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "inside torch"
