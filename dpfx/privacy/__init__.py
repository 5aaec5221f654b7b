"""Privacy accounting for DP-SGD: epsilon of a run, noise calibration, and a running ledger.

    from dpfx.privacy import Accountant, epsilon, noise_multiplier

    q = 256 / 60000                                   # Poisson sample rate: E[batch] / N
    epsilon(noise_multiplier=1.1, sample_rate=q, steps=2340, delta=1e-5)        # ~0.918
    epsilon(noise_multiplier=1.1, sample_rate=q, steps=2340, delta=1e-5,
            accountant="rdp")                                                    # ~1.098
    sigma = noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=q, steps=2340)

    acc = Accountant()                    # one per training run
    acc.step(noise_multiplier=sigma, sample_rate=q)      # after every optimizer step
    acc.get_epsilon(1e-5)
    torch.save({"model": ..., "accountant": acc.state_dict()}, path)   # plain, JSON-able data

# Note [Nothing here is written by hand]
Every epsilon comes from Google's ``dp_accounting`` package: one DP-SGD step is the event
``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))`` (the Poisson-subsampled Gaussian
mechanism with sensitivity 1, since the noise std is sigma * C for clipping bound C), ``steps``
of them are ``SelfComposedDpEvent``, and training phases with different (sigma, q) are a
``ComposedDpEvent``. The neighbouring relation is dp_accounting's default, add-or-remove-one,
which is the one Poisson sampling's analysis uses. Two accountants:

* ``"rdp"``: Renyi DP (Mironov 2017, "Renyi Differential Privacy"; the subsampled Gaussian's RDP
  is Mironov, Talwar & Zhang 2019), converted to (epsilon, delta). Fast (~25 ms whatever
  ``steps`` is), and looser.
* ``"pld"`` (default): privacy loss distributions composed by FFT (Koskela, Jalko & Honkela 2020;
  Doroshenko et al. 2022, "Connect the Dots"). Tight, and its rounding is pessimistic, so a
  coarser grid only ever overstates epsilon.

# Note [PLD grid]
The PLD accountant's cost and accuracy are set by ``value_discretization_interval`` (the grid step
of the privacy loss). One fixed step is wrong at both ends: dp_accounting's default 1e-4 takes
0.4 s for the MNIST example above but 5 s at sigma=0.3, 27 s at sigma=0.1, and at sigma=0.01,
q=0.5, 1e5 steps it asks for an 80 GB array. The grid therefore follows the size of epsilon,
read from a cheap RDP pass over the same event (``pld_discretization_interval``)::

    step = 1e-4 * sqrt(max(1, eps_rdp))

which is the default 1e-4 for eps <= 1 and 3e-3 at eps = 1000. Measured against a 4x finer grid
over q in [1e-4, 0.99], steps in [1e3, 1e6] and eps in [3, 1000] the relative error stayed below
1.2e-3 (below 6e-4 in most cells) and every call took under 1.2 s; the one exception was
q=1e-4 with 1e6 steps at eps ~2, 1% off at a step of 1.7e-4, near the default (measurements on
2 shared CPU cores, dp_accounting 0.6.0). Above ``PLD_MAX_EPSILON`` (eps_rdp >
1000, no meaningful privacy) the PLD grid still explodes, so the RDP bound is returned instead;
it is also returned if the PLD numerics overflow to inf/nan while RDP is finite. Both are valid
upper bounds on epsilon, so this never understates the privacy loss.

# Note [sigma = 0]
``noise_multiplier=0`` is accepted (``dpfx.compile`` accepts it for non-private debugging) and
its epsilon is ``math.inf``: no noise, no privacy. It is not an error so that an ``Accountant``
can record such steps honestly.
"""
from __future__ import annotations

import logging
import math

import dp_accounting
from dp_accounting import pld as _pld
from dp_accounting import rdp as _rdp

from dpfx.errors import OptionValueError
from dpfx.privacy import validate


# Note [RDP orders that do not converge]
# dp-accounting's RDP series for a fractional order alpha (``_compute_log_a_frac``) can fail to
# converge at large sample rates; it then drops that order from the minimum over orders (the
# epsilon stays a valid upper bound, from the remaining orders) and logs a warning through absl.
# A calibration evaluates dozens of sigmas, so ``make example`` printed 28 such lines about
# nothing the user can act on. This filter drops exactly those records on absl's logger; every
# other absl message, warnings and errors alike, still reaches the user.
# (tests/privacy/test_privacy.py::test_calibration_is_quiet)
class _UnconvergedOrderFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("failed to converge" in message and "Excluding this order" in message)


logging.getLogger("absl").addFilter(_UnconvergedOrderFilter())

