"""Privacy accounting for matrix-factorization mechanisms (DP-MF, DP-FTRL): one accountant per
strategy and sampling scheme, and noise calibration.

    from dpfx.privacy.matrix_accounting import (CyclicPoisson, MatrixAccountant, MinSeparation,
                                                matrix_noise_multiplier)

    strategy = bandmf(steps=2000, bands=4)                   # dpfx.privacy.strategies
    sampling = CyclicPoisson(parts=4, sample_rate=256 / 60000)
    sigma = matrix_noise_multiplier(3.0, 1e-5, strategy, sampling, steps=2000)
    acc = MatrixAccountant(strategy, sampling)               # one per training run
    acc.step(noise_multiplier=sigma, sample_rate=256 / 60000)   # after every optimizer step
    acc.get_epsilon(1e-5)

The mechanism releases C G + sigma S Z for a lower-triangular strategy C normalized to a largest
column norm of 1 (privacy/strategies.py), so epsilon depends on sigma, the strategy's
participation sensitivity and how examples are sampled. Three samplings:

* ``CyclicPoisson(parts, sample_rate)`` (``CyclicPoissonSampler``): with a banded strategy of at
  most ``parts`` bands, Poisson amplification (Note [Cyclic Poisson amplification]).
* ``MinSeparation(separation, participations)``: any sampler under which any two participations
  of an example are >= ``separation`` steps apart and there are at most ``participations`` of them
  (a fixed-order loader: separation = steps per epoch, participations = epochs; also
  ``CyclicPoissonSampler``: separation = parts). No amplification (Note [Min-separation]).
* ``BallsInBins(steps_per_epoch)`` (``BallsInBinsSampler``): accounted without amplification
  (Note [Balls in bins without amplification]).

``check_pair`` refuses a pair that has no valid accountant and names the ones that do.

# Note [Cyclic Poisson amplification]
Under cyclic Poisson sampling with b parts an example can join only the steps j, j + b, j + 2b, ...
of its part, each independently with probability q' = q * b. If C has at most b bands (C[i, j] = 0
for i - j >= b), the rows that one participation changes (its column's support, steps s .. s+b-1)
are disjoint from those of every other participation of the same example, and the noise of
disjoint rows is independent. The release is then an adaptive composition of one
Poisson-subsampled Gaussian mechanism per chance to participate, each with noise multiplier
sigma / (the largest column norm, ``sensitivity(parts, 1)``, 1 for a normalized strategy): after t
steps, ``PoissonSampledDpEvent(q', GaussianDpEvent(sigma))`` self-composed ceil(t / b) times
(Choquette-Choo, McMahan, Rush & Thakurta 2023, "(Amplified) Banded Matrix Factorization: A
unified approach to private training", the amplification theorem for b-banded strategies under
b-min-separation; JAX-Privacy 2.0's ``amplified_bandmf_event`` is the same event). DP-SGD is the
identity, one band: with b = 1 this is ``dpfx.privacy.dp_event`` exactly. The partition must
keep add-or-remove-one neighbours honest, hence independent parts (Note [Cyclic Poisson sampling]
in loop/samplers.py).

# Note [Min-separation]
Without amplification the release is one Gaussian mechanism on the whole stream, adaptive
inputs included (Denisov et al. 2022, "Improved differential privacy for SGD via optimal private
linear operators on adaptive streams"): epsilon is that of ``GaussianDpEvent(sigma / sens)``, with
sens the largest ||C u|| over participation patterns u allowed by the sampling (Choquette-Choo et
al. 2023, "Multi-epoch matrix factorization mechanisms for private machine learning"). With
vector gradients the change is sum_j (C e_j) g_j^T over the participations j, ||g_j|| <= 1; its
Frobenius norm is at most ||C u|| for the 0/1 pattern u when C^T C is entrywise nonnegative, and
``Strategy.sensitivity`` must bound it otherwise. After t of the strategy's n steps only the
leading t x t block of C has been released, and at most min(k, ceil(t / b)) participations can
have happened. The accountant uses
``strategy.sensitivity(b, min(k, ceil(t / b)))``, the sensitivity of all n steps at that many
participations: a pattern within the first t steps, padded with zeros, is a pattern of the n-step
problem with as many participations, and the first t rows of C u are part of C u, so this bounds
the t x t block's sensitivity from above, with equality at t = n (the number calibration uses).

# Note [Balls in bins without amplification]
Balls-in-bins sampling does amplify (Chua et al. 2024, "Balls-and-bins sampling for DP-SGD";
Choquette-Choo et al. 2024, "Near exact privacy amplification for matrix mechanisms"), but the
published accountants estimate epsilon by Monte Carlo, which is not a guaranteed upper bound.
``BallsInBins`` therefore accounts as ``MinSeparation`` with separation 1 (an example can sit at
the last step of one epoch and the first of the next) and one participation per epoch begun:
after t steps sens = ``strategy.sensitivity(1, ceil(t / steps_per_epoch))``. The example's step is
random, so the release is a mixture over its placements; the hockey-stick divergence of a mixture
is at most the largest of its components' (joint convexity), each a Gaussian mechanism of
sensitivity <= sens. A valid upper bound, and a loose one.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable

import dp_accounting

from dpfx.errors import OptionValueError
from dpfx.privacy import (SIGMA_BRACKET, SIGMA_TOLERANCE, Accountant, calibrate, dp_event,
                          validate)

__all__ = ["CyclicPoisson", "MinSeparation", "BallsInBins", "MatrixAccountant", "check_pair",
           "matrix_dp_event", "matrix_noise_multiplier"]


@dataclasses.dataclass(frozen=True)
class CyclicPoisson:
    """``CyclicPoissonSampler(N, sample_rate, parts)``: step t Poisson-samples part t mod parts at
    rate sample_rate * parts (Note [Cyclic Poisson amplification])."""
    parts: int
    sample_rate: float

    def __post_init__(self):
        validate.integer(self.parts, "CyclicPoisson.parts", 1)
        validate.sample_rate(self.sample_rate, "CyclicPoisson.sample_rate")
        if self.sample_rate * self.parts > 1:
            raise ValueError(f"CyclicPoisson: sample_rate * parts must be <= 1 (each part is "
                             f"sampled at that rate), got sample_rate={self.sample_rate} and "
                             f"parts={self.parts}")

    @property
    def part_rate(self) -> float:
        return self.sample_rate * self.parts


@dataclasses.dataclass(frozen=True)
class MinSeparation:
    """Any two participations of an example are >= ``separation`` steps apart and there are at
    most ``participations`` of them (Note [Min-separation])."""
    separation: int
    participations: int

    def __post_init__(self):
        validate.integer(self.separation, "MinSeparation.separation", 1)
        validate.integer(self.participations, "MinSeparation.participations", 1)


@dataclasses.dataclass(frozen=True)
class BallsInBins:
    """``BallsInBinsSampler(N, steps_per_epoch)``: each example in one uniformly random step per
    epoch. Accounted without amplification (Note [Balls in bins without amplification])."""
    steps_per_epoch: int

    def __post_init__(self):
        validate.integer(self.steps_per_epoch, "BallsInBins.steps_per_epoch", 1)


SAMPLINGS = (CyclicPoisson, MinSeparation, BallsInBins)
_STRATEGY_MEMBERS = ("name", "steps", "bands", "sensitivity", "state_dict")


def check_pair(strategy, sampling) -> None:
    """Raise unless ``sampling`` with ``strategy`` has a valid accountant here (ValueError naming
    the pair and what would be valid; TypeError for an object that is neither)."""
    missing = [m for m in _STRATEGY_MEMBERS if not hasattr(strategy, m)]
    if missing:
        raise TypeError(f"strategy must be a dpfx.privacy.strategies.Strategy, got "
                        f"{type(strategy).__name__} (no {', '.join(missing)})")
    if not isinstance(sampling, SAMPLINGS):
        raise TypeError(f"sampling must be one of CyclicPoisson, MinSeparation, BallsInBins, got "
                        f"{type(sampling).__name__}")
    if not isinstance(sampling, CyclicPoisson):
        return
    b, bands = sampling.parts, strategy.bands
    if bands is not None and bands <= b:
        return
    what = "is not banded" if bands is None else f"has {bands} bands, more than parts={b}"
    raise ValueError(
        f"no valid accountant for strategy {strategy.name!r} ({strategy.steps} steps) under "
        f"{sampling}: the strategy {what}, and cyclic Poisson amplification needs at most "
        f"`parts` bands (Note [Cyclic Poisson amplification]). Use a banded strategy with bands "
        f"<= {b} (bandmf, bsr, gaussian), or account the same sampler without amplification: "
        f"MinSeparation(separation={b}, participations={math.ceil(strategy.steps / b)})")


def _sensitivity(strategy, separation: int, participations: int, cache=None) -> float:
    """``strategy.sensitivity``, checked, and kept in ``cache`` (a dict) when one is given: a
    strategy's sensitivity can cost a search over participation patterns."""
    if cache is not None and (separation, participations) in cache:
        return cache[separation, participations]
    sens = float(strategy.sensitivity(separation, participations))
    if not (math.isfinite(sens) and sens > 0):
        raise ValueError(f"strategy {strategy.name!r}: sensitivity({separation}, "
                         f"{participations}) must be finite and > 0, got {sens!r}")
    if cache is not None:
        cache[separation, participations] = sens
    return sens


