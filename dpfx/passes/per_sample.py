"""Rewrite each parameter's gradient into its per-sample form, shape (B, *param.shape).

Walking back from a parameter's gradient output, every node is batch-free until the walk reaches a
*frontier*: the op whose inputs carry the batch dim and whose output does not (``mm`` over B*T,
``sum`` over the batch dim). A frontier rule (``FRONTIER`` registry) emits the per-sample form there;
the batch-free ops between the frontier and the output are re-emitted with a leading example dim by
lift rules (``LIFT`` registry). Example, a Linear weight::

    mm_1 = mm(permute(view_4), view_2)          # frontier: contracts over 6*B
    grad = permute(mm_1, [1, 0])                # lift
  becomes
    ps   = bmm(permute(view(view_4, [B, 6, 4]), [0, 2, 1]), view(view_2, [B, 6, 16]))
    grad_ps = permute(ps, [0, 2, 1])            # f32[B, 4, 16]

A frontier that no rule matches goes to the vmap fallback (``rules/fallback.py``: vmap of the op
over the example dim, for contractions over the batch; warned about and named in ``dpfx.explain``).
Any other node on that walk with no rule is an ``UnsupportedOpError`` naming the parameter and the op.
"""
from __future__ import annotations

import dataclasses
import operator
import warnings
from typing import Any

import torch
import torch.fx as fx

from dpfx import rules
from dpfx.errors import UnsupportedOpError
from dpfx.rules import block as block_rule
from dpfx.rules import fallback
from dpfx.rules.fallback import FallbackRefused
from dpfx.rules.lift import LiftRefused
from dpfx.graph.batch import BatchAnalysis
from dpfx.graph.emit import Emitter
from dpfx.passes.verify import module_of

aten = torch.ops.aten
prims = torch.ops.prims


@dataclasses.dataclass
class ParamGrad:
    """One trainable parameter's gradient in the backward graph and what dpfx made of it."""
    name: str
    output_index: int
    grad: fx.Node
    per_sample: fx.Node | None = None
    rules: list[str] = dataclasses.field(default_factory=list)
    costs: list[dict] = dataclasses.field(default_factory=list)
    strategy: str = "materialize"
    ghost: Any = None  # rules.Ghost when strategy == "ghost"
    chain: list[fx.Node] = dataclasses.field(default_factory=list)  # frontier -> output ops
    stacked: bool = False  # Note [Vector parameters' per-sample gradients stacked] (clip_noise.py)


@dataclasses.dataclass
class RewriteContext:
    analysis: BatchAnalysis
    emit: Emitter
    strategy: str = "auto"

    def layout(self, node: Any):
        return self.analysis.layout(node) if isinstance(node, fx.Node) else None


HINT = (
    "dpfx has no per-sample rule for this op. Use a supported layer (see docs/ARCHITECTURE.md), "
    "freeze the parameter (requires_grad=False), or file an issue with the op above."
)


def _producer_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs of the op that computed ``node``: for a getitem of a tuple-returning op
    (convolution_backward), the op's own inputs."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return node.args[0].all_input_nodes
    return node.all_input_nodes


def _op_name(node: fx.Node) -> str:
    key = rules.frontier_key(node)
    return getattr(key, "__name__", str(key)) if not hasattr(key, "_overloadname") else str(key)


def rewrite_per_sample(ctx: RewriteContext, grads: list[ParamGrad],
                       errors: list | None = None) -> None:
    """Fill ``pg.per_sample`` for every parameter; the first refusal raises, or, with an
    ``errors`` list, every parameter's refusal is collected there (dpfx.validate)."""
    memo: dict[fx.Node, fx.Node | None] = {}
    for pg in grads:
        try:
            if _plan_ghost(pg, ctx) or _plan_tied_ghost(pg, ctx):
                continue
            pg.per_sample = _by_lift_rules_or_chain(pg, ctx, memo)
            if pg.per_sample is None:
                raise UnsupportedOpError(
                    f"parameter '{pg.name}': its gradient does not depend on the batch, so it "
                    f"cannot be clipped per example. {HINT}")
        except UnsupportedOpError as e:
            if errors is None:
                raise
            errors.append(e)


# Ops between a frontier and the gradient output that keep every per-sample norm unchanged, so
# the frontier's ghost norm is the parameter's: data movement only (no add, no scaling), and
# the dtype cast that low-precision decompositions end with (bf16 embedding backward
# accumulates in float32, then casts). The book-keeping replay skips the cast: the clipped sum
# stays float32 (or float64) until the output (rules.at_least_float32).
_NORM_PRESERVING = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.t.default, aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.clone.default, aten.alias.default,
    prims.convert_element_type.default,
}