__all__ = ["Accountant", "epsilon", "noise_multiplier", "calibrate", "dp_event", "event_epsilon",
           "make_accountant", "pld_discretization_interval", "ACCOUNTANTS"]

ACCOUNTANTS = validate.ACCOUNTANTS

# See Note [PLD grid].
PLD_BASE_DISCRETIZATION = 1e-4
PLD_MAX_EPSILON = 1e3

# Default search range of ``noise_multiplier`` and its relative tolerance.
SIGMA_BRACKET = (1e-2, 1e4)
SIGMA_TOLERANCE = 1e-3


# ------------------------------------------------------------------------------------------------
# Events and accountants.

def dp_event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_accounting.DpEvent:
    """The dp_accounting event of ``steps`` DP-SGD steps with Poisson rate q and noise sigma."""
    sigma = validate.noise_multiplier(noise_multiplier)
    q = validate.sample_rate(sample_rate)
    steps = validate.steps(steps)
    if steps == 0:
        return dp_accounting.NoOpDpEvent()   # SelfComposedDpEvent rejects count=0
    step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    return dp_accounting.SelfComposedDpEvent(step, steps)


def _rdp_epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
    return _rdp.RdpAccountant().compose(event).get_epsilon(delta)


def pld_discretization_interval(rdp_epsilon: float) -> float:
    """The PLD grid step for an event whose RDP epsilon is ``rdp_epsilon`` (Note [PLD grid])."""
    return PLD_BASE_DISCRETIZATION * math.sqrt(max(1.0, rdp_epsilon))


def _pld_epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
    """``_pld_epsilon_uncached``, memoized (calibration revisits points, and a run asks the
    epsilon of the same phases again at every log and checkpoint)."""
    key = _event_key(event)
    if key is None:
        return _pld_epsilon_uncached(event, delta)
    key = (key, delta)
    if key not in _PLD_CACHE:
        if len(_PLD_CACHE) >= 256:
            _PLD_CACHE.pop(next(iter(_PLD_CACHE)))      # the oldest entry
        _PLD_CACHE[key] = _pld_epsilon_uncached(event, delta)
    return _PLD_CACHE[key]


_PLD_CACHE: dict = {}


def _event_key(event: dp_accounting.DpEvent):
    """A hashable stand-in for ``event``: dp_accounting's events are frozen dataclasses, but a
    ``ComposedDpEvent`` holds a list. None for an event of another form (left uncached)."""
    if isinstance(event, dp_accounting.ComposedDpEvent):
        parts = tuple(_event_key(e) for e in event.events)
        return None if None in parts else ("composed", parts)
    try:
        hash(event)
    except TypeError:
        return None
    return event


def _pld_epsilon_uncached(event: dp_accounting.DpEvent, delta: float) -> float:
    """PLD epsilon on the adaptive grid, or the RDP bound where PLD is useless (Note [PLD grid])."""
    eps_rdp = _rdp_epsilon(event, delta)
    if not eps_rdp <= PLD_MAX_EPSILON:          # also inf (sigma = 0) and nan
        return eps_rdp
    interval = pld_discretization_interval(eps_rdp)
    try:
        eps = _pld.PLDAccountant(value_discretization_interval=interval).compose(event) \
            .get_epsilon(delta)
    except (OverflowError, FloatingPointError):
        return eps_rdp
    return float(eps) if math.isfinite(eps) else eps_rdp



class _AdaptivePLDAccountant(dp_accounting.PrivacyAccountant):
    """dp_accounting's PLD accountant with the grid of Note [PLD grid], chosen per ``get_epsilon``.

    Being a ``PrivacyAccountant`` lets ``dp_accounting.calibrate_dp_mechanism`` drive it.
    """

    def __init__(self):
        super().__init__(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)

    def _maybe_compose(self, event, count, do_compose):
        # Support is decided by the PLD accountant; the event itself is kept in the ledger.
        return _pld.PLDAccountant()._maybe_compose(event, count, False)

    def get_epsilon(self, target_delta: float) -> float:
        return _pld_epsilon(self.ledger, target_delta)


def make_accountant(name: str) -> dp_accounting.PrivacyAccountant:
    return _AdaptivePLDAccountant() if name == "pld" else _rdp.RdpAccountant()


def event_epsilon(event: dp_accounting.DpEvent, delta: float, accountant: str) -> float:
    return float(make_accountant(accountant).compose(event).get_epsilon(delta))


# ------------------------------------------------------------------------------------------------
# Public functions.

