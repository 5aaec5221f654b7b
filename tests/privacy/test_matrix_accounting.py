"""dpfx.privacy.matrix_accounting against independent numbers: dp_accounting called directly,
JAX-Privacy 2.0's amplified BandMF event, and the analytic Gaussian mechanism (Balle & Wang 2018).

The strategies here are test-local stand-ins built from dense lower-triangular matrices, their
sensitivity found by brute force over participation patterns."""
import itertools
import json
import math

import dp_accounting
import pytest
import torch
from dp_accounting import pld, rdp
from scipy.stats import norm

from dpfx import privacy
from dpfx.privacy import Accountant
from dpfx.privacy.matrix_accounting import (BallsInBins, CyclicPoisson, MatrixAccountant,
                                            MinSeparation, check_pair, matrix_dp_event,
                                            matrix_noise_multiplier)
from dpfx.privacy.recursion import BLTRecursion, ToeplitzRecursion

DELTA = 1e-5


class StandIn:
    """A strategy from a dense lower-triangular C, normalized to a largest column norm of 1."""

    def __init__(self, name, matrix, bands):
        self.matrix = matrix / matrix.norm(dim=0).max()
        self.name, self.steps, self.bands = name, matrix.shape[0], bands
        self.calls = []

    def sensitivity(self, min_separation, participations):
        """max ||C u|| over u in {0,1}^n, <= participations ones, >= min_separation apart (C^T C
        is nonnegative for these matrices, so this is the sensitivity)."""
        self.calls.append((min_separation, participations))
        if participations == 1:
            return float(self.matrix.norm(dim=0).max())
        n = self.steps
        assert n <= 16, "brute force"
        best = 0.0
        for k in range(1, participations + 1):
            for steps in itertools.combinations(range(n), k):
                if all(b - a >= min_separation for a, b in zip(steps, steps[1:])):
                    best = max(best, float(self.matrix[:, list(steps)].sum(1).norm()))
        return best

    def state_dict(self):
        return {"name": self.name, "rows": self.matrix.tolist()}


def identity(n):
    return StandIn("gaussian", torch.eye(n, dtype=torch.float64), bands=1)


def two_band(n, c1=0.6):
    return StandIn("bandmf", ToeplitzRecursion((1.0, c1)).matrix(n), bands=2)


def dense(n):
    return StandIn("matrix", torch.ones(n, n, dtype=torch.float64).tril(), bands=None)


def _direct_pld(event, delta=DELTA):
    """dp_accounting's PLD accountant called directly, on the grid Note [PLD grid] picks."""
    eps_rdp = rdp.RdpAccountant().compose(event).get_epsilon(delta)
    interval = privacy.pld_discretization_interval(eps_rdp)
    return pld.PLDAccountant(value_discretization_interval=interval).compose(event) \
        .get_epsilon(delta)


def _run(strategy, sampling, sigma, steps, q=None, accountant="pld"):
    acc = MatrixAccountant(strategy, sampling, accountant)
    for _ in range(steps):
        acc.step(noise_multiplier=sigma, sample_rate=q)
    assert acc.steps == steps
    return acc


# -- cyclic Poisson: Note [Cyclic Poisson amplification] -------------------------------------------

def test_identity_with_one_part_is_dp_sgd_exactly():
    q, sigma, steps = 0.01, 0.8, 500
    acc = _run(identity(steps), CyclicPoisson(1, q), sigma, steps, q)
    assert isinstance(acc, Accountant)                      # what DPOptimizer accepts
    assert acc.get_epsilon(DELTA) == privacy.epsilon(noise_multiplier=sigma, sample_rate=q,
                                                     steps=steps, delta=DELTA)
    assert acc.dp_event() == privacy.dp_event(sigma, q, steps)


@pytest.mark.parametrize("sigma, steps, parts, q, jax_privacy", [
    # JAX-Privacy 2.0.0: jax_privacy.experimental.accounting.amplified_bandmf_event(
    #   sigma, steps, num_bands=parts, sampling_prob=q * parts), composed into
    #   dp_accounting.pld.PLDAccountant() (dp-accounting 0.6.0), .get_epsilon(1e-5)
    (0.9, 600, 2, 0.01, 2.8080829271303567),
    (1.2, 1000, 4, 0.01, 2.9615379759787013),
    (0.7, 300, 3, 0.005, 3.1080603836630405),
])
def test_banded_under_cyclic_poisson_is_dp_sgd_at_q_times_parts(sigma, steps, parts, q,
                                                                 jax_privacy):
    acc = _run(two_band(steps), CyclicPoisson(parts, q), sigma, steps, q)
    eps = acc.get_epsilon(DELTA)
    assert eps == pytest.approx(jax_privacy, rel=1e-3)         # 2% asked; 1.1e-6 measured
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        q * parts, dp_accounting.GaussianDpEvent(sigma)), math.ceil(steps / parts))
    assert acc.dp_event() == dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        pytest.approx(q * parts), dp_accounting.GaussianDpEvent(pytest.approx(sigma))),
        math.ceil(steps / parts))
    if parts == 2:                                  # one PLD call more, not three
        assert eps == pytest.approx(_direct_pld(event), rel=1e-6)
    assert acc.strategy.calls == [(parts, 1)]