def _plan_ghost(pg: ParamGrad, ctx: RewriteContext) -> bool:
    """Use the frontier rule's ghost form when the strategy allows it and the gradient is the
    frontier's output moved around (a single frontier, norm-preserving ops only)."""
    if ctx.strategy == "materialize" and not block_rule.ghost_only(pg.grad):
        return False
    chain, node = [], pg.grad
    an = ctx.analysis
    while not any(an.is_batched(a) for a in _producer_inputs(node)):
        if node.target not in _NORM_PRESERVING or len(node.users) != 1:
            return False
        chain.append(node)
        node = node.args[0]
        if not isinstance(node, fx.Node) or node not in an.data_dependent:
            return False
    if len(node.users) != 1:
        return False
    rule, _ = rules.find(node, ctx)
    if rule is None or rule.ghost is None:
        return False
    if rule.ghost_check is not None and rule.ghost_check(node, ctx) is not None:
        return False
    cost = rule.cost(node, ctx)
    if ctx.strategy == "auto" and not (rules.at_nominal(cost["ghost_memory"])
                                       < rules.at_nominal(cost["memory"])):
        return False
    pg.ghost = rule.ghost(node, ctx)
    pg.strategy = "ghost"
    pg.chain = chain[::-1]
    pg.rules.append(rule.name)
    pg.costs.append(cost)
    return True


# Note [Tied weights without per-sample gradients]
# A parameter with several uses (GPT-2's token table, which is also its LM head) gets the sum of
# the uses' weight-gradient products, G_i = sum_k G_ik, and before this the materialize strategy:
# a (B, V, d) per-sample gradient (1.2 GB at GPT-2's V = 50257, d = 768, B = 8). Its squared norm
# is ||G_i||^2 = sum_k ||G_ik||^2 + 2 sum_{k<l} <G_ik, G_il>. Each use's ghost form gives its own
# term and its factors, G_ik = sum_r u_r (x) w_r (rows U_k and W_k: rules.Ghost.factors), and
# <G_ik, G_il> = sum_{r,s} <u_r, u'_s> <w_r, w'_s> = sum(gram(U_k, U_l) * gram(W_k, W_l)): for
# the head's mm, U = its output gradients and W = its inputs; for the embedding, U = one-hot rows
# at the tokens, so against the head's U the inner products are a gather of the head's output
# gradients at the tokens, (B, T, T), and the table is never built. The clipped sum is the sum of
# the uses' book-keeping products under the one clip coefficient, each moved to the parameter's
# shape as the captured graph moved it; the verifier already reads adds of distinct clipped sums
# as one release. Eligible: a 2-D parameter whose gradient is adds of uses, each a frontier with
# a ghost form, reached through casts, same-shape views and 2-D transposes (a transposed use
# swaps its U and W). Anything else keeps the materialize strategy.
# (tests/rules/test_linear.py::test_tied_weights_ghost_matches_reference)
_SAME_SHAPE = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
               aten.clone.default, aten.alias.default, prims.convert_element_type.default}


def _tied_terms(pg: ParamGrad, ctx: RewriteContext) -> list | None:
    """[(frontier, chain from it to the add, transposed)] for a gradient that adds >= 2 uses."""
    an, shape = ctx.analysis, ctx.analysis.shape(pg.grad.meta["val"])
    if len(shape) != 2:
        return None
    terms, stack = [], [pg.grad]
    while stack:
        node = stack.pop()
        if node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs and \
                (node is pg.grad or len(node.users) == 1) and \
                all(isinstance(a, fx.Node) and a in an.data_dependent for a in node.args):
            stack.extend(node.args)
            continue
        chain, flips = [], 0
        while not any(an.is_batched(a) for a in _producer_inputs(node)):
            if len(node.users) != 1 and node is not pg.grad:
                return None
            out, src = node.meta.get("val"), node.args[0] if node.args else None
            if not isinstance(src, fx.Node) or src not in an.data_dependent or \
                    not _is_2d(out) or not _is_2d(src.meta.get("val")):
                return None
            if node.target in (aten.t.default, aten.transpose.int, aten.permute.default):
                flips += 1
            elif node.target not in _SAME_SHAPE or list(out.shape) != list(src.meta["val"].shape):
                return None
            chain.append(node)
            node = src
        if len(node.users) != 1 or not _is_2d(node.meta.get("val")):
            return None
        terms.append((node, chain[::-1], flips % 2 == 1))
    if len({frontier for frontier, _, _ in terms}) != len(terms):
        return None     # one product added to itself: the materialize strategy handles it
    return terms if len(terms) >= 2 else None