def epsilon(*, noise_multiplier: float, sample_rate: float, steps: int, delta: float,
            accountant: str = "pld") -> float:
    """Epsilon after ``steps`` DP-SGD steps at noise ``noise_multiplier`` and Poisson rate q.

    Returns ``math.inf`` for ``noise_multiplier=0`` and 0.0 for ``steps=0``.
    """
    event = dp_event(noise_multiplier, sample_rate, steps)
    return event_epsilon(event, validate.delta(delta), validate.accountant(accountant))


def noise_multiplier(*, target_epsilon: float, target_delta: float, sample_rate: float,
                     steps: int, accountant: str = "pld", tolerance: float = SIGMA_TOLERANCE,
                     bracket: tuple[float, float] = SIGMA_BRACKET, spent=()) -> float:
    """The smallest sigma in ``bracket`` whose epsilon is <= ``target_epsilon``.

    The answer s satisfies epsilon(s) <= target_epsilon and lies within ``tolerance * s`` above
    the exact smallest sigma (a relative tolerance). A doubling/halving search from sigma = 1
    narrows ``bracket`` to [s, 2s] (at most log2 of its width evaluations), then
    ``dp_accounting.calibrate_dp_mechanism`` (Brent's method, bounded) finishes.
    ``spent``: steps already taken, as phases (noise_multiplier, sample_rate, steps) (an
    ``Accountant``'s ``history``); sigma is then the noise of the ``steps`` further steps such
    that all of them composed end at or below ``target_epsilon`` (Note [Calibrating the steps
    that remain]).
    Raises ValueError when no sigma in ``bracket`` reaches the target (also when ``spent``
    alone reaches it), or when its lower end already does (widen ``bracket``).
    """
    target_epsilon = validate.target_epsilon(target_epsilon)
    target_delta = validate.delta(target_delta, "target_delta")
    q = validate.sample_rate(sample_rate)
    steps = validate.steps(steps)
    if steps == 0:
        raise OptionValueError("steps must be >= 1 to calibrate noise_multiplier (0 steps spend "
                               "no privacy at any sigma)")
    accountant = validate.accountant(accountant)
    before = _spent_events(spent)
    if before:
        eps_spent = event_epsilon(_composed(before), target_delta, accountant)
        if eps_spent >= target_epsilon:
            taken = sum(phase[2] for phase in spent)
            raise ValueError(
                f"target_epsilon={target_epsilon} is spent already: the {taken} steps taken "
                f"are at epsilon {eps_spent:.6g} (delta {target_delta:g}), so no noise leaves "
                f"room for {steps} more; raise target_epsilon or take no further steps")

    def event(sigma: float) -> dp_accounting.DpEvent:
        return _composed(before + [dp_event(sigma, q, steps)])

    return calibrate(event, target_epsilon=target_epsilon, target_delta=target_delta,
                     accountant=accountant, tolerance=tolerance, bracket=bracket)


def calibrate(event, *, target_epsilon: float, target_delta: float, accountant: str = "pld",
              tolerance: float = SIGMA_TOLERANCE,
              bracket: tuple[float, float] = SIGMA_BRACKET) -> float:
    """The smallest sigma in ``bracket`` (within ``tolerance * sigma``) at which the
    dp_accounting event ``event(sigma)`` has epsilon <= ``target_epsilon`` at
    ``target_delta``: the search of ``noise_multiplier`` and of the correlated mechanisms'
    ``matrix_accounting.matrix_noise_multiplier``."""
    target_epsilon = validate.target_epsilon(target_epsilon)
    target_delta = validate.delta(target_delta, "target_delta")
    accountant = validate.accountant(accountant)
    tolerance = validate.tolerance(tolerance)
    lo, hi = validate.bracket(bracket)
    lo, hi = _narrow_bracket(lambda s: event_epsilon(event(s), target_delta, accountant),
                             target_epsilon, lo, hi)
    sigma = dp_accounting.calibrate_dp_mechanism(
        lambda: make_accountant(accountant), event, target_epsilon, target_delta,
        bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi), tol=tolerance * lo)
    return float(sigma)


# Note [Calibrating the steps that remain]
# A run that continues after steps already taken (a resumed run with a longer plan) must end at
# or below its target with every step counted at the noise it was taken with. The steps left are
# calibrated as one more phase composed after the spent ones (``ComposedDpEvent``, as the
# ``Accountant`` records the run), so the search finds the smallest sigma of the remaining phase
# whose composition with the spent phases reaches the target. Recalibrating the whole plan from
# scratch instead (what a restarted run did) gives the later steps a sigma meant for steps that
# all share it, and a resumed run of 4 + 4 steps planned as 8 ended at 4.45 against a target of
# 4.0. (tests/hf/test_trainer_budget.py)
def _spent_events(spent) -> list:
    events = []
    for phase in spent:
        try:
            sigma, q, n = phase
        except (TypeError, ValueError):
            raise ValueError(f"spent must hold phases (noise_multiplier, sample_rate, steps), "
                             f"got {phase!r}") from None
        n = validate.steps(n, "spent steps")
        if n:
            events.append(dp_event(sigma, q, n))
    return events


