"""A constant factor of either sign on the whole loss (Note [A constant factor is no change of
scale] in dpfx/loss/scale.py, Note [A negative multiple of the captured loss] in
dpfx/loss/captured.py): gradient ascent, a log-likelihood or a reward maximized.

``(-loss).backward()`` and ``(-0.5 * loss).backward()`` release -(sum_i clip(g_i) + noise) / D on
the captured loss and in the plain loop: the magnitude is removed as every constant is, the sign
stays. Checked through Inductor against the batch-of-one reference at sigma 0 with a bound that
clips some examples, at B = 0, 1, 5 and both reductions; by the auditor's canary (one added
example moves the release by at most C / D); and at sigma > 0, the noise's std sigma C / D per
coordinate. A constant factor raises no LossScaleWarning, a reduction that differs still does;
a negative tensor factor and a zero multiple of the captured loss are refused.
"""
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from dpfx.loss import verdicts
from support.noise_stats import assert_noise_per_parameter, detectable_std_error
from support.reference import (assert_close, bound_that_bites, loop_dp_sgd_grads,
                               loop_example_grads, per_example_norms)

SCALES = (-1.0, -0.5)
BATCHES = (0, 1, 5)
EXPECTED = 4            # D for loss_reduction="mean"
TOL = {"rtol": 1e-4, "atol": 1e-6}     # Inductor's CPU reductions may sum in another order


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _ce(reduction):
    def ce(out, y):
        return F.cross_entropy(out, y, reduction=reduction)
    return ce


def _data(n=5, seed=1):
    torch.manual_seed(seed)
    return torch.randn(n, 4) * 2, torch.randint(0, 3, (n,))


def _compile(model, path, reduction, bound, sigma=0.0, **kw):
    extra = {"loss": _ce(reduction)} if path == "captured" else {}
    return dpfx.compile(model, max_grad_norm=bound, noise_multiplier=sigma,
                        loss_reduction=reduction,
                        expected_batch_size=EXPECTED if reduction == "mean" else None,
                        **extra, **kw)


def _step(dp, model, path, reduction, scale, x, y):
    """One release of ``scale * loss``: {name: p.grad}, the gradients left zeroed."""
    model.zero_grad(set_to_none=True)
    loss = dp.loss(x, y) if path == "captured" else _ce(reduction)(dp(x), y)
    (scale * loss).backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _reference(model, reduction, bound, x, y, sign=-1.0):
    want = loop_dp_sgd_grads(model, _ce(reduction), (x,), y, max_grad_norm=bound,
                             loss_reduction=reduction,
                             expected_batch_size=EXPECTED if reduction == "mean" else None)
    return {k: sign * v for k, v in want.items()}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("path", ["captured", "plain"])
def test_a_negative_constant_releases_the_negated_reference(path, reduction):
    """Through Inductor at sigma 0: -1 and -0.5 times the loss each release minus the
    batch-of-one reference's clipped sum over D, at B = 0, 1, 5, with a bound that clips some
    examples and not others (a sign lost, a magnitude kept or a clip skipped each fails), and
    without a LossScaleWarning. The positive loss still releases the reference itself."""
    model = _mlp()
    x, y = _data()
    norms = per_example_norms(loop_example_grads(model, _ce(reduction), (x,), y))
    bound = bound_that_bites(norms)
    assert norms.min() < bound < norms.max()
    dp = _compile(model, path, reduction, bound)
    verdicts.forget()
    with warnings.catch_warnings():
        warnings.simplefilter("error", dpfx.LossScaleWarning)
        for scale in SCALES:
            for b in BATCHES:
                got = _step(dp, model, path, reduction, scale, x[:b], y[:b])
                try:
                    assert_close(got, _reference(model, reduction, bound, x[:b], y[:b]), **TOL)
                except AssertionError as e:
                    raise AssertionError(f"scale {scale}, B = {b}: {e}") from None
        got = _step(dp, model, path, reduction, 1.0, x, y)
        assert_close(got, _reference(model, reduction, bound, x, y, sign=1.0), **TOL)


@pytest.mark.parametrize("path", ["captured", "plain"])
def test_one_added_example_moves_a_negated_release_by_at_most_C_over_D(path):
    """The auditor's canary at sigma 0, for -0.5 times the loss: eight examples under the bound,
    then a canary whose gradient the bound clips. The release moves by at most C / D (the
    magnitude 0.5 is removed, so C / D exactly: the canary's clipped gradient), under both
    reductions, D = expected_batch_size for "mean"."""
    for reduction in ("mean", "sum"):
        model = _mlp()
        torch.manual_seed(2)
        x, y = torch.randn(8, 4) * 0.1, torch.randint(0, 3, (8,))
        canary_x = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
        with torch.no_grad():
            canary_y = model(canary_x).argmin(1)        # its least likely class
        xs, ys = torch.cat([x, canary_x]), torch.cat([y, canary_y])
        norms = per_example_norms(loop_example_grads(model, _ce(reduction), (xs,), ys))
        bound = float(norms[:8].max()) * 1.05
        assert float(norms[8]) > 1.2 * bound, "the canary must be clipped"
        dp = _compile(model, path, reduction, bound, backend="eager")
        base = _step(dp, model, path, reduction, -0.5, x, y)
        added = _step(dp, model, path, reduction, -0.5, xs, ys)
        moved = math.sqrt(sum(float((added[k] - base[k]).pow(2).sum()) for k in base))
        limit = bound / (EXPECTED if reduction == "mean" else 1)
        assert limit * (1 - 1e-3) <= moved <= limit * (1 + 1e-4), (reduction, moved, limit)