def _is_2d(val) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() == 2


def _plan_tied_ghost(pg: ParamGrad, ctx: RewriteContext) -> bool:
    """The ghost strategy for a parameter with several uses (Note [Tied weights without
    per-sample gradients])."""
    if ctx.strategy == "materialize":
        return False
    terms = _tied_terms(pg, ctx)
    if terms is None:
        return False
    found = []
    for frontier, _, _ in terms:
        rule, _ = rules.find(frontier, ctx)
        if rule is None or rule.ghost is None or not rule.ghost_factors or (
                rule.ghost_check is not None and rule.ghost_check(frontier, ctx) is not None):
            return False
        found.append((rule, rule.cost(frontier, ctx)))
    if ctx.strategy == "auto" and not (
            sum(rules.at_nominal(c["ghost_memory"]) for _, c in found)
            < sum(rules.at_nominal(c["memory"]) for _, c in found)):
        return False
    ghosts = [rule.ghost(frontier, ctx) for (rule, _), (frontier, _, _) in zip(found, terms)]
    emit = ctx.emit
    sides = []
    for g, (_, _, flipped) in zip(ghosts, terms):
        u, w = g.factors()
        sides.append((w, u) if flipped else (u, w))
    norm_sq = None
    parts = [rules.at_least_float32(emit, g.norm_sq)[0] for g in ghosts]
    for k in range(len(ghosts)):
        for m in range(k + 1, len(ghosts)):
            cross = emit(aten.mul.Tensor, rules.gram(emit, sides[k][0], sides[m][0]),
                         rules.gram(emit, sides[k][1], sides[m][1]))
            cross = rules.at_least_float32(emit, emit(aten.sum.dim_IntList, cross, [1, 2]))[0]
            parts.append(emit(aten.mul.Tensor, cross, 2.0))
    for part in parts:
        norm_sq = part if norm_sq is None else emit(aten.add.Tensor, norm_sq, part)
    # Rounding can leave an exactly cancelling example's sum a hair below 0: sqrt would make it
    # NaN, and the example would be dropped as non-finite.
    norm_sq = emit(aten.clamp_min.default, norm_sq, 0.0)

    def clipped_sum(clip):
        total = None
        for g, (_, chain, _) in zip(ghosts, terms):
            out = g.clipped_sum(clip)
            for node in chain:
                if node.target is not prims.convert_element_type.default:
                    out = emit(node.target, out, *node.args[1:], **node.kwargs)
            total = out if total is None else emit(aten.add.Tensor, total, out)
        return total

    pg.ghost = rules.Ghost(norm_sq, clipped_sum)
    pg.strategy = "ghost"
    pg.chain = []
    pg.rules.extend(rule.name for rule, _ in found)
    pg.costs.extend(cost for _, cost in found)
    return True


def _frontier_rule(node: fx.Node, pg: ParamGrad, ctx: RewriteContext) -> rules.Rule:
    """The first registered rule whose check passes, else the vmap fallback when its check
    passes (warned about, and named in explain), else an UnsupportedOpError with every reason."""
    rule, reasons = rules.find(node, ctx)
    if rule is not None:
        return rule
    why = fallback.check_vmap(node, ctx)
    if why is None:
        rule = fallback.fallback_rule(node)
        warnings.warn(
            f"dpfx: parameter '{pg.name}': no rule for weight-gradient op {_op_name(node)}; its "
            f"per-sample gradient comes from the vmap fallback ({rule.name} in dpfx.explain)",
            fallback.FallbackWarning, stacklevel=2)
        return rule
    reasons = reasons or ["no rule is registered for it"]
    raise UnsupportedOpError(
        f"parameter '{pg.name}': weight-gradient op {_op_name(node)} ({node.name}) reduces over "
        f"the batch dim and {'; '.join(reasons)}; vmap-fallback: {why}. {HINT}")


class _NoLift(UnsupportedOpError):
    """A batch-free op on a gradient that no lift rule covers: the chain is then vmapped."""

    def __init__(self, node: fx.Node, why: str):
        super().__init__(why)
        self.node, self.why = node, why


