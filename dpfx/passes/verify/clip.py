"""The clip: each clip factor's form, and what may enter the clipped sum it scales.

    bound = check_clip_factor(factor, config, adaptive, an, real)     # C, or the C_t input
    check_clipped_sum(c, clip_apply_of(c), factor.args[0], covered, dependent,
                      "the per-sample norm it is clipped by")

A clip factor is where(isfinite(norm), min(1, C / (norm + eps)), 0) of the per-sample norms
(automatic clipping: where(isfinite(norm), C / (norm + gamma), 0)), so an example of norm n
contributes n * factor <= C. A clipped sum is the sum over examples of clip_apply(per-sample
gradient, the factor's coefficient), each floating-point operand that depends on the data
selected by the factor's finite-example mask and among what the factor's norm is taken over.
The backward proof (backward.py) and the block proof (block.py) both run ``check_clipped_sum``.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpfx.config import DPConfig
from dpfx.errors import PrivacyError
from dpfx.graph.batch import BatchAnalysis
from dpfx.passes.verify.patterns import (broadcast_source, finite_masked, floating, is_zero,
                                        through_moves)

aten = torch.ops.aten


def check_clipped_sum(c: fx.Node, apply: fx.Node, keep: fx.Node, covered: set[fx.Node],
                      dependent: set[fx.Node], norm: str) -> None:
    """The clipped sum ``c`` of ``apply`` (a clip_apply node whose coefficient the caller has
    proven) sums only what its norm is taken over (``covered``, named ``norm`` in the refusal):
    the per-sample gradient scaled, and every floating-point operand that depends on the data
    (``dependent``), each selected by the finite-example mask ``keep``."""
    ps = apply.args[0]
    if through_moves(ps) not in covered:
        raise PrivacyError(f"{ps.name} enters the clipped sum {c.name} but is not part of "
                           f"{norm}")
    for x in c.all_input_nodes:
        if x not in dependent or not floating(x):
            continue    # indices and masks cannot be NaN
        value = finite_masked(x, keep, c)
        if value is not apply and value not in covered:
            raise PrivacyError(f"{value.name} enters the clipped sum {c.name} but is not "
                               f"part of {norm}")


def scaling_factor(coef: fx.Node, an: BatchAnalysis, config: DPConfig,
                   real: fx.Node | None = None) -> fx.Node:
    """The node a clip coefficient spreads over an example's positions: the clip factor itself,
    or (a mean loss's) the factor times B, proven so and looked through; the caller checks
    that what is returned is a clip factor."""
    base = broadcast_source(coef)
    if base.meta.get("dpfx") == "clip_coef":
        check_undoes_the_mean(base, an, config, real)
        base = base.args[0]
    return base


def check_clip_factor(factor: fx.Node, config: DPConfig, adaptive: fx.Node | None = None,
                      an: BatchAnalysis | None = None, real: fx.Node | None = None
                      ) -> float | fx.Node:
    """``factor`` is where(isfinite(norm), min(1, C / (norm + eps)), 0), or for automatic
    clipping where(isfinite(norm), C / (norm + gamma), 0) (Note [Clip functions] in config.py),
    with ``norm`` the per-sample norms, isfinite written abs(norm) < inf, eps the configured
    constant added to that very norm, and C one of the configured bounds; returns C. Either form
    scales an example of norm n to n * factor <= C: the clamp bounds the first, gamma > 0 the
    second, and any other denominator (a norm scaled down, a constant of the wrong sign) could
    let an example past C. Under adaptive clipping C is the ``adaptive`` input itself (Note [The
    adaptive bound is proven as an input]); with batch buckets isfinite(norm) is isfinite(norm)
    & real_rows (Note [Padded rows are proven out])."""
    bounds = set(config.clip_bounds.values()) if adaptive is None else {adaptive}
    automatic = config.clipping == "automatic"
    ok = factor.target is aten.where.self and is_zero(factor.args[2])
    keep, scale = factor.args[:2] if ok else (None, None)
    norm = norm_of_keep(keep, an, real) if ok else None
    ok = norm is not None and norm.meta.get("dpfx") == "per_sample_norms"
    if automatic:
        ratio = scale if ok else None
    else:
        ok = ok and scale.target is aten.clamp_max.default and scale.args[1] == 1.0
        ratio = scale.args[0] if ok else None
    ok = ok and ratio.target is aten.mul.Tensor and any(ratio.args[1] is b or (
        adaptive is None and ratio.args[1] == b) for b in bounds)
    inverse = ratio.args[0] if ok else None
    ok = ok and isinstance(inverse, fx.Node) and inverse.target is aten.reciprocal.default
    denom = inverse.args[0] if ok else None
    ok = ok and isinstance(denom, fx.Node) and denom.target is aten.add.Tensor \
        and denom.args[0] is norm and denom.args[1] == config.clip_eps and not denom.kwargs
    if not ok:
        form = ("C / (norm + gamma)" if automatic else "min(1, C / (norm + eps))")
        keep_form = "isfinite(norm) & (arange(B) < real_examples)" if real is not None \
            else "isfinite(norm)"
        raise PrivacyError(f"the clip factor is not where({keep_form}, {form}, 0) of the "
                           f"per-sample norms with C in {sorted(map(str, bounds))} and "
                           f"{'gamma' if automatic else 'eps'} = {config.clip_eps}")
    return ratio.args[1]


# Note [Padded rows are proven out]
# With ``batch_buckets`` a batch of B examples runs padded to P rows (Note [Padded rows contribute
# zero] in clip_noise.py). The proof does not trust that the padded rows hold nothing: every
# finite-example mask ("finite_examples": the keep of every clip factor, of every select of a
# clipped sum's operands, of every block's clipped sums, and of adaptive clipping's count) must
# be logical_and(abs(norm) < inf, real_rows) with real_rows exactly lt(arange(0, P, 1),
# real_examples), P the batch size symbol and real_examples the graph's one input so tagged (a
# 0-d float32, which the backend fills with B). So row i >= B has clip factor 0 and each of its
# terms is selected to exactly 0, whatever its values. A mean loss's clip coefficient and the
# division by D must read that same input (the graph holds g_i / B: P would scale an example
# past C), so there the in-place add_noise_ release (whose divisor is a size) is refused.
# Adaptive clipping's count must be sum_i where(real_rows, float(b_i) - 1/2, 0). A graph whose
# masks have the plain form where buckets are configured is refused.
# (tests/test_buckets.py::test_a_mask_without_the_real_rows_is_refused)
def real_examples(graph: fx.Graph) -> fx.Node:
    found = [p for p in graph.find_nodes(op="placeholder")
             if p.meta.get("dpfx") == "real_examples"]
    val = found[0].meta.get("val") if len(found) == 1 else None
    if not (isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype == torch.float32):
        raise PrivacyError("batch_buckets: the backward graph must read the count of real "
                           "examples from one 0-d float32 input tagged real_examples")
    return found[0]


def real_rows(node, an: BatchAnalysis | None, real: fx.Node) -> bool:
    """``node`` is lt(arange(0, P, 1), real_examples), P the batch size symbol."""
    if not (isinstance(node, fx.Node) and node.target is aten.lt.Tensor and len(node.args) == 2
            and node.args[1] is real and not node.kwargs):
        return False
    rows = node.args[0]
    if not (isinstance(rows, fx.Node) and rows.target is aten.arange.start_step
            and len(rows.args) == 3 and rows.args[0] == 0 and rows.args[2] == 1):
        return False
    end = rows.args[1].meta.get("val") if isinstance(rows.args[1], fx.Node) else None
    return isinstance(end, torch.SymInt) and an is not None and an.size(end) == an.batch


def norm_of_keep(keep, an: BatchAnalysis | None, real: fx.Node | None) -> fx.Node | None:
    """The per-sample norm of a finite-example mask: keep = abs(norm) < inf, or with batch
    buckets logical_and(abs(norm) < inf, real_rows); None for any other form."""
    if not isinstance(keep, fx.Node) or keep.meta.get("dpfx") != "finite_examples":
        return None
    finite = keep
    if real is not None:
        if not (keep.target is aten.logical_and.default and len(keep.args) == 2
                and real_rows(keep.args[1], an, real)):
            return None
        finite = keep.args[0]
    if not (isinstance(finite, fx.Node) and finite.target is aten.lt.Scalar
            and finite.args[1] == float("inf") and isinstance(finite.args[0], fx.Node)
            and finite.args[0].target is aten.abs.default):
        return None
    return finite.args[0].args[0]


def check_undoes_the_mean(coef: fx.Node, an: BatchAnalysis, config: DPConfig,
                          real: fx.Node | None = None) -> None:
    """A clip coefficient is the clip factor times B, undoing the 1/B that a mean loss puts on
    each example's gradient in the graph, and there is one only for loss_reduction="mean":
    any other multiplier would let an example's clipped contribution exceed C. With batch
    buckets B is the real_examples input (Note [Padded rows are proven out])."""
    size = coef.args[1] if coef.target is aten.mul.Tensor and len(coef.args) == 2 else None
    val = size.meta.get("val") if isinstance(size, fx.Node) else None
    if real is not None:
        ok = size is real
    else:
        ok = isinstance(val, torch.SymInt) and an.size(val) == an.batch
    if not (config.loss_reduction == "mean" and ok):
        raise PrivacyError(f"the clip coefficient {coef.name} is not the clip factor times the "
                           f"batch size of a mean loss: it would scale an example's clipped "
                           f"gradient past C")
