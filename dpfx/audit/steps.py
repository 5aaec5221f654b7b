"""The multi-step canary audit: how far one example moves a run of releases under a noise
mechanism, set against the sensitivity the accountant counts.

    import dpfx.audit
    from dpfx.privacy import strategies
    from dpfx.privacy.matrix_accounting import CyclicPoisson
    result = dpfx.audit.run_steps(model, batches, canary=(x_c, y_c),
                                  mechanism=strategies.bandmf(8, 2), max_grad_norm=1.0,
                                  expected_batch_size=4, sampling=CyclicPoisson(2, 0.25))
    print(result)                       # movement against the bound, verdict

A matrix-factorization mechanism releases X = G + sigma S C^{-1} Z over the run (G: the clipped
sums divided by D, one row per step; C the strategy matrix), and its accountant counts the
Gaussian mechanism C X = C G + sigma S Z, whose sensitivity to one example is
``strategy.sensitivity(b, k)`` times S / D under a (k, b)-min-separation schema (Note
[Min-separation] in privacy/matrix_accounting.py). This audit measures that quantity on dpfx's
own release path: the model compiled with ``noise="optimizer"`` and ``DPOptimizer(mechanism=)``
at sigma 0, the parameters held still (an SGD of learning rate 0, so that every difference comes
from the canary and not from a changed model), the same batches run once without the canary and
once for each place the schema lets it take (every offset o < b: steps o, o + b, ..., at most k
of them). With X' - X the movement (float64, one row per step):

* ``moved``: max over the placements of ||C[:, :t] (X' - X)||_F, the strategy-weighted sum of the
  releases the accountant bounds: at most sensitivity * S / D;
* ``moved_per_step``: the largest ||X'_t - X_t||: at most S / D (one clipped example);
* ``moved_outside``: the largest movement at a step the canary did not join, whose batch is the
  same on both sides: zero.

A tolerance of 1e-4 (relative to S / D) covers float32 rounding and the summation order of the
other examples' clipped gradients. The canary's own gradient must exceed S (it is then clipped
to S exactly, so a missing clip shows). ``mechanism=strategies.gaussian(n)`` audits DP-SGD's
release (``DPOptimizer`` without a mechanism; C = I, sensitivity sqrt(k)).

What it catches: a release that does not clip (``control="no-clip"``: compiled with 1e6 S while
the bound keeps S), and a noise state that reads data, which moves a step the canary did not join
or the weighted sum beyond the bound (tests/audit/test_audit_steps.py plants both). It checks the
sensitivity, not the noise (at sigma 0 there is none): the noise itself is checked by
``DPOptimizer(check_noise_every=)`` and tests/loop/test_correlated_noise.py, and the one-step
audit (``dpfx.audit.run``) measures the leak of a noised step.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from typing import Callable, Sequence

import torch

from dpfx.audit.losses import per_example_loss

TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class StepsAuditResult:
    mechanism: str
    steps: int                  # releases audited (t)
    separation: int             # the schema's b
    participations: int         # the canary's steps in a placement (k, within t)
    max_grad_norm: float
    expected_batch_size: int
    sensitivity: float          # strategy.sensitivity(b, k)
    moved: float                # max over placements of ||C[:, :t] (X' - X)||_F
    bound: float                # sensitivity * S / D
    moved_per_step: float       # max_t ||X'_t - X_t||
    step_bound: float           # S / D
    moved_outside: float        # max movement at a step without the canary
    worst_offset: int           # the placement of ``moved``: steps offset, offset + b, ...
    placements: int
    canary_grad_norm: float     # before clipping (> S)
    control: str | None = None

    @property
    def violations(self) -> list[str]:
        found = []
        if self.moved > self.bound * (1 + TOLERANCE):
            found.append("the strategy-weighted releases moved beyond the sensitivity")
        if self.moved_per_step > self.step_bound * (1 + TOLERANCE):
            found.append("a release moved by more than one clipped example")
        if self.moved_outside > self.step_bound * TOLERANCE:
            found.append("a step the canary did not join moved")
        return found

    @property
    def verdict(self) -> str:
        if self.violations:
            return "VIOLATION: " + "; ".join(self.violations)
        return "consistent: the canary moved the releases within the accounted sensitivity"

    def __str__(self) -> str:
        name = f"control {self.control}" if self.control else "model as configured"
        return "\n".join([
            f"dpfx multi-step audit ({name}): {self.mechanism}, {self.steps} steps, C "
            f"{self.max_grad_norm:g}, D {self.expected_batch_size}, sigma 0",
            f"  canary              in {self.participations} steps {self.separation} apart, "
            f"{self.placements} placements; gradient norm {self.canary_grad_norm:.4g} "
            f"(clipped to C)",
            f"  weighted releases   moved {self.moved:.6g}, bound sensitivity "
            f"{self.sensitivity:.4f} x C/D = {self.bound:.6g} (offset {self.worst_offset})",
            f"  one release         moved {self.moved_per_step:.6g}, bound C/D = "
            f"{self.step_bound:.6g}",
            f"  steps without it    moved {self.moved_outside:.3g}, bound 0",
            f"  verdict             {self.verdict}",
        ])


def run_steps(model: torch.nn.Module, batches: Sequence[tuple], canary: tuple, *, mechanism,
              max_grad_norm: float, expected_batch_size: int, sampling=None,
              control: str | None = None, loss_fn: Callable = per_example_loss,
              threads: int | None = None, **compile_kwargs) -> StepsAuditResult:
    """Audit the releases of ``len(batches)`` steps of ``model`` under ``mechanism`` (a
    ``dpfx.privacy.strategies`` strategy built for at least that many steps), each batch
    (inputs, targets), with ``canary`` = (input, target), one example without the batch dim,
    joining every step of its participation. ``sampling`` is the schema of the accountant
    (``dpfx.privacy.matrix_accounting``: ``CyclicPoisson``, ``MinSeparation``, ``BallsInBins``;
    a ``Plan``'s ``sampling``); by default participations ``strategy.bands`` apart, as many as
    fit. ``loss_fn(out, y)`` returns per-example losses (``dpfx.audit.per_example_loss``); their
    mean is backwarded with ``expected_batch_size`` D. ``compile_kwargs`` go to
    ``dpfx.compile`` (``backend``, ``strategy``); ``threads`` as in ``dpfx.audit.run``.
    ``model`` is not modified."""
    if threads is None:
        return _run(model, batches, canary, mechanism, max_grad_norm, expected_batch_size,
                    sampling, control, loss_fn, compile_kwargs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(model, batches, canary, mechanism, max_grad_norm, expected_batch_size,
                    sampling, control, loss_fn, compile_kwargs)
    finally:
        torch.set_num_threads(before)


def _run(model, batches, canary, mechanism, clip, divisor, sampling, control, loss_fn,
         compile_kwargs) -> StepsAuditResult:
    from dpfx.api import compile as dp_compile
    from dpfx.loop.optim import DPOptimizer

    t = len(batches)
    _check(mechanism, t, divisor, control, compile_kwargs)
    b, k = _schema(mechanism, sampling, t)
    compiled_clip = clip * 1e6 if control == "no-clip" else clip
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    canary_norm = _grad_norm(model, params, canary, loss_fn)
    if not canary_norm > clip:
        raise ValueError(f"the canary's gradient norm is {canary_norm:.4g}, within "
                         f"max_grad_norm={clip:g}: a missing clip could not show. Pick a canary "
                         f"the model gets badly wrong (an input scaled up)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # sigma 0 is the point here (NoNoiseWarning)
        dp = dp_compile(model, max_grad_norm=compiled_clip, noise_multiplier=0.0,
                        noise="optimizer", expected_batch_size=divisor, **compile_kwargs)
    state = None if mechanism.name == "gaussian" else mechanism

    def releases(steps_in: set[int]) -> torch.Tensor:
        """(t, P): every step's release, the canary joining ``steps_in``."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = DPOptimizer(torch.optim.SGD(params, lr=0.0), dp, mechanism=state)
        out = []
        for s, (x, y) in enumerate(batches):
            if s in steps_in:
                x, y = torch.cat([x, canary[0].unsqueeze(0)]), torch.cat([y, canary[1].unsqueeze(0)])
            opt.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss_fn(dp(x), y).mean().backward()
                opt.step()
            out.append(torch.cat([_grad(p).flatten() for p in params]))
        return torch.stack(out).to(torch.float64)

    c = mechanism.matrix()[:, :t].to(torch.float64)
    without = releases(set())
    worst = (-1.0, 0)
    per_step = outside = 0.0
    placements = range(min(b, t))
    for offset in placements:
        steps_in = set(range(offset, t, b)[:k])
        moved = releases(steps_in) - without
        norms = moved.norm(dim=1)
        weighted = float(torch.linalg.matrix_norm(c @ moved))
        worst = max(worst, (weighted, offset))
        per_step = max(per_step, float(norms.max()))
        rest = [s for s in range(t) if s not in steps_in]
        if rest:
            outside = max(outside, float(norms[rest].max()))
    k_t = min(k, math.ceil(t / b))
    sens = float(mechanism.sensitivity(b, k_t))
    return StepsAuditResult(
        mechanism=mechanism.name, steps=t, separation=b, participations=k_t,
        max_grad_norm=clip, expected_batch_size=divisor, sensitivity=sens, moved=worst[0],
        bound=sens * clip / divisor, moved_per_step=per_step, step_bound=clip / divisor,
        moved_outside=outside, worst_offset=worst[1], placements=len(placements),
        canary_grad_norm=canary_norm, control=control)


def _check(mechanism, t, divisor, control, compile_kwargs) -> None:
    missing = [a for a in ("name", "steps", "matrix", "sensitivity") if not hasattr(mechanism, a)]
    if missing:
        raise TypeError(f"mechanism must be a strategy of dpfx.privacy.strategies (a Plan's "
                        f".strategy), got {type(mechanism).__name__}")
    if not 1 <= t <= mechanism.steps:
        raise ValueError(f"batches: the '{mechanism.name}' strategy has {mechanism.steps} steps, "
                         f"and {t} batches were given: audit 1 .. {mechanism.steps} steps")
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"expected_batch_size must be a positive int (D), got {divisor!r}")
    if control not in (None, "no-clip"):
        raise ValueError(f"control must be None or 'no-clip' (the audit runs at sigma 0, so a "
                         f"'sigma/K' control has nothing to find), got {control!r}")
    taken = {"noise", "noise_multiplier", "loss_reduction", "max_grad_norm",
             "expected_batch_size"} & set(compile_kwargs)
    if taken:
        raise ValueError(f"the multi-step audit compiles with noise='optimizer', sigma 0 and "
                         f"loss_reduction='mean' over D itself: drop {', '.join(sorted(taken))}")