def _composed(events: list) -> dp_accounting.DpEvent:
    return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)


def _narrow_bracket(eps_at, target: float, lo: float, hi: float) -> tuple[float, float]:
    """[a, b] within [lo, hi], b <= 2a, with eps_at(a) > target >= eps_at(b); else ValueError.

    Walks from sigma = 1 (clamped into the bracket) by factors of 2, so it makes at most
    log2(hi / lo) + 2 evaluations, and epsilon is monotone decreasing in sigma.
    """
    s = min(max(1.0, lo), hi)
    eps = eps_at(s)
    if eps > target:                            # too little noise: walk up
        while s < hi:
            a, s = s, min(2 * s, hi)
            eps = eps_at(s)
            if eps <= target:
                return a, s
        raise ValueError(
            f"target_epsilon={target} is unreachable: even noise_multiplier={hi} (the top of "
            f"bracket) gives epsilon={eps:.6g}; raise bracket's upper end or target_epsilon")
    while s > lo:                               # enough noise: walk down
        b, s = s, max(s / 2, lo)
        eps = eps_at(s)
        if eps > target:
            return s, b
    raise ValueError(
        f"target_epsilon={target} is reached already at noise_multiplier={lo} (the bottom of "
        f"bracket, epsilon={eps:.6g}); lower bracket's lower end to find the smallest sigma")


# ------------------------------------------------------------------------------------------------
# A running ledger.

class Accountant:
    """Records DP-SGD steps as they happen and reports epsilon so far.

    Consecutive steps with the same (sigma, q) are merged into one phase (a
    ``SelfComposedDpEvent``); phases compose (``ComposedDpEvent``). ``state_dict()`` is plain
    JSON-able data, so epsilon keeps counting across a restart::

        acc = Accountant()
        for x, y in loader:
            ...; optimizer.step()
            acc.step(noise_multiplier=1.1, sample_rate=q)
        acc.get_epsilon(1e-5)
    """

    STATE_VERSION = 1

    def __init__(self, accountant: str = "pld"):
        self.accountant = validate.accountant(accountant)
        self._history: list[list] = []          # [sigma, q, steps] per phase
        self._cache: tuple | None = None        # ((history, delta), epsilon)

    def step(self, *, noise_multiplier: float, sample_rate: float, n: int = 1) -> None:
        """Record ``n`` steps at noise ``noise_multiplier`` and Poisson rate ``sample_rate``."""
        sigma = validate.noise_multiplier(noise_multiplier)
        q = validate.sample_rate(sample_rate)
        n = validate.steps(n, "n")
        if n == 0:
            return
        if self._history and self._history[-1][:2] == [sigma, q]:
            self._history[-1][2] += n
        else:
            self._history.append([sigma, q, n])

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """The phases so far, as (noise_multiplier, sample_rate, steps)."""
        return [tuple(phase) for phase in self._history]

    @property
    def steps(self) -> int:
        return sum(phase[2] for phase in self._history)

    def dp_event(self) -> dp_accounting.DpEvent:
        """The dp_accounting event of everything recorded (``NoOpDpEvent`` when empty)."""
        events = [dp_event(*phase) for phase in self._history]
        if not events:
            return dp_accounting.NoOpDpEvent()
        return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)

    def get_epsilon(self, delta: float) -> float:
        delta = validate.delta(delta)
        key = (tuple(self.history), delta)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, event_epsilon(self.dp_event(), delta, self.accountant))
        return self._cache[1]

    def state_dict(self) -> dict:
        return {"version": self.STATE_VERSION, "accountant": self.accountant,
                "history": [list(phase) for phase in self._history]}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != self.STATE_VERSION:
            raise ValueError(f"state must be a dict from Accountant.state_dict() with version "
                             f"{self.STATE_VERSION}, got {state!r}")
        accountant = validate.accountant(state.get("accountant"))
        history = []
        for phase in state.get("history", []):
            if not isinstance(phase, (list, tuple)) or len(phase) != 3:
                raise ValueError(f"state['history'] entries must be [noise_multiplier, "
                                 f"sample_rate, steps], got {phase!r}")
            sigma, q, n = phase
            history.append([validate.noise_multiplier(sigma), validate.sample_rate(q),
                            validate.steps(n, "steps")])
        self.accountant, self._history, self._cache = accountant, history, None

    def __repr__(self) -> str:
        return f"Accountant({self.accountant!r}, history={self.history})"