def _event_fn(strategy, sampling, steps: int,
              cache=None) -> Callable[[float], dp_accounting.DpEvent]:
    """sigma -> the event of the first ``steps`` steps; the sensitivity is computed once."""
    if steps == 0:
        return lambda sigma: dp_accounting.NoOpDpEvent()
    if isinstance(sampling, CyclicPoisson):
        sens = _sensitivity(strategy, sampling.parts, 1, cache)   # the largest column norm
        rounds = math.ceil(steps / sampling.parts)
        return lambda sigma: dp_event(sigma / sens, sampling.part_rate, rounds)
    if isinstance(sampling, MinSeparation):
        b = sampling.separation
        k = min(sampling.participations, math.ceil(steps / b))
    else:                                                         # BallsInBins
        b, k = 1, math.ceil(steps / sampling.steps_per_epoch)
    sens = _sensitivity(strategy, b, k, cache)
    return lambda sigma: dp_accounting.GaussianDpEvent(sigma / sens)


def _check_steps_of(strategy, steps, name: str = "steps") -> int:
    steps = validate.steps(steps, name)
    if steps > strategy.steps:
        raise ValueError(f"{name}={steps} is more than the {strategy.steps} steps strategy "
                         f"{strategy.name!r} was built for; build it for as many steps as the "
                         f"run takes")
    return steps


