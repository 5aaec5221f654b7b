"""The rule registry: how each weight-gradient op becomes per-sample.

A rule is data: the ATen overloads it rewrites, a ``check`` that validates the op's constants and
layouts (returning ``None`` when the rule applies, else the reason it does not), a ``rewrite`` that
emits the per-sample form, a tensor of shape ``(B, *grad.shape)``, and a ``cost`` that states the
per-sample form's time and memory as sympy expressions in the graph's size symbols. Example::

    Rule("mm", targets=(aten.mm.default,), check=check_mm, rewrite=rewrite_mm, cost=cost_mm)

Two registries, both keyed by ATen overload:

- ``FRONTIER``: ops where the batch dim is reduced away (``mm`` contracting over B*T, ``sum`` over the
  batch dim, ``convolution_backward``...). These are where a parameter's gradient stops being
  per-example; the rule keeps the example dim instead.
- ``LIFT``: batch-free ops between a frontier and the gradient output (``permute``, ``view``, the
  ``add`` that sums the uses of a tied weight). A lift rule re-emits the op with a leading example
  dim, like a vmap batching rule.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx


@dataclasses.dataclass(frozen=True)
class Ghost:
    """A per-sample form that never builds (B, *grad.shape): the squared per-sample norms
    (ghost norm: Goodfellow 2015, Li et al. 2022) and a function that, given the clip
    coefficients (a ``Clip``), emits sum_i c_i * grad_i as one ordinary weight-gradient product
    (book-keeping: Bu et al. 2023). The emitted product is tagged "clipped_sum"; every
    floating-point operand of it that carries examples goes through ``Clip.scale`` (the one
    scaled by c) or ``Clip.mask`` (the others), which is what the verifier reads."""
    norm_sq: fx.Node
    clipped_sum: Callable[["Clip"], fx.Node]
    # The same product accumulated into a given tensor (the scaled noise, in the product's
    # shape), where the product is an accumulation into a base: base + sum_i c_i * grad_i as one
    # node (Note [The clipped sum accumulates into the noise] in passes/clip_noise.py).
    clipped_into: Callable[["Clip", fx.Node], fx.Node] | None = None
    # Example i's gradient as sum_r u_r (x) w_r, the two sides' rows (U, W); what a tied
    # parameter's cross terms are taken from (Note [Tied weights without per-sample gradients]).
    # Emitted on demand: a parameter that is not tied never needs them.
    factors: Callable[[], tuple["Rows", "Rows"]] | None = None
    # ``norm_sq`` covers every parameter whose form returns this same node (a block's norm row
    # over the parameters of one clipping group): the group's norm takes it once. Only a rule
    # that builds the shared node on purpose sets this; two parameters whose norms merely
    # coincide still count twice.
    norm_shared: bool = False


@dataclasses.dataclass(frozen=True)
class Rows:
    """One side of a ghost form's factors: example i's R rows, either ``dense`` (B, R, dim) or
    one-hot rows given by ``index`` (B, R) into ``dim`` (an embedding's tokens; rows whose
    other-side row is zero may hold any index in range)."""
    dense: fx.Node | None = None
    index: fx.Node | None = None


def gram(emit, x: Rows, y: Rows) -> fx.Node:
    """(B, Rx, Ry): <x_r, y_s> for each example. One-hot rows are never built: against dense
    rows the inner product is the dense row's entry at the index (a gather), against one-hot
    rows it is index equality."""
    aten = torch.ops.aten
    if x.index is not None and y.index is not None:
        same = emit(aten.eq.Tensor, emit(aten.unsqueeze.default, x.index, 2),
                    emit(aten.unsqueeze.default, y.index, 1))
        return emit(torch.ops.prims.convert_element_type.default, same, torch.float32)
    if x.index is not None:
        dense = emit(aten.permute.default, y.dense, [0, 2, 1])          # (B, dim, Ry)
        batch, rows_x = x.index.meta["val"].shape
        rows_y = y.dense.meta["val"].shape[1]
        index = emit(aten.expand.default, emit(aten.unsqueeze.default, x.index, 2),
                     [emit.size(emit.analysis.size(batch)), emit.size(emit.analysis.size(rows_x)),
                      emit.size(emit.analysis.size(rows_y))])
        return emit(aten.gather.default, dense, 1, index)
    if y.index is not None:
        return emit(aten.permute.default, gram(emit, y, x), [0, 2, 1])
    a, b = x.dense, y.dense
    if a.meta["val"].dtype != b.meta["val"].dtype:
        # a tied weight used under autocast (bfloat16 rows of its Linear use against float32
        # rows of its Embedding use): the inner products in float32
        a, b = (emit(torch.ops.prims.convert_element_type.default, t, torch.float32)
                for t in (a, b))
    return emit(aten.bmm.default, a, emit(aten.permute.default, b, [0, 2, 1]))


# Note [Non-finite examples contribute zero]
# An example whose per-sample norm is not finite (a NaN or inf feature, an fp16 per-sample
# gradient that overflowed) gets clip factor 0. Multiplying is not enough to silence it:
# 0 * NaN = NaN, and one NaN entry in a clipped sum makes the whole release NaN, a distinguishing
# event. So each example's terms are *selected*: where(keep_i, c_i * g_i, 0). In a book-keeping
# product the clip coefficient scales one operand inside a contraction, so the other operand's
# entries of that example are selected to zero too (where(keep_i, a_i, 0)). keep = isfinite(norm):
# a NaN or inf in an example's per-sample gradient, or in the operands its ghost norm is taken
# from, makes its norm non-finite. (tests/rules/test_nonfinite.py; the verifier requires the selects.)
@dataclasses.dataclass(frozen=True)
class Clip:
    """One clipping group's per-example coefficients c (f32[B]; f64[B] for float64 parameters)
    and its finite-example mask ``keep`` (bool[B], isfinite of the per-sample norm)."""
    coef: fx.Node
    keep: fx.Node

    def scale(self, emit, node: fx.Node, bd) -> fx.Node:
        """where(keep_i, c_i * node_i, 0) for each example i of ``node`` (batch layout ``bd``)."""
        rank = node.meta["val"].dim()
        scaled = emit(torch.ops.aten.mul.Tensor, node, emit.per_example(self.coef, bd, rank),
                      tag="clip_apply")
        return self.mask(emit, scaled, bd)

    def mask(self, emit, node: fx.Node, bd) -> fx.Node:
        """where(keep_i, node_i, 0): the examples of ``node`` with a non-finite norm zeroed."""
        val = node.meta["val"]
        keep = emit.per_example(self.keep, bd, val.dim())
        zero = emit(torch.ops.aten.scalar_tensor.default, 0, dtype=val.dtype, device=val.device)
        return emit(torch.ops.aten.where.self, keep, node, zero, tag="finite_mask")


# Sizes at which strategy="auto" compares the rules' symbolic costs (per_sample._plan_ghost).
NOMINAL_SIZE = 128


def at_nominal(expr) -> float:
    """``expr`` with every size symbol at the nominal size "auto" compares costs at."""
    return _at_nominal(sympy.sympify(expr), NOMINAL_SIZE)


# A pure function of the expression, asked again for every node's size by the rewrite and the
# norms' schedule (GPT-2 small: some 0.5 s of ``subs`` in its first step), so remembered.
@functools.lru_cache(maxsize=8192)
def _at_nominal(expr: sympy.Expr, size: int) -> float:
    return float(expr.subs({s: size for s in expr.free_symbols}))


def at_least_float32(emit, *nodes: fx.Node) -> list[fx.Node]:
    """The operands of a book-keeping product, cast up to one dtype: the widest of float32 and
    theirs. The clip-scaled operand already has it (c_i is float32, or float64 for a float64
    parameter, and the product promotes), so it is never cast. A bf16 or fp16 layer's clipped sum
    is then exactly as well bounded as a float32 one's: scaling in bf16 would round c_i up by as
    much as 2^-9 and let an example contribute more than C. A float64 layer stays float64: a cast
    down would lose precision and hide the clip-scaled operand from the verifier. The output is
    cast to the parameter's dtype once, after the noise (clip_noise._as_output)."""
    dtype = torch.float32
    for n in nodes:
        dtype = torch.promote_types(dtype, n.meta["val"].dtype)
    return [n if n.meta["val"].dtype == dtype
            else emit(torch.ops.prims.convert_element_type.default, n, dtype)
            for n in nodes]


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    targets: tuple
    check: Callable[[fx.Node, Any], str | None]
    rewrite: Callable[[fx.Node, Any], fx.Node]
    cost: Callable[[fx.Node, Any], dict] | None = None
    # Optional second strategy: ``ghost(node, ctx) -> Ghost``, applicable when
    # ``ghost_check(node, ctx)`` returns None; ``cost`` then also states "ghost_memory".
    ghost: Callable[[fx.Node, Any], Ghost] | None = None
    ghost_check: Callable[[fx.Node, Any], str | None] | None = None
    # The ghost form gives its factors (Ghost.factors), so a tied use can take it.
    ghost_factors: bool = False


@dataclasses.dataclass(frozen=True)
class LiftRule:
    name: str
    targets: tuple
    lift: Callable[[fx.Node, dict, Any], fx.Node]


FRONTIER: dict[Any, list[Rule]] = {}
LIFT: dict[Any, LiftRule] = {}


def register(rule: Rule) -> Rule:
    for t in rule.targets:
        FRONTIER.setdefault(t, []).append(rule)
    return rule


def register_lift(rule: LiftRule) -> LiftRule:
    for t in rule.targets:
        if t in LIFT:
            raise ValueError(f"two lift rules for {t}")
        LIFT[t] = rule
    return rule


def frontier_key(node: fx.Node) -> Any:
    """Tuple-returning ops (convolution_backward) are matched on the getitem of their output."""
    import operator

    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return node.args[0].target
    return node.target


def find(node: fx.Node, ctx: Any) -> tuple[Rule | None, list[str]]:
    """The first rule whose check passes, else the reasons every candidate gave."""
    reasons = []
    for rule in FRONTIER.get(frontier_key(node), []):
        why = rule.check(node, ctx)
        if why is None:
            return rule, []
        reasons.append(f"{rule.name}: {why}")
    return None, reasons

