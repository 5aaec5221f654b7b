"""Statistical checks of DP-SGD noise with tolerances tied to the standard error.

Every check is a z-test at ``Z`` standard errors: with n independent N(0, s^2) draws, the sample
mean has standard error s / sqrt(n) and the root mean square about 0 (the std estimate when the
mean is known to be 0) has standard error s / sqrt(2 n). At Z = 5 a correct implementation fails
one check in ~1.7 million; the tests that call these are seeded, so they are deterministic anyway.

Each parameter is checked on its own slice (a wrong scale on a 3-entry bias is invisible in a
pool of thousands of entries), and the pool of all parameters is checked too (it resolves a small
error common to all). ``detectable_std_error`` says which relative error a check of n draws is
sure to see, so a test can assert that it resolves the error it claims to catch.
"""
from __future__ import annotations

import math

import torch

Z = 5.0


def rms_standard_error(n: int) -> float:
    """Relative standard error of sqrt(mean(x^2)) over n N(0, s^2) draws."""
    return 1.0 / math.sqrt(2 * n)


def detectable_std_error(n: int) -> float:
    """A relative std error this large is outside Z standard errors even when the estimate lands
    one standard error back towards the truth."""
    return (Z + 1) * rms_standard_error(n)


def assert_gaussian_scale(draws: torch.Tensor, std: float, what: str) -> None:
    """``draws`` (any shape, all entries i.i.d. N(0, std^2) if correct): mean and scale."""
    x = draws.double().flatten()
    n = x.numel()
    assert n > 0, what
    mean, rms = x.mean().item(), x.pow(2).mean().sqrt().item()
    se = std / math.sqrt(n)
    assert abs(mean) < Z * se, \
        f"{what}: mean {mean:.4g} is over {Z} standard errors ({se:.3g}) from 0"
    err = abs(rms / std - 1)
    assert err < Z * rms_standard_error(n), \
        f"{what}: std {rms:.4g} vs {std:.4g} ({err:.2%} off; {Z} standard errors = " \
        f"{Z * rms_standard_error(n):.2%} over {n} draws)"


def assert_noise_per_parameter(draws: dict, std: float) -> None:
    """``draws``: {parameter name: (steps, *p.shape)}: every parameter's slice on its own, then
    all of them pooled."""
    for name, d in draws.items():
        assert_gaussian_scale(d, std, f"parameter '{name}'")
    assert_gaussian_scale(torch.cat([d.flatten(1) for d in draws.values()], 1), std,
                          "all parameters pooled")


def assert_uncorrelated(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Pearson correlation of two equally shaped draws within Z / sqrt(n) of 0."""
    a, b = a.double().flatten(), b.double().flatten()
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(corr) < Z / math.sqrt(a.numel()), f"{what}: correlation {corr:.4f} over {a.numel()}"