def matrix_dp_event(noise_multiplier: float, strategy, sampling,
                    steps: int) -> dp_accounting.DpEvent:
    """The dp_accounting event of the first ``steps`` steps of ``strategy`` at noise
    ``noise_multiplier`` under ``sampling`` (``NoOpDpEvent`` for 0 steps)."""
    check_pair(strategy, sampling)
    sigma = validate.noise_multiplier(noise_multiplier)
    return _event_fn(strategy, sampling, _check_steps_of(strategy, steps))(sigma)


def matrix_noise_multiplier(target_epsilon: float, target_delta: float, strategy, sampling,
                            steps: int, accountant: str = "pld",
                            tolerance: float = SIGMA_TOLERANCE,
                            bracket: tuple[float, float] = SIGMA_BRACKET) -> float:
    """The smallest sigma in ``bracket`` (within ``tolerance * sigma``) whose epsilon after
    ``steps`` steps is <= ``target_epsilon``; the search of ``dpfx.privacy.noise_multiplier``."""
    check_pair(strategy, sampling)
    steps = _check_steps_of(strategy, steps)
    if steps == 0:
        raise OptionValueError("steps must be >= 1 to calibrate the noise multiplier (0 steps "
                               "spend no privacy at any sigma)")
    return calibrate(_event_fn(strategy, sampling, steps), target_epsilon=target_epsilon,
                     target_delta=target_delta, accountant=accountant, tolerance=tolerance,
                     bracket=bracket)


def _json(x):
    return json.loads(json.dumps(x))


