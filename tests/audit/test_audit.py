"""dpfx.audit: the one-step canary audit finds no leak in dpfx's step and finds a deliberately
broken one. Seeds are fixed (dpfx's noise and the threshold split), so the short version is
deterministic: eager backend, one thread (Note in dpfx/audit.py's ``run``)."""
import math

import pytest
import torch

import dpfx.audit as audit
from dpfx.audit.__main__ import builtin_setup


def _audit(control=None, trials=800, **kwargs):
    model, batch, canary = builtin_setup("linear", 8)
    settings = dict(max_grad_norm=1.0, noise_multiplier=1.0, trials=trials, seed=0, threads=1,
                    backend="eager")
    settings.update(kwargs)
    return audit.run(model, batch, canary, control=control, **settings)


def test_correct_step_stays_below_the_accounted_epsilon_and_the_control_is_caught():
    correct = _audit()
    assert correct.eps_accounted == pytest.approx(4.377, abs=0.01)   # one Gaussian step, sigma 1
    assert 0 < correct.eps_lower_bound < correct.eps_accounted
    assert correct.verdict.startswith("consistent")
    broken = _audit("sigma/10")
    assert broken.eps_accounted == correct.eps_accounted             # the accountant is lied to
    assert broken.eps_lower_bound > broken.eps_accounted
    assert broken.verdict.startswith("VIOLATION")
    assert "empirical epsilon" in str(broken)


def test_clopper_pearson_and_the_bound():
    # Known values: 0 of 100 at one-sided 97.5%: 1 - 0.025^(1/100); 5 of 100 from scipy's beta.
    assert audit.cp_upper(0, 100, 0.025) == pytest.approx(1 - 0.025 ** 0.01, rel=1e-9)
    assert audit.cp_upper(100, 100, 0.025) == 1.0
    assert audit.cp_upper(5, 100, 0.025) == pytest.approx(0.112834, abs=1e-5)
    assert audit._binom_cdf(5, 100, audit.cp_upper(5, 100, 0.025)) == pytest.approx(0.025)
    assert audit.eps_lower_bound(0.01, 0.5, 1e-5) == pytest.approx(math.log((1 - 1e-5 - 0.5) / 0.01))
    assert audit.eps_lower_bound(0.5, 0.5, 0.0) == 0.0


def test_bad_arguments():
    model, batch, canary = builtin_setup("linear", 2)
    with pytest.raises(ValueError, match="control"):
        audit.run(model, batch, canary, max_grad_norm=1.0, noise_multiplier=1.0, control="x")
    with pytest.raises(ValueError, match="noise='graph'"):
        audit.run(model, batch, canary, max_grad_norm=1.0, noise_multiplier=1.0,
                  noise="optimizer")


@pytest.mark.slow
@pytest.mark.parametrize("control", [None, "no-clip", "sigma/4"])
def test_long_audit_through_inductor(control):
    """The long audit: 16000 trials a side through the default backend, an MLP, a batch of
    8 beside the canary; sigma/4 is a weaker breakage than the default test's sigma/10."""
    model, batch, canary = builtin_setup("mlp", 8)
    result = audit.run(model, batch, canary, max_grad_norm=1.0, noise_multiplier=1.0,
                       trials=16000, seed=1, threads=1, control=control)
    print(result)
    if control is None:
        assert result.eps_lower_bound < result.eps_accounted
    else:
        assert result.eps_lower_bound > result.eps_accounted