@pytest.mark.filterwarnings("ignore::dpfx.FixedSeedWarning")
@pytest.mark.parametrize("path", ["captured", "plain"])
def test_the_noise_of_a_negated_release_has_std_sigma_C_over_D(path):
    """sigma = 1: over 300 releases of -0.5 times the loss on one batch, the release minus the
    sigma-0 reference (the negated clipped sum over D) is noise of std sigma C / D in every
    coordinate, each parameter on its own and all pooled: noise added twice (sqrt 2 too large)
    or scaled by |c| = 0.5 is far outside the tolerance, which the check is sure to resolve."""
    steps, sigma, bound, reduction = 300, 1.0, 0.5, "mean"
    model = _mlp()
    x, y = _data(n=EXPECTED)
    want = _reference(model, reduction, bound, x, y)
    dp = _compile(model, path, reduction, bound, sigma=sigma, seed=7)
    draws = {k: [] for k in want}
    for _ in range(steps):
        got = _step(dp, model, path, reduction, -0.5, x, y)
        for k in want:
            draws[k].append(got[k] - want[k])
    draws = {k: torch.stack(v) for k, v in draws.items()}
    n = sum(d.numel() for d in draws.values())
    assert detectable_std_error(n) < 0.1, "the check must resolve a 10% error in the std"
    assert_noise_per_parameter(draws, sigma * bound / EXPECTED)


def test_a_constant_factor_raises_no_scale_warning_and_a_mismatch_still_does():
    """``1.5 * F.mse_loss(out, teacher.detach(), reduction="sum")`` under loss_reduction="sum"
    has the reduction dpfx was compiled with: no LossScaleWarning at B = 1, 2, 5, nor for -0.5
    or -1 times it (but -0.5 at B = 2, which is -1 / B). A mean under "sum" warns, naming the mean (not a count of tokens), a Python
    number equal to the batch size (``sum / len(y)``) warns too, and 1.5 times a mean still
    does: the factor is no reduction, the mean is."""
    model = _mlp()
    teacher = nn.Linear(4, 3)
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, loss_reduction="sum",
                      backend="eager")

    def step(loss_fn, batch):
        x = torch.randn(batch, 4)
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            loss_fn(dp(x), teacher(x).detach()).backward()
        return [str(w.message) for w in record if w.category is dpfx.LossScaleWarning]

    # (-0.5 at B = 2 would be 1 / len(y), which dpfx cannot tell from a constant: it warns)
    for factor, batches in ((1.5, (1, 2, 5)), (-0.5, (1, 3, 5)), (-1.0, (1, 2, 5))):
        for batch in batches:
            verdicts.forget()
            assert step(lambda o, t: factor * F.mse_loss(o, t, reduction="sum"), batch) == [], \
                (factor, batch)
    mismatched = {
        "a mean": lambda o, t: F.mse_loss(o, t),
        "1.5 times a mean": lambda o, t: 1.5 * F.mse_loss(o, t),
        "a sum over len(t)": lambda o, t: F.mse_loss(o, t, reduction="sum") / len(t),
    }
    for name, loss_fn in mismatched.items():
        verdicts.forget()
        found = step(loss_fn, 5)
        assert len(found) == 1 and "is a mean over the batch" in found[0] and \
            "loss_reduction='sum'" in found[0], (name, found)


def test_a_negative_tensor_or_a_zero_multiple_is_refused_and_a_zero_number_releases_nothing():
    """dpfx cannot tell a negative constant in a tensor from a statistic of the batch, whose sign
    would flip every example's gradient: ``loss * torch.tensor(-1.)`` is refused in both forms,
    and so is ``backward(gradient=torch.tensor(-2.))``, nothing written. A zero multiple of the
    captured loss is refused (its graph has no zero to release); the plain loop's ``0 * loss``
    releases every example's gradient 0 (sigma 0: zeros)."""
    model = _mlp()
    x, y = _data()
    dp = _compile(model, "captured", "mean", 1.0, backend="eager")
    with pytest.raises(dpfx.PrivacyError, match="cannot tell a negative constant in a tensor"):
        (dp.loss(x, y) * torch.tensor(-1.0)).backward()
    with pytest.raises(dpfx.PrivacyError, match="cannot tell a negative constant in a tensor"):
        dp.loss(x, y).backward(gradient=torch.tensor(-2.0))
    with pytest.raises(dpfx.PrivacyError, match="multiplied by 0.0 .* Skip the step"):
        (0.0 * dp.loss(x, y)).backward()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(dpfx.PrivacyError, match="cannot tell a negative constant in a tensor"):
        (F.cross_entropy(dp(x), y) * torch.tensor(-1.0)).backward()
    assert all(p.grad is None for p in model.parameters())
    before = dp.releases
    got = _step(dp, model, "plain", "mean", 0.0, x, y)
    assert all(not g.any() for g in got.values())
    assert dp.releases == before + 1