def _by_lift_rules_or_chain(pg: ParamGrad, ctx: RewriteContext, memo) -> fx.Node | None:
    """The per-sample gradient from the frontier and lift rules, else, where an op between the
    frontier and the output has no lift rule, from vmap of that whole chain (Note [The vmap lift:
    data-independent transforms of a weight] in rules/fallback.py)."""
    try:
        return _per_sample(pg.grad, pg, ctx, memo)
    except _NoLift as e:
        failed = e
    chain, frontiers = _chain(pg, ctx, failed)
    per_sample = {f: _per_sample(f, pg, ctx, memo) for f in frontiers}
    try:
        out = fallback.lift_chain(pg.grad, chain, per_sample, ctx)
    except FallbackRefused as e:
        raise UnsupportedOpError(
            f"parameter '{pg.name}'{_parametrized(pg.name)} is used through "
            f"{module_of(failed.node)}: the op "
            f"{_op_name(failed.node)} on its gradient has no lift rule ({failed.why}), and the "
            f"vmap of the transform's backward does not apply: {e}. {HINT}") from None
    found = [rules.find(f, ctx)[0] for f in frontiers]
    pg.rules[:] = [r.name if r else fallback.fallback_rule(f).name
                   for r, f in zip(found, frontiers)] + ["vmap-lift"]
    return out


def _parametrized(name: str) -> str:
    """' (of the parametrization on 'm.weight')' for a ``register_parametrization`` original."""
    owner, sep, rest = name.rpartition(".parametrizations.")
    if not sep or not rest.split(".")[-1].startswith("original"):
        return ""
    tensor = rest.split(".")[0]
    return (f" (the original of the parametrization on '{owner + '.' if owner else ''}{tensor}', "
            f"torch.nn.utils.parametrize)")


def _chain(pg: ParamGrad, ctx: RewriteContext, failed: _NoLift):
    """The batch-free, data-dependent nodes between the frontiers and ``pg.grad`` (in graph
    order) and the frontiers themselves."""
    an = ctx.analysis
    chain, frontiers, seen, stack = [], [], set(), [pg.grad]
    while stack:
        node = stack.pop()
        if node in seen or node not in an.data_dependent:
            continue
        seen.add(node)
        if any(an.is_batched(a) for a in _producer_inputs(node)):
            frontiers.append(node)
        elif node.op == "placeholder":
            raise UnsupportedOpError(
                f"parameter '{pg.name}' (used through {module_of(failed.node)}) receives the "
                f"gradient of a forward output without a batch dim: a tensor computed from the "
                f"parameter that the forward returns or stores, such as the weight that the "
                f"deprecated nn.utils.weight_norm hook sets on its module. No example's share of "
                f"that gradient can be told apart. Use torch.nn.utils.parametrizations."
                f"weight_norm (or register_parametrization) instead, or do not return the "
                f"transformed weight. {HINT}")
        else:
            chain.append(node)
            stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(pg.grad.graph.nodes)}
    return sorted(chain, key=order.__getitem__), sorted(frontiers, key=order.__getitem__)


def _per_sample(node: fx.Node, pg: ParamGrad, ctx: RewriteContext, memo) -> fx.Node | None:
    if node in memo:
        return memo[node]
    an = ctx.analysis
    if node not in an.data_dependent:
        memo[node] = None
        return None
    if an.is_batched(node):
        raise UnsupportedOpError(
            f"parameter '{pg.name}': its gradient {node.name} ({node.target}) still has the batch "
            f"dim; a parameter must not have a batch-sized dim. {HINT}")
    if any(an.is_batched(a) for a in _producer_inputs(node)):
        rule = _frontier_rule(node, pg, ctx)
        try:
            out = rule.rewrite(node, ctx)
        except FallbackRefused as e:
            raise UnsupportedOpError(
                f"parameter '{pg.name}': weight-gradient op {_op_name(node)} ({node.name}): "
                f"the vmap fallback failed: {e}. {HINT}") from None
        pg.rules.append(rule.name)
        if rule.cost is not None:
            pg.costs.append(rule.cost(node, ctx))
    else:
        lift = rules.LIFT.get(node.target)
        if lift is None:
            raise _NoLift(node, "no lift rule")
        ps_args = {}
        for a in node.all_input_nodes:
            ps = _per_sample(a, pg, ctx, memo)
            if ps is not None:
                ps_args[a] = ps
        try:
            out = lift.lift(node, ps_args, ctx)
        except LiftRefused as e:
            raise _NoLift(node, str(e)) from None
    memo[node] = out
    return out
