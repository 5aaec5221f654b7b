"""Toeplitz arithmetic and the optimizers behind ``strategies.bandmf`` and ``strategies.blt``.

    from dpfx.privacy import strategy_fit
    c = strategy_fit.fit_banded(steps=1000, bands=8, separation=1000, participations=1)
    r = strategy_fit.series_inverse(c, 1000)          # C^{-1}'s first column, O(n log n)
    strategy_fit.prefix_error(r, 1000)                 # ||A C^{-1}||_F^2

Everything here works on first columns of lower-triangular Toeplitz matrices (power series
truncated to n terms) in float64, differentiably, and never forms an n x n matrix; see
Note [Toeplitz arithmetic in O(n log n)] in privacy/strategies.py for the maths. The objective is
||A C^{-1}||_F^2 * sens(C)^2, invariant to the scale of C, minimized by L-BFGS with a strong Wolfe
line search from a fixed start: the same inputs give the same strategy.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_F64 = torch.float64


def _product(a: torch.Tensor, b: torch.Tensor, m: int) -> torch.Tensor:
    """The first m coefficients of the power-series product a(x) b(x), by FFT."""
    a, b = a[:m], b[:m]
    size = a.shape[0] + b.shape[0] - 1
    fft = 1 << max(size - 1, 1).bit_length()
    out = torch.fft.irfft(torch.fft.rfft(a, fft) * torch.fft.rfft(b, fft), fft)[:m]
    return F.pad(out, (0, m - out.shape[0]))


def series_inverse(c: torch.Tensor, n: int) -> torch.Tensor:
    """r with c(x) r(x) = 1 mod x^n (C^{-1}'s first column), by Newton's iteration r(2 - c r)."""
    c = F.pad(c[:n], (0, max(n - c.shape[0], 0)))
    r = 1.0 / c[:1]
    m = 1
    while m < n:
        m = min(2 * m, n)
        r = F.pad(r, (0, m - r.shape[0]))
        r = 2 * r - _product(r, _product(c, r, m), m)
    return r


def prefix_error(r: torch.Tensor, n: int) -> torch.Tensor:
    """||A C^{-1}||_F^2 from C^{-1}'s first column r: A C^{-1} is Toeplitz with column cumsum(r)."""
    b = torch.cumsum(r[:n], 0)
    weight = torch.arange(n, 0, -1, dtype=_F64)
    return (weight * b ** 2).sum()


def earliest_pattern_norm2(c: torch.Tensor, separation: int, participations: int) -> torch.Tensor:
    """||C u||^2 for the Toeplitz C with column c and u = 1 at 0, b, .., (k - 1) b, in O(n).

    (C u)_t = sum_{p < k, p b <= t} c_{t - p b}: a cumulative sum down the rows of c reshaped to
    width b, minus itself k rows earlier (as JAX-Privacy's toeplitz.minsep_sensitivity_squared).
    """
    n, b = c.shape[0], separation
    rows = -(-n // b)
    v = F.pad(c, (0, rows * b - n)).reshape(rows, b).cumsum(0).reshape(-1)[:n]
    kb = participations * b
    if kb < n:
        v = torch.cat([v[:kb], v[kb:] - v[:n - kb]])
    return (v ** 2).sum()


def autocorrelation(a: torch.Tensor) -> torch.Tensor:
    """g(l) = sum_s a_s a_{s+l} for l = 0 .. n - 1."""
    n = a.shape[0]
    fft = 1 << (2 * n - 1).bit_length()
    spec = torch.fft.rfft(a, fft)
    return torch.fft.irfft(spec * spec.conj(), fft)[:n]


def _sensitivity2(c: torch.Tensor, n: int, separation: int, participations: int) -> torch.Tensor:
    if participations == 1:
        return (c[:n] ** 2).sum()
    return earliest_pattern_norm2(F.pad(c[:n], (0, max(n - c.shape[0], 0))), separation,
                                  participations)


# Note [One thread while fitting]
# The objective's tensors are small (n x buffers), yet MKL's vectorized exp splits anything over
# 2048 elements across OpenMP threads; on a busy machine each such op then waits for a descheduled
# thread (24 ms instead of 8 us for a 1023 x 4 exp, measured on 2 shared cores). The fit runs on one
# intra-op thread and restores the caller's setting afterwards.
def _minimize(loss, x0: torch.Tensor, max_iter: int) -> torch.Tensor:
    """L-BFGS on loss(x) / loss(x0), deterministic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _lbfgs(loss, x0, max_iter)
    finally:
        torch.set_num_threads(threads)


def _lbfgs(loss, x0: torch.Tensor, max_iter: int) -> torch.Tensor:
    x = x0.clone().requires_grad_(True)
    with torch.no_grad():
        scale = float(loss(x0))
    opt = torch.optim.LBFGS([x], lr=1.0, max_iter=max_iter, history_size=20,
                            tolerance_grad=1e-10, tolerance_change=1e-10,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        value = loss(x) / scale
        value.backward()
        return value

    opt.step(closure)
    return x.detach()


def sqrt_coefficients(k: int) -> torch.Tensor:
    """binom(2j, j) / 4^j for j < k: the power series of (1 - x)^(-1/2)."""
    j = torch.arange(1, k, dtype=_F64)
    return torch.cat([torch.ones(1, dtype=_F64), torch.cumprod((2 * j - 1) / (2 * j), 0)])


def fit_banded(steps: int, bands: int, separation: int, participations: int) -> torch.Tensor:
    """c_0 = 1, c_1 .. c_{bands-1} of the banded Toeplitz C minimizing ||A C^{-1}||_F^2 sens^2.

    Starts from the square root's coefficients (BSR), as JAX-Privacy's optimize_banded_toeplitz.
    With one participation, or bands <= separation, sens^2 is the column norm^2 (times k) whatever
    the signs, and c is free. Otherwise the earliest pattern's sensitivity is the true one only for
    nonnegative, nonincreasing c (``Strategy.sensitivity``), so c is searched there (as sums of
    squared decrements), from the one-participation optimum made nonincreasing.
    """
    one = torch.ones(1, dtype=_F64)

    def free_loss(x):
        c = torch.cat([one, x])
        return prefix_error(series_inverse(c, steps), steps) * _sensitivity2(c, steps, steps, 1)

    start = torch.cat([one, _minimize(free_loss, sqrt_coefficients(bands)[1:], 300)])
    if participations == 1 or bands <= separation:
        return start

    def column(x):                      # c_j = sum_{i >= j} x_i^2: nonnegative, nonincreasing
        return torch.flip(torch.cumsum(torch.flip(x ** 2, [0]), 0), [0])

    def loss(x):
        c = column(x)
        return prefix_error(series_inverse(c, steps), steps) * _sensitivity2(
            c, steps, separation, participations)

    start = torch.cummin(start.clamp(min=0), 0).values
    c = column(_minimize(loss, torch.cat([start[:-1] - start[1:], start[-1:]]).sqrt(), 300))
    return (c / c[0]).detach()


def _blt_columns(x: torch.Tensor, buffers: int, n: int):
    """(r, c, S, v): the first columns of C^{-1} and C (c_0 = 1) for the unconstrained x, with
    S and v = sqrt(w) below (Note [Toeplitz arithmetic in O(n log n)] in strategies.py).

    C^{-1}: h = sigmoid, w = rho * softmax * (1 - h), so sum w / (1 - h) = rho = sigmoid < 1.
    C = 1 / R: c_j = v^T S^{j-1} v with S = diag(h) + v v^T (||S|| < 1), by repeated squaring.
    """
    a = x[:buffers]
    h = torch.sigmoid(a)
    w = torch.sigmoid(x[2 * buffers]) * torch.softmax(x[buffers:2 * buffers], 0) * torch.sigmoid(-a)
    j = torch.arange(n - 1, dtype=_F64)
    one = torch.ones(1, dtype=_F64)
    r = torch.cat([one, -(torch.exp(j[:, None] * F.logsigmoid(a)) @ w)])
    v = w.sqrt()
    s = torch.diag(h) + torch.outer(v, v)
    krylov, power = v[:, None], s                # S^j v for j < m, and S^m
    while krylov.shape[1] < n - 1:
        krylov = torch.cat([krylov, power @ krylov], 1)
        power = power @ power
    c = torch.cat([one, v @ krylov[:, :n - 1]])
    return r, c, s, v


def _blt_start(steps: int, buffers: int) -> torch.Tensor:
    """C^{-1}'s gaps 1 - h spread geometrically from 0.8 to 10 / steps (the range the optima of
    n = 64 .. 10^4 occupy: starting with a gap far below it strands a buffer at h = 1 with no
    weight), equal shares, rho = 0.9."""
    gap = torch.logspace(math.log10(0.8), math.log10(min(0.4, 10.0 / steps)), buffers,
                         dtype=_F64)
    return torch.cat([torch.log((1 - gap) / gap), torch.zeros(buffers, dtype=_F64),
                      torch.tensor([math.log(9.0)], dtype=_F64)])


def fit_blt(steps: int, buffers: int, separation: int,
            participations: int) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """(scale, theta, omega) of the BLT C minimizing ||A C^{-1}||_F^2 sens^2, max column norm 1.

    A buffer whose weight omega_i is below 1e-9 (of c_0 = 1) is dropped: it would hold a state
    vector for nothing. theta is in [0, 1) and omega > 0; no buffer left means C = I.
    """
    def loss(x):
        r, c, _, _ = _blt_columns(x, buffers, steps)
        return prefix_error(r, steps) * _sensitivity2(c, steps, separation, participations)

    x = _minimize(loss, _blt_start(steps, buffers), 300)
    with torch.no_grad():
        _, _, s, v = _blt_columns(x, buffers, steps)
        theta, q = torch.linalg.eigh(s)
        omega = (q.T @ v) ** 2
    keep = omega > 1e-9
    theta, omega = theta[keep].clamp(0.0, math.nextafter(1.0, 0.0)), omega[keep]
    order = torch.argsort(theta, descending=True)
    theta, omega = theta[order], omega[order]
    j = torch.arange(steps - 1, dtype=_F64)
    c = torch.cat([torch.ones(1, dtype=_F64), (theta[None, :] ** j[:, None]) @ omega])
    return 1.0 / float(torch.linalg.vector_norm(c)), tuple(theta.tolist()), tuple(omega.tolist())