class MatrixAccountant(Accountant):
    """Counts the steps of one matrix-factorization run and reports its epsilon so far.

    ``step(noise_multiplier=, sample_rate=, n=)`` as ``Accountant.step``; the noise multiplier
    (and the sample rate) must stay the same for the whole run, and the run may take at most
    ``strategy.steps`` steps. Under ``CyclicPoisson`` the step's ``sample_rate`` (if given) must be
    the sampling's; under the others it is recorded and not used. ``state_dict()`` is JSON-able
    and names the strategy and the sampling; ``load_state_dict`` refuses another's.
    """

    # Not Accountant's 1: a plain Accountant given this state would count its steps as DP-SGD's
    # Poisson steps, which understates epsilon under cyclic Poisson sampling; it refuses it.
    STATE_VERSION = "matrix-1"

    def __init__(self, strategy, sampling, accountant: str = "pld"):
        check_pair(strategy, sampling)
        super().__init__(accountant)
        self.strategy, self.sampling = strategy, sampling
        self._sensitivities: dict = {}

    def step(self, *, noise_multiplier: float, sample_rate: float | None = None,
             n: int = 1) -> None:
        sigma = validate.noise_multiplier(noise_multiplier)
        q = self._step_rate(sample_rate)
        n = validate.steps(n, "n")
        if n == 0:
            return
        if self._history and self._history[-1][:2] != [sigma, q]:
            was_sigma, was_q, _ = self._history[-1]
            raise ValueError(
                f"a matrix-factorization run keeps one noise_multiplier and sample_rate: the "
                f"{self.steps} steps so far used noise_multiplier={was_sigma}, "
                f"sample_rate={was_q}, this step {sigma}, {q}. Its noise is correlated across "
                f"steps by strategy {self.strategy.name!r} at one scale; start a new run (and "
                f"strategy) to change it")
        _check_steps_of(self.strategy, self.steps + n, "steps taken")
        if self._history:
            self._history[-1][2] += n
        else:
            self._history.append([sigma, q, n])

    def _step_rate(self, sample_rate) -> float:
        if sample_rate is None:
            return self.sampling.sample_rate if isinstance(self.sampling, CyclicPoisson) else 1.0
        q = validate.sample_rate(sample_rate)
        if not isinstance(self.sampling, CyclicPoisson):
            return q
        if not math.isclose(q, self.sampling.sample_rate, rel_tol=1e-9):
            raise ValueError(f"sample_rate={q} differs from the accountant's {self.sampling}; "
                             f"the sampler and the accountant must agree")
        return self.sampling.sample_rate

    def dp_event(self) -> dp_accounting.DpEvent:
        if not self._history:
            return dp_accounting.NoOpDpEvent()
        event = _event_fn(self.strategy, self.sampling, self.steps, self._sensitivities)
        return event(self._history[0][0])

    def _identity(self) -> dict:
        return _json({"strategy": {"name": self.strategy.name, "steps": self.strategy.steps,
                                   "bands": self.strategy.bands,
                                   "state": self.strategy.state_dict()},
                      "sampling": {"kind": type(self.sampling).__name__,
                                   **dataclasses.asdict(self.sampling)}})

    def state_dict(self) -> dict:
        return {**super().state_dict(), **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "strategy" not in state or "sampling" not in state:
            raise ValueError("state must come from MatrixAccountant.state_dict(), which names the "
                             "strategy and the sampling; a plain Accountant's state does not")
        mine = self._identity()
        for key in ("sampling", "strategy"):
            if _json(state[key]) != mine[key]:
                theirs = state[key].get("kind", state[key].get("name")) \
                    if isinstance(state[key], dict) else state[key]
                raise ValueError(
                    f"the state was saved with another {key} ({theirs!r}: "
                    f"{json.dumps(state[key])[:200]}) than this accountant's "
                    f"({json.dumps(mine[key])[:200]}); load it into a MatrixAccountant built with "
                    f"the same strategy and sampling")
        history = state.get("history", [])
        if len(history) > 1:
            raise ValueError(f"a matrix-factorization run has one phase (one noise_multiplier), "
                             f"the state holds {len(history)}")
        before = (self.accountant, self._history, self._cache)
        super().load_state_dict(state)
        try:
            _check_steps_of(self.strategy, self.steps, "the state's steps")
        except ValueError:
            self.accountant, self._history, self._cache = before
            raise

    def __repr__(self) -> str:
        return (f"MatrixAccountant({self.strategy.name!r}, {self.sampling}, {self.accountant!r}, "
                f"history={self.history})")
