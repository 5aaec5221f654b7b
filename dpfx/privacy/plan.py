"""The privacy plan of a run, decided in one place for every entry point: its sample rate, steps,
noise multiplier, noise mechanism and sampler, and the accountant that counts it.

    from dpfx.privacy import plan as privacy_plan
    p = privacy_plan.make(sample_rate=256 / 60000, target_epsilon=3.0,
                          target_delta=1e-5, steps=10 * 234)
    p.noise_multiplier, p.steps_per_epoch          # sigma calibrated for 2340 steps, 234
    acc = p.accountant()                           # what counts this run's steps
    p = privacy_plan.make(..., mechanism="bandmf")  # correlated noise (Note [Noise mechanisms])
    p.strategy, p.sampler, p.parts                  # its strategy over p.steps steps; cyclic Poisson

``make_private``, ``DPTrainer`` and ``dpfx.opacus`` call ``make``: nothing else calibrates sigma,
pairs a mechanism with a sampler, or chooses the accountant. An entry point keeps only what is
its own: how it learns the data's size, the batch and the number of steps.

# Note [Noise mechanisms]
``mechanism`` (a string, or a ``Mechanism`` with its size) chooses the noise:

* ``"gaussian"``: DP-SGD, fresh N(0, sigma^2 S^2) every step; Poisson sampling by default.
* ``"bandmf"`` (``bands``), ``"bsr"`` (``bands``): a banded strategy matrix C, the noise at step t
  sigma S (C^{-1} z)_t (privacy/strategies.py). Sampled by cyclic Poisson over ``parts = bands``
  parts, so that an example's participations are at least ``bands`` steps apart and each one is a
  Poisson-sampled Gaussian mechanism (the banded columns of two participations are orthogonal;
  Choquette-Choo et al. 2023, "Amplified banded matrix factorization").
* ``"blt"`` (``buffers``), ``"matrix"`` (``matrix``): a strategy that is not banded. Sampled by
  cyclic Poisson over one epoch's steps as parts (each example in every epoch, always at the same
  step of it: separation = steps per epoch), accounted with no amplification, as one Gaussian
  mechanism of sensitivity ``C``'s over all of an example's participations.
* ``sampler="balls_in_bins"``: each example in one random step per epoch, for every mechanism,
  accounted as privacy/matrix_accounting.py states.

A pair with no valid accountant (a banded strategy under plain Poisson sampling, for one) is
refused by ``matrix_accounting.check_pair`` naming the valid ones. ``bands`` left unset with a
``target_epsilon`` is chosen for the least expected error at that epsilon over powers of two up
to 1/q (Note [Choosing the bands]); with a fixed ``noise_multiplier`` the epsilon
would change with the bands, so they must be given.

# Note [Choosing the bands]
More bands cancel more noise across steps but, under cyclic Poisson over ``bands`` parts, sample
each part at ``bands`` times the rate, which weakens amplification. For each candidate b the plan
calibrates sigma_b to the target and scores sigma_b^2 times the strategy's expected squared
error of the prefix sums (``strategies.expected_error``, the error of the model's trajectory
under SGD), and takes the least. b = 1 is DP-SGD's own error, so the choice never loses to it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from dpfx import privacy
from dpfx.errors import OptionError, OptionValueError
from dpfx.privacy import validate

MECHANISMS = ("gaussian", "bandmf", "bsr", "blt", "matrix")
SAMPLERS = ("poisson", "cyclic_poisson", "balls_in_bins")
_BANDED = ("bandmf", "bsr")


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """The noise option every entry point takes as ``mechanism=`` (a name is shorthand for
    ``Mechanism(name)``): ``Mechanism("bandmf", bands=8)``, ``Mechanism("blt", buffers=4)``,
    ``Mechanism("bsr", bands=16)``, ``Mechanism("matrix", matrix=C)`` (a lower-triangular
    strategy of one's own, as many rows as the run has steps)."""
    name: str = "gaussian"
    bands: int | None = None
    buffers: int | None = None
    matrix: Any = None

    def __post_init__(self):
        if self.name not in MECHANISMS:
            raise OptionValueError(f"mechanism must be one of {MECHANISMS} (or a dpfx.Mechanism), "
                                   f"got {self.name!r}")
        for field, owners in (("bands", _BANDED), ("buffers", ("blt",))):
            value = getattr(self, field)
            if value is None:
                continue
            if self.name not in owners:
                raise OptionValueError(f"mechanism {self.name!r} takes no {field} ({field} belong "
                                       f"to {' and '.join(repr(o) for o in owners)})")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OptionValueError(f"mechanism {self.name!r}: {field} must be an int >= 1, got "
                                       f"{value!r}")
        if (self.matrix is None) == (self.name == "matrix"):
            raise OptionValueError("mechanism 'matrix' takes matrix= (a lower-triangular "
                                   "strategy), and only it does")

    @property
    def correlated(self) -> bool:
        return self.name != "gaussian"


def mechanism_option(value) -> Mechanism:
    """``mechanism=`` as every entry point takes it: None, a name, or a ``Mechanism``."""
    if value is None:
        return Mechanism()
    if isinstance(value, Mechanism):
        return value
    if isinstance(value, str):
        return Mechanism(value)
    raise OptionError(f"mechanism must be a name {MECHANISMS} or a dpfx.Mechanism, got "
                      f"{type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class Plan:
    noise_multiplier: float
    sample_rate: float               # each unit's probability per step, over the whole data
    steps_per_epoch: int
    steps: int | None                # the run's planned steps; None when not known
    accountant_kind: str             # "pld" or "rdp"
    mechanism: Mechanism
    sampler: str                     # one of SAMPLERS
    parts: int | None = None         # cyclic Poisson's parts
    strategy: Any = None             # privacy/strategies.Strategy of a correlated mechanism
    sampling: Any = None             # its privacy/matrix_accounting sampling schema

    def accountant(self) -> privacy.Accountant:
        """A fresh accountant for this plan's steps (``DPOptimizer`` records each one)."""
        if self.strategy is None and self.sampler == "poisson":
            return privacy.Accountant(self.accountant_kind)
        from dpfx.privacy.matrix_accounting import MatrixAccountant
        return MatrixAccountant(self.strategy, self.sampling, self.accountant_kind)

    def check_accountant(self, accountant: privacy.Accountant) -> privacy.Accountant:
        """A user's own accountant (several runs counted in one), if it can count this plan."""
        fresh = self.accountant()
        if self.strategy is None and self.sampler == "poisson":     # DP-SGD's phases
            fits = type(accountant).dp_event is privacy.Accountant.dp_event
        else:
            fits = isinstance(accountant, type(fresh)) and \
                accountant.state_dict().get("strategy") == fresh.state_dict().get("strategy")
        if not fits:
            raise OptionValueError(f"accountant: a {type(accountant).__name__} cannot count steps "
                                   f"of mechanism {self.mechanism.name!r} sampled by "
                                   f"{self.sampler!r}; pass accountant='pld' or 'rdp' and use the "
                                   f"one returned")
        return accountant

    def check_poisson(self, units: str) -> None:
        """Refuses a sampler other than Poisson sampling for a run whose ``units`` ("users",
        "several processes' shards") are sampled by Poisson sampling only."""
        if self.sampler != "poisson":
            raise OptionValueError(f"sampler={self.sampler!r} samples the examples of one "
                                   f"process; user-level DP and several processes sample "
                                   f"{units} by Poisson sampling: use the Gaussian mechanism "
                                   f"with sampler='poisson'")

    def epsilon(self, delta: float, steps: int | None = None) -> float:
        """Epsilon after ``steps`` (default: the planned steps) at ``delta``."""
        acc = self.accountant()
        n = self.steps if steps is None else steps
        if n:
            acc.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate, n=n)
        return acc.get_epsilon(delta)


def make(*, sample_rate: float, noise_multiplier: float | None = None,
         target_epsilon: float | None = None, target_delta: float | None = None,
         steps: int | None = None, epochs: float | None = None, accountant: str = "pld",
         mechanism=None, sampler: str | None = None, steps_name: str = "steps") -> Plan:
    """The plan of a run whose examples (or users) are each sampled at ``sample_rate``.

    Give exactly one of ``noise_multiplier`` or ``target_epsilon`` (with ``target_delta``), and
    the run's length as ``steps`` (optimizer steps) or ``epochs`` (passes of the loader: 1/q
    steps each, under cyclic Poisson the whole cycles of parts nearest 1/q). A correlated
    ``mechanism`` needs the length: its strategy is built for it. ``steps_name`` is what the
    entry point calls the length in its errors ("epochs", "max_steps")."""
    q = validate.sample_rate(sample_rate)
    accountant = validate.accountant(accountant)
    steps_per_epoch = max(1, round(1 / q))
    if (noise_multiplier is None) == (target_epsilon is None):
        raise OptionValueError("give exactly one of noise_multiplier or target_epsilon")
    if steps is not None:
        steps = validate.steps(steps)
    mech = mechanism_option(mechanism)
    sampler = _sampler(sampler, mech)

    def length(per_pass: int) -> int | None:
        return steps if steps is not None or epochs is None else math.ceil(epochs * per_pass)

    if not mech.correlated and sampler == "poisson":
        if target_epsilon is not None:
            noise_multiplier = privacy.noise_multiplier(
                target_epsilon=target_epsilon, target_delta=target_delta, sample_rate=q,
                steps=length(steps_per_epoch), accountant=accountant)
        return Plan(validate.noise_multiplier(noise_multiplier), q, steps_per_epoch,
                    length(steps_per_epoch), accountant, mech, sampler)
    if not length(steps_per_epoch):
        raise OptionValueError(f"mechanism {mech.name!r} with sampler {sampler!r} is planned for "
                               f"the run's number of steps: give {steps_name}")

    def planned(bands: int | None) -> Plan:
        from dpfx.privacy import matrix_accounting
        parts = _parts(mech, sampler, q, bands)
        # a pass of cyclic Poisson is whole cycles of parts, so that the next pass continues
        # the cycle (Note [Cyclic Poisson sampling] in loop/samplers.py): the number of cycles
        # nearest to 1/q steps
        per_pass = parts * max(1, round(steps_per_epoch / parts)) if parts else steps_per_epoch
        n = length(per_pass)
        strategy = _strategy(mech, n, q, sampler, bands)
        sampling = _sampling(sampler, strategy, parts, q, n, per_pass)
        matrix_accounting.check_pair(strategy, sampling)
        sigma = noise_multiplier
        if target_epsilon is not None:
            sigma = matrix_accounting.matrix_noise_multiplier(
                target_epsilon, target_delta, strategy, sampling, n, accountant)
        return Plan(validate.noise_multiplier(sigma), q, per_pass, n, accountant, mech,
                    sampler, parts, strategy, sampling)

    if mech.name in _BANDED and mech.bands is None:
        if target_epsilon is None:
            raise OptionValueError(f"mechanism {mech.name!r} needs its bands with a fixed "
                                   f"noise_multiplier (the epsilon changes with them): give "
                                   f"dpfx.Mechanism({mech.name!r}, bands=b), or target_epsilon to "
                                   f"have them chosen (Note [Choosing the bands] in "
                                   f"privacy/plan.py)")
        return _least_error([planned(b) for b in _band_candidates(length(steps_per_epoch), q)])
    return planned(mech.bands)


def _sampler(sampler: str | None, mech: Mechanism) -> str:
    if sampler is None:
        return "cyclic_poisson" if mech.correlated else "poisson"
    if sampler not in SAMPLERS:
        raise OptionValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    if mech.correlated and sampler == "poisson":
        raise OptionValueError(f"mechanism {mech.name!r} has no valid accountant under plain "
                               f"Poisson sampling (its noise is correlated across steps an example "
                               f"may share): use sampler='cyclic_poisson' (the default for it) or "
                               f"'balls_in_bins'")
    return sampler


def _strategy(mech: Mechanism, steps: int, q: float, sampler: str, bands: int | None):
    from dpfx.privacy import strategies
    if mech.name == "gaussian":
        return strategies.gaussian(steps)
    if mech.name == "bandmf":
        return strategies.bandmf(steps, min(bands, steps),
                                 participations=math.ceil(steps / bands))
    if mech.name == "bsr":
        return strategies.bsr(steps, min(bands, steps))
    if mech.name == "blt":
        # an example's participations: one per epoch, at least 1/q apart under cyclic Poisson,
        # possibly adjacent under balls-in-bins
        cyclic = sampler == "cyclic_poisson"
        separation = _most_parts(q) if cyclic else 1
        every = separation if cyclic else max(1, round(1 / q))
        return strategies.blt(steps, mech.buffers or 4, min_separation=separation,
                              participations=math.ceil(steps / every))
    strategy = strategies.from_matrix(mech.matrix)
    if strategy.steps != steps:
        raise OptionValueError(f"mechanism 'matrix': the strategy matrix has {strategy.steps} rows "
                               f"and the run plans {steps} steps: give a {steps} x {steps} matrix")
    return strategy


def _parts(mech: Mechanism, sampler: str, q: float, bands: int | None):
    if sampler != "cyclic_poisson":
        return None
    return bands if mech.name in _BANDED else _most_parts(q)


def _most_parts(q: float) -> int:
    """The most parts cyclic Poisson can sample at rate q each step: q * parts <= 1."""
    return max(1, math.floor(1 / q + 1e-9))


def _sampling(sampler: str, strategy, parts, q: float, steps: int, steps_per_epoch: int):
    from dpfx.privacy import matrix_accounting as ma
    if sampler == "balls_in_bins":
        return ma.BallsInBins(steps_per_epoch)
    if q * parts > 1 + 1e-12:
        raise OptionValueError(f"cyclic Poisson over {parts} parts samples each part at "
                               f"{parts} x {q:.6g} > 1: use at most {_most_parts(q)} bands")
    if getattr(strategy, "bands", None) is not None and strategy.bands <= parts:
        return ma.CyclicPoisson(parts, q)
    return ma.MinSeparation(parts, math.ceil(steps / parts))


def _band_candidates(steps: int, q: float) -> list[int]:
    top = min(steps, _most_parts(q))
    return [b for b in (2 ** k for k in range(12)) if b <= top] or [1]


def _least_error(plans: list[Plan]) -> Plan:
    from dpfx.privacy import strategies
    return min(plans, key=lambda p: p.noise_multiplier ** 2 * strategies.expected_error(
        p.strategy) ** 2)
