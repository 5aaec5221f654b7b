"""The privacy plan (privacy/plan.py): one place decides a run's sigma, sample rate, steps,
mechanism and sampler, for every entry point. The Gaussian path against dp_accounting through
``dpfx.privacy``'s own calibration; the refusals of option pairs with no valid accountant."""
import pathlib
import re

import pytest

import dpfx
from dpfx import privacy
from dpfx.privacy import plan as privacy_plan

ROOT = pathlib.Path(dpfx.__file__).parent


def test_a_fixed_sigma_is_kept_and_the_epoch_is_one_over_q():
    p = privacy_plan.make(sample_rate=0.01, noise_multiplier=1.3)
    assert (p.noise_multiplier, p.sample_rate, p.steps_per_epoch, p.steps) == (1.3, 0.01, 100, None)
    assert p.mechanism == dpfx.Mechanism() and p.sampler == "poisson" and p.strategy is None
    assert type(p.accountant()) is privacy.Accountant


def test_a_target_epsilon_is_calibrated_for_the_planned_steps():
    p = privacy_plan.make(sample_rate=0.02, target_epsilon=2.0, target_delta=1e-5, epochs=3)
    assert p.steps == 150
    want = privacy.noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.02,
                                    steps=150)
    assert p.noise_multiplier == want
    assert p.epsilon(1e-5) <= 2.0 < p.epsilon(1e-5, steps=300)


@pytest.mark.parametrize("kwargs, match", [
    (dict(noise_multiplier=1.0, target_epsilon=1.0), "exactly one"),
    (dict(), "exactly one"),
    (dict(noise_multiplier=1.0, mechanism="bandmf", steps=10), "needs its bands"),
    (dict(noise_multiplier=1.0, mechanism="blt"), "give steps"),
    (dict(noise_multiplier=1.0, mechanism="bandmf", sampler="poisson", steps=10),
     "no valid accountant under plain Poisson"),
    (dict(noise_multiplier=1.0, sampler="shuffle"), "sampler must be one of"),
    (dict(noise_multiplier=1.0, mechanism="tree"), "mechanism must be one of"),
])
def test_pairs_without_a_plan_are_refused_naming_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        privacy_plan.make(sample_rate=0.1, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="gaussian", bands=4), "takes no bands"),
    (dict(name="blt", bands=4), "takes no bands"),
    (dict(name="bandmf", buffers=2), "takes no buffers"),
    (dict(name="bandmf", bands=0), "bands must be an int >= 1"),
    (dict(name="matrix"), "takes matrix="),
    (dict(name="bsr", matrix=[[1.0]]), "takes matrix="),
])
def test_a_mechanism_is_checked_when_made(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dpfx.Mechanism(**kwargs)


def test_mechanism_accepts_a_name_or_an_option_only():
    assert privacy_plan.mechanism_option("bsr") == dpfx.Mechanism("bsr")
    with pytest.raises(TypeError, match="mechanism must be a name"):
        privacy_plan.mechanism_option(3)


def test_only_the_plan_calibrates_sigma():
    """No entry point calibrates sigma or builds an accountant of its own: each new option (a
    noise mechanism, a sampler) is one edit to privacy/plan.py."""
    entries = [p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] in
               ("engine.py", "hf", "opacus", "trl")]
    assert len(entries) >= 5
    callers = {}
    for path in entries:
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        for pattern in (r"privacy\.noise_multiplier\(", r"privacy\.Accountant\(",
                        r"matrix_noise_multiplier\("):
            if re.search(pattern, text):
                callers.setdefault(rel, []).append(pattern)
    assert callers == {}, callers


# -- correlated noise ------------------------------------------------------------------------------
def test_a_banded_mechanism_is_sampled_by_cyclic_poisson_over_its_bands():
    """BandMF with b bands over b parts: each participation a Poisson-sampled Gaussian at the
    part's rate q * b, ceil(n / b) of them (Choquette-Choo et al. 2023), computed here with
    dpfx.privacy.epsilon, which composes dp_accounting's events itself."""
    p = privacy_plan.make(sample_rate=1 / 40, noise_multiplier=1.5,
                          mechanism=dpfx.Mechanism("bandmf", bands=4), epochs=2)
    assert (p.sampler, p.parts, p.steps_per_epoch, p.steps) == ("cyclic_poisson", 4, 40, 80)
    assert p.strategy.name == "bandmf" and p.strategy.steps == 80 and p.strategy.bands == 4
    acc = p.accountant()
    acc.step(noise_multiplier=1.5, sample_rate=1 / 40, n=80)
    want = privacy.epsilon(noise_multiplier=1.5, sample_rate=4 / 40, steps=20, delta=1e-5)
    assert abs(acc.get_epsilon(1e-5) - want) <= 1e-9 * want


