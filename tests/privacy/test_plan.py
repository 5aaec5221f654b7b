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
               ("engine.py", "hf.py", "hf_users.py", "hf_ranks.py", "opacus", "trl.py", "trl")]
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