def test_cyclic_poisson_counts_ceil_t_over_parts_mid_run():
    acc = _run(two_band(10), CyclicPoisson(3, 0.1), 1.0, 7)
    event = acc.dp_event()
    assert event.count == 3 and event.event.sampling_probability == pytest.approx(0.3)
    assert _run(two_band(10), CyclicPoisson(3, 0.1), 1.0, 10).dp_event().count == 4


# -- no amplification: Note [Min-separation], Note [Balls in bins without amplification] ----------

def _analytic_gaussian_epsilon(mu, delta):
    """Balle & Wang 2018 (Theorem 8): the Gaussian mechanism with sensitivity / sigma = mu is
    (eps, delta)-DP exactly for delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    def delta_of(eps):
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)

    lo, hi = 0.0, 1.0
    while delta_of(hi) > delta:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


@pytest.mark.parametrize("make, sampling, steps, k", [
    (two_band, MinSeparation(3, 3), 12, 3),       # ceil(12 / 3) = 4 > 3 participations
    (two_band, MinSeparation(3, 3), 5, 2),        # mid-run: at most ceil(5 / 3) = 2 so far
    (dense, MinSeparation(4, 2), 10, 2),          # not banded: fine without amplification
    (two_band, BallsInBins(4), 12, 3),            # separation 1, one per epoch: 3 epochs
])
def test_without_amplification_is_the_analytic_gaussian(make, sampling, steps, k):
    sigma = 2.0
    n = 12 if make is two_band else 10
    strategy = make(n)
    acc = _run(strategy, sampling, sigma, steps)
    b = getattr(sampling, "separation", 1)
    sens = make(n).sensitivity(b, k)
    assert acc.dp_event() == dp_accounting.GaussianDpEvent(pytest.approx(sigma / sens))
    assert strategy.calls == [(b, k)]
    expected = _analytic_gaussian_epsilon(sens / sigma, DELTA)
    assert acc.get_epsilon(DELTA) == pytest.approx(expected, rel=0.02)
    assert acc.get_epsilon(DELTA) >= expected * (1 - 1e-3)         # never below the exact value


def blt(n):
    """A buffered linear Toeplitz strategy: T_0 = 1, T_j = sum_i omega_i theta_i^(j-1)."""
    return StandIn("blt", BLTRecursion(1.0, (0.9, 0.5), (0.3, 0.2)).matrix(n), bands=None)


@pytest.mark.parametrize("sigma, sampling, sens, jax_privacy", [
    # JAX-Privacy 2.0.0 (jax 0.10.2, x64), the BLT buffered_toeplitz.BufferedToeplitz(
    #   buf_decay=[0.9, 0.5], output_scale=[0.3, 0.2]).toeplitz_coefs(12), divided by its norm;
    #   sens = sqrt(toeplitz.minsep_sensitivity_squared(coef, min_sep, max_participations, n=12));
    #   epsilon = accounting.analysis.SingleReleaseTrainingAccountant(
    #   dp_accountant_config=accounting.accountants.PldAccountantConfig()).compute_epsilon(1,
    #   DpParams(noise_multipliers=sigma / sens, delta=1e-5, ...))
    (3.0, MinSeparation(3, 4), 2.6343422009009023, 3.7680964665802295),
    (2.0, MinSeparation(4, 2), 1.6211956575124975, 3.438219116174207),
    (4.0, BallsInBins(4), 2.5333446856765374, 2.598457585443785),   # min_sep 1, 3 participations
])
def test_blt_without_amplification_matches_jax_privacy(sigma, sampling, sens, jax_privacy):
    acc = _run(blt(12), sampling, sigma, 12)
    assert sigma / acc.dp_event().noise_multiplier == pytest.approx(sens, rel=1e-9)
    assert acc.get_epsilon(DELTA) == pytest.approx(jax_privacy, rel=1e-3)   # 2e-9 measured


# -- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy, sampling, says", [
    (dense(6), CyclicPoisson(2, 0.1), "not banded"),
    (two_band(6), CyclicPoisson(1, 0.1), "2 bands, more than parts=1"),
])
def test_pair_without_an_accountant_is_refused(strategy, sampling, says):
    with pytest.raises(ValueError, match=says) as err:
        check_pair(strategy, sampling)
    assert strategy.name in str(err.value) and "MinSeparation(separation=" in str(err.value)
    with pytest.raises(ValueError, match=says):
        MatrixAccountant(strategy, sampling)
    with pytest.raises(ValueError, match=says):
        matrix_noise_multiplier(1.0, DELTA, strategy, sampling, 6)


def test_valid_pairs_pass():
    for strategy, sampling in [(identity(4), CyclicPoisson(1, 0.5)),
                               (two_band(4), CyclicPoisson(2, 0.5)),
                               (dense(4), MinSeparation(1, 4)), (dense(4), BallsInBins(2))]:
        check_pair(strategy, sampling)
    with pytest.raises(TypeError, match="sampling must be one of"):
        check_pair(identity(4), "poisson")
    with pytest.raises(TypeError, match="no .*sensitivity"):
        check_pair(object(), MinSeparation(1, 1))


def test_bad_samplings():
    with pytest.raises(ValueError, match="sample_rate=0.3 and parts=4"):
        CyclicPoisson(4, 0.3)
    with pytest.raises(ValueError, match="MinSeparation.participations"):
        MinSeparation(2, 0)
    with pytest.raises(ValueError, match="BallsInBins.steps_per_epoch"):
        BallsInBins(0)


def test_step_refusals():
    acc = MatrixAccountant(two_band(3), CyclicPoisson(2, 0.1))
    acc.step(noise_multiplier=1.0, sample_rate=0.1, n=2)
    with pytest.raises(ValueError, match="one noise_multiplier"):
        acc.step(noise_multiplier=1.5, sample_rate=0.1)
    with pytest.raises(ValueError, match="differs from the accountant's"):
        acc.step(noise_multiplier=1.0, sample_rate=0.2)
    with pytest.raises(ValueError, match="more than the 3 steps"):
        acc.step(noise_multiplier=1.0, sample_rate=0.1, n=2)
    assert acc.history == [(1.0, 0.1, 2)]                 # nothing recorded by a refusal
    acc.step(noise_multiplier=1.0)
    assert acc.steps == 3 and acc.history == [(1.0, 0.1, 3)]
    with pytest.raises(ValueError, match="more than the 3 steps"):
        matrix_dp_event(1.0, two_band(3), CyclicPoisson(2, 0.1), 4)


# -- state -----------------------------------------------------------------------------------------

def test_state_dict_round_trip_and_refusals():
    strategy, sampling = two_band(8), MinSeparation(2, 4)
    acc = _run(strategy, sampling, 3.0, 5, q=0.25)
    state = json.loads(json.dumps(acc.state_dict()))
    again = MatrixAccountant(two_band(8), MinSeparation(2, 4))
    again.load_state_dict(state)
    assert again.history == acc.history and again.get_epsilon(DELTA) == acc.get_epsilon(DELTA)
    for other in [MatrixAccountant(two_band(8, c1=0.5), sampling),
                  MatrixAccountant(two_band(8), MinSeparation(2, 3)),
                  MatrixAccountant(two_band(8), BallsInBins(2))]:
        with pytest.raises(ValueError, match="saved with another"):
            other.load_state_dict(state)
        assert other.steps == 0
    with pytest.raises(ValueError, match="a plain Accountant's state"):
        again.load_state_dict(Accountant().state_dict())
    plain = Accountant()                # would count the steps as DP-SGD's: refused
    with pytest.raises(ValueError, match="with version 1"):
        plain.load_state_dict(state)
    assert plain.steps == 0
    short = MatrixAccountant(two_band(4), sampling)
    longer = MatrixAccountant(two_band(4), sampling)
    longer.load_state_dict(short.state_dict())
    with pytest.raises(ValueError, match="the state's steps=5"):
        big = {**short.state_dict(), "history": [[3.0, 0.25, 5]]}
        longer.load_state_dict(big)
    assert longer.steps == 0


# -- calibration -----------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy, sampling, steps, accountant", [
    (two_band(200), CyclicPoisson(2, 0.02), 200, "rdp"),     # the PLD search costs ~10 s
    (two_band(12), MinSeparation(3, 4), 12, "pld"),
])
def test_calibration_round_trip(strategy, sampling, steps, accountant):
    target, tolerance = 2.0, 1e-2
    sigma = matrix_noise_multiplier(target, DELTA, strategy, sampling, steps, accountant,
                                    tolerance=tolerance)
    acc = _run(strategy, sampling, sigma, steps, accountant=accountant)
    assert target * 0.95 <= acc.get_epsilon(DELTA) <= target
    less = sigma * (1 - 2 * tolerance)
    more = privacy.event_epsilon(matrix_dp_event(less, strategy, sampling, steps), DELTA,
                                  accountant)
    assert more > target                          # the smallest such sigma, to the tolerance


def test_identity_calibration_is_dp_sgd_calibration():
    steps = 10                 # q = 1: the RDP of a plain Gaussian is closed-form, so this is fast
    sigma = matrix_noise_multiplier(3.0, DELTA, identity(steps), CyclicPoisson(1, 1.0), steps,
                                    accountant="rdp")
    assert sigma == privacy.noise_multiplier(target_epsilon=3.0, target_delta=DELTA,
                                             sample_rate=1.0, steps=steps, accountant="rdp")


@pytest.mark.parametrize("sampling", [CyclicPoisson(2, 0.1), MinSeparation(2, 3),
                                      BallsInBins(3)])
def test_no_noise_is_no_privacy(sampling):
    acc = MatrixAccountant(two_band(6), sampling, accountant="rdp")
    assert acc.get_epsilon(DELTA) == 0.0 and acc.dp_event() == dp_accounting.NoOpDpEvent()
    acc.step(noise_multiplier=0.0, n=6)
    assert acc.get_epsilon(DELTA) == math.inf