def test_a_pass_of_cyclic_poisson_is_whole_cycles():
    p = privacy_plan.make(sample_rate=1 / 10, noise_multiplier=1.0,
                          mechanism=dpfx.Mechanism("bsr", bands=4), epochs=3)
    assert p.steps_per_epoch == 8 and p.steps == 24 and p.parts == 4    # 2 cycles ~ 1/q


def test_the_chosen_bands_lose_to_no_other_candidate():
    """Note [Choosing the bands]: the least sigma^2 times expected error at the target."""
    from dpfx.privacy import strategies

    p = privacy_plan.make(sample_rate=1 / 16, target_epsilon=4.0, target_delta=1e-5,
                          mechanism="bandmf", epochs=2)
    assert p.epsilon(1e-5) <= 4.0
    dpsgd = privacy_plan.make(sample_rate=1 / 16, target_epsilon=4.0, target_delta=1e-5,
                              mechanism=dpfx.Mechanism("bandmf", bands=1), epochs=2)

    def score(plan):
        return plan.noise_multiplier ** 2 * strategies.expected_error(plan.strategy) ** 2
    assert score(p) <= score(dpsgd) * (1 + 1e-9)


def test_an_unbanded_strategy_is_accounted_without_amplification():
    from dpfx.privacy import matrix_accounting as ma

    p = privacy_plan.make(sample_rate=1 / 8, noise_multiplier=2.0, mechanism="blt", epochs=3)
    assert isinstance(p.sampling, ma.MinSeparation)
    assert (p.sampling.separation, p.sampling.participations) == (8, 3)
    b = privacy_plan.make(sample_rate=1 / 8, noise_multiplier=2.0, mechanism="blt", epochs=3,
                          sampler="balls_in_bins")
    assert isinstance(b.sampling, ma.BallsInBins)
    # adjacent participations cost more than ones an epoch apart
    assert b.epsilon(1e-5) >= p.epsilon(1e-5)


def test_too_many_bands_for_the_rate_are_refused():
    with pytest.raises(ValueError, match="use at most 4 bands"):
        privacy_plan.make(sample_rate=0.25, noise_multiplier=1.0, epochs=2,
                          mechanism=dpfx.Mechanism("bandmf", bands=5))


def test_a_users_accountant_must_count_the_plan():
    p = privacy_plan.make(sample_rate=1 / 8, noise_multiplier=1.0, epochs=1,
                          mechanism=dpfx.Mechanism("bandmf", bands=2))
    with pytest.raises(ValueError, match="cannot count steps of mechanism 'bandmf'"):
        p.check_accountant(privacy.Accountant())
    assert p.check_accountant(p.accountant()) is not None


def test_a_strategy_of_ones_own_is_planned_for_its_steps():
    import torch

    eye = torch.eye(16, dtype=torch.float64)
    p = privacy_plan.make(sample_rate=1 / 8, noise_multiplier=1.0, epochs=2,
                          mechanism=dpfx.Mechanism("matrix", matrix=eye))
    assert p.strategy.steps == 16 and p.parts == 8
    # the identity under cyclic Poisson over 8 parts: DP-SGD at rate 1, one step per epoch
    want = privacy.epsilon(noise_multiplier=1.0, sample_rate=1.0, steps=2, delta=1e-5)
    assert abs(p.epsilon(1e-5) - want) <= 1e-9 * want
    with pytest.raises(ValueError, match="16 rows and the run plans 24 steps"):
        privacy_plan.make(sample_rate=1 / 8, noise_multiplier=1.0, epochs=3,
                          mechanism=dpfx.Mechanism("matrix", matrix=eye))