def _schema(mechanism, sampling, t) -> tuple[int, int]:
    """(separation b, participations k) of the accountant's schema for this strategy."""
    from dpfx.privacy import matrix_accounting as ma
    n = mechanism.steps
    if sampling is None:
        b = min(int(mechanism.bands), n)
        return b, math.ceil(n / b)
    if isinstance(sampling, ma.CyclicPoisson):
        return sampling.parts, math.ceil(n / sampling.parts)
    if isinstance(sampling, ma.MinSeparation):
        return sampling.separation, sampling.participations
    if isinstance(sampling, ma.BallsInBins):
        return 1, math.ceil(n / sampling.steps_per_epoch)
    raise TypeError(f"sampling must be a CyclicPoisson, MinSeparation or BallsInBins of "
                    f"dpfx.privacy.matrix_accounting (a Plan's .sampling), got "
                    f"{type(sampling).__name__}")


def _grad(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:
        raise RuntimeError("a parameter has no released gradient after DPOptimizer.step(); the "
                           "audit reads every trainable parameter's release")
    return p.grad.detach()


def _grad_norm(model, params, canary, loss_fn) -> float:
    x, y = canary
    loss = loss_fn(model(x.unsqueeze(0)), y.unsqueeze(0)).sum()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return math.sqrt(sum(float(g.pow(2).sum()) for g in grads if g is not None))
