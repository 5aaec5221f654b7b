"""The one-step white-box canary audit: an empirical lower bound on the epsilon of your own model
and settings, set against the epsilon dpfx accounts for.

    import dpfx.audit
    result = dpfx.audit.run(model, (x, y), canary=(x_c, y_c), max_grad_norm=1.0,
                            noise_multiplier=1.0, trials=4000)
    print(result)                       # accounted eps, empirical lower bound, verdict

Over a run of releases under a noise mechanism (correlated noise included), ``run_steps``
checks at sigma 0 that one canary example moves the strategy-weighted releases by at most the
sensitivity the accountant counts (dpfx/audit/steps.py):

    result = dpfx.audit.run_steps(model, batches, canary=(x_c, y_c), mechanism=strategy,
                                  max_grad_norm=1.0, expected_batch_size=8, sampling=schema)

or from a shell, on a built-in model with a deliberately broken control beside it:

    python -m dpfx.audit --model mlp --trials 4000 --control sigma/10

Design (Jagielski et al. 2020, "Auditing Differentially Private Machine Learning"; Nasr et al.
2021 and 2023 for the white-box, gradient-canary setting). Two neighbouring batches, D and
D' = D + canary (add-one, dp_accounting's relation). dpfx's compiled private step runs many
times on each, the same compiled module each time, fresh noise each step. The attacker knows
the model and the canary, so it knows the canary's gradient g_c; its statistic is the released
gradient projected on g_c's direction. A threshold (and which side means "canary in") is
chosen on the first half of the trials; on the second half the false positive and false
negative rates get one-sided Clopper-Pearson upper bounds (each at (1 - confidence) / 2, so
both hold together with the stated confidence), and any (eps, delta)-DP mechanism must satisfy
FPR + e^eps FNR >= 1 - delta and FNR + e^eps FPR >= 1 - delta, so

    eps_lb = max(log((1 - delta - FNR_up) / FPR_up), log((1 - delta - FPR_up) / FNR_up))

is a lower bound on the true epsilon with that confidence. The accounted epsilon is
dp_accounting's for one Poisson-sampled Gaussian step (``dpfx.privacy.epsilon``, steps=1). With
``sample_rate`` q < 1 the canary joins D' in each trial with probability q (the batch D is the
rest of a Poisson batch, held fixed).

At the user level the unit is a user: ``run(dpfx.per_user(model), (x, y), canary=(x_c, y_c),
loss_fn=per_user_loss, ...)`` with x (users, k, ...), y (users, k), and a canary user of k
examples, x_c (k, ...), y_c (k,); its k examples are clipped together, to C.

A correct implementation gives eps_lb <= eps_accounted (the verdict "consistent"); a lower bound
above it proves the mechanism leaks more than accounted. A lower bound is not a proof of
privacy: one step, one canary, one statistic; it catches implementation bugs (a missed clip,
noise too small, an example counted twice), not all of them. ``control`` runs the same audit on
a deliberately broken mechanism while the accountant keeps the claimed settings: "sigma/K"
(noise_multiplier divided by K) or "no-clip" (clipping bound 1e6 C, noise still sigma C): the
audit must find it, eps_lb > eps_accounted (tests/audit/test_audit.py).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
import warnings
from typing import Callable

import numpy as np
import torch

from dpfx import privacy
from dpfx.privacy import validate
from dpfx.api import compile as dp_compile
from dpfx.audit.losses import per_example_loss, per_user_loss  # noqa: F401  (public)
from dpfx.audit.steps import StepsAuditResult, run_steps  # noqa: F401  (the multi-step audit)


@dataclasses.dataclass(frozen=True)
class AuditResult:
    eps_accounted: float
    eps_lower_bound: float
    confidence: float
    delta: float
    trials: int                 # per side (D and D'), half of them held out for the threshold
    fpr: float                  # on the evaluation half
    fnr: float
    fpr_upper: float
    fnr_upper: float
    threshold: float
    canary_in_above: bool       # the test says "canary in" when the statistic is above
    trials_per_second: float
    noise_multiplier: float     # claimed (accounted)
    max_grad_norm: float
    sample_rate: float
    control: str | None = None  # the deliberate breakage, if this was a control run

    @property
    def verdict(self) -> str:
        if self.eps_lower_bound > self.eps_accounted:
            return "VIOLATION: the mechanism leaks more than accounted"
        return "consistent: no leak beyond the accounted epsilon found"

    def __str__(self) -> str:
        name = f"control {self.control}" if self.control else "model as configured"
        side = ">" if self.canary_in_above else "<"
        return "\n".join([
            f"dpfx audit ({name}): sigma {self.noise_multiplier:g}, C {self.max_grad_norm:g}, "
            f"q {self.sample_rate:g}, delta {self.delta:g}",
            f"  trials              {self.trials} per side (half for the threshold), "
            f"{self.trials_per_second:.0f} steps/s",
            f"  test                canary in if <release, g_c/|g_c|> {side} {self.threshold:.4g}",
            f"  FPR / FNR           {self.fpr:.4f} / {self.fnr:.4f}  (upper "
            f"{self.fpr_upper:.4f} / {self.fnr_upper:.4f})",
            f"  accounted epsilon   {self.eps_accounted:.3f}",
            f"  empirical epsilon   >= {self.eps_lower_bound:.3f} with confidence "
            f"{self.confidence:g}",
            f"  verdict             {self.verdict}",
        ])


def run(model: torch.nn.Module, batch: tuple, canary: tuple, *, max_grad_norm: float,
        noise_multiplier: float, trials: int = 4000, delta: float = 1e-5,
        sample_rate: float = 1.0, confidence: float = 0.95, control: str | None = None,
        loss_fn: Callable = per_example_loss, seed: int | None = None,
        threads: int | None = None, **compile_kwargs) -> AuditResult:
    """Audit one private step of ``model`` on ``batch`` = (inputs, targets) (D; may be empty)
    with ``canary`` = (input, target), one example without the batch dim. ``loss_fn(out, y)``
    returns per-example losses; their sum is backwarded (loss_reduction="sum"). ``seed`` makes the
    noise and the canary's sampling reproducible (tests); ``compile_kwargs`` go to
    ``dpfx.compile`` (``backend="eager"`` for speed, ``strategy``). ``threads`` sets torch's
    intra-op threads for the audit only: 1 is fastest for small models on a busy machine (idle
    OpenMP threads spin: on cores shared with other jobs, two threads can take fifty times one
    thread's step). ``model`` is not modified."""
    if threads is None:
        return _run(model, batch, canary, max_grad_norm, noise_multiplier, trials, delta,
                    sample_rate, confidence, control, loss_fn, seed, compile_kwargs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(model, batch, canary, max_grad_norm, noise_multiplier, trials, delta,
                    sample_rate, confidence, control, loss_fn, seed, compile_kwargs)
    finally:
        torch.set_num_threads(before)


def _run(model, batch, canary, max_grad_norm, noise_multiplier, trials, delta, sample_rate,
         confidence, control, loss_fn, seed, compile_kwargs) -> AuditResult:
    if trials < 100:
        raise ValueError(f"trials must be at least 100 per side, got {trials}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if compile_kwargs.get("noise", "graph") != "graph" or "loss_reduction" in compile_kwargs:
        raise ValueError("the audit reads p.grad after one backward: it compiles with "
                         "noise='graph' and loss_reduction='sum' itself")
    validate.sample_rate(sample_rate)
    clip, sigma = _mechanism(control, max_grad_norm, noise_multiplier)
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    direction = _canary_direction(model, params, canary, loss_fn)

    x, y = batch
    x_in = torch.cat([x, canary[0].unsqueeze(0)])
    y_in = torch.cat([y, canary[1].unsqueeze(0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # a fixed seed is for tests, as here
        dp = dp_compile(model, max_grad_norm=clip, noise_multiplier=sigma, loss_reduction="sum",
                        seed=seed, **compile_kwargs)
    rng = np.random.default_rng(seed)

    def statistic(xs, ys) -> float:
        loss_fn(dp(xs), ys).sum().backward()
        s = sum(float((p.grad * d).sum()) for p, d in zip(params, direction))
        for p in params:
            p.grad = None
        return s

    statistic(x_in, y_in)               # compile outside the timing
    start = time.perf_counter()
    without = np.array([statistic(x, y) for _ in range(trials)])
    with_canary = np.array([statistic(x_in, y_in) if rng.random() < sample_rate
                            else statistic(x, y) for _ in range(trials)])
    rate = 2 * trials / (time.perf_counter() - start)

    half = trials // 2
    above, threshold = _choose_test(without[:half], with_canary[:half], delta, confidence)
    sign = 1.0 if above else -1.0
    false_pos = int(np.sum(sign * without[half:] > sign * threshold))
    false_neg = int(np.sum(sign * with_canary[half:] <= sign * threshold))
    n = trials - half
    alpha = (1 - confidence) / 2
    fpr_up, fnr_up = cp_upper(false_pos, n, alpha), cp_upper(false_neg, n, alpha)
    return AuditResult(
        eps_accounted=privacy.epsilon(noise_multiplier=noise_multiplier, sample_rate=sample_rate,
                                      steps=1, delta=delta),
        eps_lower_bound=eps_lower_bound(fpr_up, fnr_up, delta), confidence=confidence,
        delta=delta, trials=trials, fpr=false_pos / n, fnr=false_neg / n, fpr_upper=fpr_up,
        fnr_upper=fnr_up, threshold=threshold, canary_in_above=above, trials_per_second=rate,
        noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, sample_rate=sample_rate,
        control=control)


def _mechanism(control: str | None, clip: float, sigma: float) -> tuple[float, float]:
    """The (C, sigma) actually compiled: the claimed ones, or a deliberately broken pair."""
    if control is None:
        return clip, sigma
    if control == "no-clip":            # clipping bound 1e6 C, the noise std still sigma * C
        return clip * 1e6, sigma / 1e6
    if control.startswith("sigma/"):
        return clip, sigma / float(control[len("sigma/"):])
    raise ValueError(f"control must be None, 'no-clip' or 'sigma/K', got {control!r}")


def _canary_direction(model, params, canary, loss_fn) -> list[torch.Tensor]:
    """The white-box attacker's direction: the canary's gradient, normalized (clipping scales
    it, it does not turn it)."""
    x, y = canary
    loss = loss_fn(model(x.unsqueeze(0)), y.unsqueeze(0)).sum()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params)]
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
    if not norm > 0:
        raise ValueError("the canary's gradient is zero: pick a canary the model gets wrong")
    return [g / norm for g in grads]


def eps_lower_bound(fpr_upper: float, fnr_upper: float, delta: float) -> float:
    """max over the two DP inequalities of log((1 - delta - one rate) / other rate), floored at 0."""
    best = 0.0
    for a, b in ((fnr_upper, fpr_upper), (fpr_upper, fnr_upper)):
        if 1 - delta - a > 0 and b > 0:
            best = max(best, math.log((1 - delta - a) / b))
    return best


def _choose_test(without: np.ndarray, with_canary: np.ndarray, delta: float,
                 confidence: float) -> tuple[bool, float]:
    """(canary_in_above, threshold) with the best lower bound on the held-out trials."""
    alpha = (1 - confidence) / 2
    cands = np.unique(np.quantile(np.concatenate([without, with_canary]),
                                  np.linspace(0, 1, 401)))
    a, b = np.sort(without), np.sort(with_canary)
    best = (-1.0, True, float(cands[0]))
    for above in (True, False):
        for t in cands:
            below_a = np.searchsorted(a, t, side="right")
            below_b = np.searchsorted(b, t, side="right")
            fp, fn = (len(a) - below_a, below_b) if above else (below_a, len(b) - below_b)
            eps = eps_lower_bound(cp_upper(int(fp), len(a), alpha),
                                  cp_upper(int(fn), len(b), alpha), delta)
            if eps > best[0]:
                best = (eps, above, float(t))
    return best[1], best[2]


def cp_upper(k: int, n: int, alpha: float) -> float:
    """One-sided Clopper-Pearson upper bound on a rate from k events in n trials: the p with
    P(Binomial(n, p) <= k) = alpha (1 when k = n)."""
    if k >= n:
        return 1.0
    try:
        from scipy.stats import beta
        return float(beta.ppf(1 - alpha, k + 1, n - k))
    except ImportError:
        lo, hi = k / n, 1.0
        for _ in range(60):             # bisection on the binomial tail, without scipy
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _binom_cdf(k, n, mid) > alpha else (lo, mid)
        return hi


def _binom_cdf(k: int, n: int, p: float) -> float:
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
            + i * math.log(p) + (n - i) * math.log1p(-p) for i in range(k + 1)]
    top = max(logs)
    return math.exp(top) * sum(math.exp(v - top) for v in logs)

