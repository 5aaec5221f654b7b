"""Comparisons of the batch size during capture: decided at the call's size, recorded, routed.

    decisions = []
    with deciding(3, decisions):      # while dynamo captures the call
        compiled(x)                   # the model's `if B != 1:` is decided True at B = 3
    holds(decisions, 1)               # False: B = 1 needs its own graph

# Note [Deciding a branch on the batch size]
dpfx keeps the batch an unbacked symbol u0 (Note [Why the batch dim is marked unbacked] in
capture/entry.py), so code that compares it with a number cannot be traced as is: ``if batch_size !=
position_ids.shape[0]`` in transformers' masking code (``Ne(u0, 1)``), ``self.keys.numel() == 0``
in its cache (``Eq(128*u0, 0)``), a stride test in a torch kernel. Answering every such question
one way for all sizes (torch's ``guard_or_false``, size-oblivious reasoning) is right only where
both branches compute the same thing; backed sizes would specialize 0, 1 and every equality with
another dim. dpfx answers by who asks:

1. The model's code (dynamo interpreting a line outside torch): as the call's real batch size
   would, exactly what eager PyTorch does for that call. The answer is recorded as a
   ``Decision`` with the model's source line. A graph serves every later batch size at which all
   its decisions come out the same (``holds``); for a size that flips one, ``DPModule`` captures
   another graph in its own dynamo entry, deciding as that size would. GPT-2 without a mask gets
   one graph for B != 1 and one for B = 1; a model without such branches keeps one graph.
2. torch itself (kernels, meta functions, decompositions, autograd formulas, torch functions
   dynamo inlines): torch's own size-oblivious answer, the batch as if >= 2, where it has one.
   These are layout and broadcasting fast paths whose branches agree (mm's backward stride test
   on a (B, 1) operand, ``sum_to_size`` over a broadcast dim); the family tests check B = 0 and 1
   against eager. Without such an answer, the question is decided as in 1.

No runtime assertion is added: asserting ``Eq(u0, 1)`` would teach the shape environment that the
batch is 1, and the B = 1 graph would lose its batch dims in broadcasts (nothing for a per-sample
rule to follow). Routing is what keeps a graph to the sizes it was decided for, and the self-check
runs each graph only at sizes it serves. The privacy proof of every graph holds for every value of
the symbol, whatever was decided. A comparison that also involves a value computed from the data
or another dynamic size, or the batch needed as a Python number (``range(x.shape[0])``), is not
decided: compiled_call.py's CaptureError names the expression and the model's frames.
(tests/capture/test_model_families.py::test_batch_branch_routing, test_causal_lm_without_mask;
tests/rules/test_linear.py::test_raw_product_of_one_column_matches_reference)
"""
from __future__ import annotations

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


class deciding:
    """Comparisons in the batch alone are decided at ``batch`` while this is active, and
    appended to ``decisions``. A plain class: it is entered on every call."""

    __slots__ = ("_active", "_outer")

    def __init__(self, batch: int, decisions: list[Decision]):
        self._active = (batch, decisions)

    def __enter__(self):
        self._outer = getattr(_state, "active", None)
        _state.active = self._active
        ShapeEnv._evaluate_expr = _evaluate_or_decide
        return self

    def __exit__(self, *exc):
        _state.active = self._outer
        if self._outer is None:
            ShapeEnv._evaluate_expr = _evaluate_expr
        return False


def _evaluate_or_decide(self, orig_expr, hint=None, fx_node=None, size_oblivious=False,
                        fallback_value=None, *, forcing_spec=False):
    try:
        return _evaluate_expr(self, orig_expr, hint, fx_node, size_oblivious, fallback_value,
                              forcing_spec=forcing_spec)
    except GuardOnDataDependentSymNode as e:
        active = getattr(_state, "active", None)
        symbol = _batch_symbol(self, orig_expr)
        if active is None or symbol is None:
            # for compiled_call.py's error
            e.dpfx_expr, e.dpfx_model_stack = orig_expr, _model_stack()
            # no input's batch dim in it: a branch on a value of the data (capture/errors.py)
            e.dpfx_on_data = not (orig_expr.free_symbols & set(self.unbacked_inputs))
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
