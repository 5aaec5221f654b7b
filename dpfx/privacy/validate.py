"""The validators of dpfx's options: each names the option, says what it is, and returns the
value in its canonical type, or raises ``OptionValueError``.

    from dpfx.privacy import validate
    q = validate.sample_rate(256 / 60000)                  # 0.004266...
    validate.noise_multiplier(-1.0)        # OptionValueError: noise_multiplier must be ...
    validate.bound(0.0, "max_grad_norm")   # OptionValueError: ... the clipping bound C

Every entry point (``dpfx.compile``, ``make_private``, ``DPTrainer``, ``DPOptimizer``,
``dpfx.opacus``), the privacy plan, the accountants and the loaders call these, so that one bad
value is refused with one error type and one message wherever it is given (JAX-Privacy keeps
its checks in one module the same way). ``dpfx.OptionValueError`` is a ``ValueError``: code that
caught ``ValueError`` before catches it still.
"""
from __future__ import annotations

import math
import numbers

from dpfx.errors import OptionValueError

ACCOUNTANTS = ("pld", "rdp")


def is_number(x) -> bool:
    """A real number that is not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def finite_number(x) -> bool:
    return is_number(x) and math.isfinite(x)


def noise_multiplier(sigma, name: str = "noise_multiplier") -> float:
    if not finite_number(sigma) or sigma < 0:
        raise OptionValueError(
            f"{name} must be a finite number >= 0 (sigma: noise std / clipping bound; 0 means no "
            f"noise and epsilon = inf), got {sigma!r}")
    return float(sigma)


def sample_rate(q, name: str = "sample_rate") -> float:
    if not is_number(q) or math.isnan(q) or not 0 < q <= 1:
        raise OptionValueError(
            f"{name} must be in (0, 1] (the Poisson sampling probability q = expected batch "
            f"size / dataset size), got {q!r}")
    return float(q)


def steps(n, name: str = "steps") -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise OptionValueError(f"{name} must be an int >= 0 (number of noisy steps), got {n!r}")
    return int(n)


def integer(n, name: str, minimum: int) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < minimum:
        raise OptionValueError(f"{name} must be an int >= {minimum}, got {n!r}")
    return int(n)


def delta(d, name: str = "delta") -> float:
    if not is_number(d) or math.isnan(d) or not 0 < d < 1:
        raise OptionValueError(
            f"{name} must be in (0, 1) (typically < 1/dataset size), got {d!r}")
    return float(d)


def accountant(name) -> str:
    if name not in ACCOUNTANTS:
        raise OptionValueError(f"accountant must be one of {ACCOUNTANTS}, got {name!r}")
    return name


def target_epsilon(eps) -> float:
    if not finite_number(eps) or eps <= 0:
        raise OptionValueError(f"target_epsilon must be a finite number > 0, got {eps!r}")
    return float(eps)


def tolerance(tol) -> float:
    if not is_number(tol) or not 0 < tol < 0.5:
        raise OptionValueError(f"tolerance must be in (0, 0.5) (relative, on sigma), got "
                               f"{tol!r}")
    return float(tol)


def bracket(pair) -> tuple[float, float]:
    try:
        lo, hi = pair
    except (TypeError, ValueError):
        raise OptionValueError(f"bracket must be a pair (low, high) of sigmas, got "
                               f"{pair!r}") from None
    if not (is_number(lo) and is_number(hi) and 0 < lo < hi < math.inf):
        raise OptionValueError(f"bracket must satisfy 0 < low < high < inf, got {pair!r}")
    return float(lo), float(hi)


def bound(c, name: str = "max_grad_norm") -> float:
    """A clipping bound C."""
    if not is_number(c):
        raise OptionValueError(f"{name} must be a positive number, got {c!r}")
    if not (math.isfinite(c) and c > 0):
        raise OptionValueError(f"{name} must be finite and > 0 (it is the clipping bound C), "
                               f"got {c!r}")
    return float(c)


def choice(value, choices: tuple, name: str):
    """One of ``choices``."""
    if value not in choices:
        raise OptionValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def secure_sampling(secure_mode: bool, generator) -> None:
    """``secure_mode`` draws the batches from the OS's CSPRNG: a seeded ``generator`` beside it
    would make them replayable."""
    if secure_mode and generator is not None:
        raise OptionValueError("secure_mode samples batches from the OS's CSPRNG; a generator "
                               "would make them replayable (Note [Secure sampling] in "
                               "loop/data.py)")
