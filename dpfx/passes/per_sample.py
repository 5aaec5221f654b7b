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

Any node on that walk with no rule is an ``UnsupportedOpError`` naming the parameter and the op.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch.fx as fx

from .. import rules
from ..errors import UnsupportedOpError
from ..rules.lift import LiftRefused
from .batch import BatchAnalysis
from .emit import Emitter


@dataclasses.dataclass
class ParamGrad:
    """One trainable parameter's gradient in the backward graph and what dpfx made of it."""
    name: str
    output_index: int
    grad: fx.Node
    per_sample: fx.Node | None = None
    rules: list[str] = dataclasses.field(default_factory=list)
    costs: list[dict] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RewriteContext:
    analysis: BatchAnalysis
    emit: Emitter

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
            pg.per_sample = _per_sample(pg.grad, pg, ctx, memo)
            if pg.per_sample is None:
                raise UnsupportedOpError(
                    f"parameter '{pg.name}': its gradient does not depend on the batch, so it "
                    f"cannot be clipped per example. {HINT}")
        except UnsupportedOpError as e:
            if errors is None:
                raise
            errors.append(e)


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
        rule, reasons = rules.find(node, ctx)
        if rule is None:
            why = "; ".join(reasons) if reasons else "no rule is registered for it"
            raise UnsupportedOpError(
                f"parameter '{pg.name}': weight-gradient op {_op_name(node)} ({node.name}) "
                f"reduces over the batch dim and {why}. {HINT}")
        out = rule.rewrite(node, ctx)
        pg.rules.append(rule.name)
        if rule.cost is not None:
            pg.costs.append(rule.cost(node, ctx))
    else:
        lift = rules.LIFT.get(node.target)
        if lift is None:
            raise UnsupportedOpError(
                f"parameter '{pg.name}': op {node.target} ({node.name}) sits between the "
                f"weight-gradient op and the gradient output and has no lift rule. {HINT}")
        ps_args = {}
        for a in node.all_input_nodes:
            ps = _per_sample(a, pg, ctx, memo)
            if ps is not None:
                ps_args[a] = ps
        try:
            out = lift.lift(node, ps_args, ctx)
        except LiftRefused as e:
            raise UnsupportedOpError(
                f"parameter '{pg.name}': op {node.target} ({node.name}) on its gradient: {e}. "
                f"{HINT}") from None
    memo[node] = out
    return out
