"""dpfx.audit.run_steps: over a run of releases under each noise mechanism, a canary example in
every step of its participation moves the strategy-weighted releases (C times the t x P
releases, what the accountant's Gaussian mechanism is calibrated to) by at most the strategy's
sensitivity times C/D, each release by C/D, and no step it did not join. At sigma 0 through the
default backend (Inductor). Planted faults fail it: a release that does not clip, and a noise
state that keeps part of a clipped sum and adds it to a later release."""
import math

import pytest
import torch
import torch.nn as nn

import dpfx.audit as audit
from dpfx.loop import step_noise
from dpfx.privacy import strategies
from dpfx.privacy.matrix_accounting import BallsInBins, CyclicPoisson, MinSeparation

STEPS, BANDS, C, D = 8, 2, 0.05, 4

MECHANISMS = {
    "gaussian": lambda: strategies.gaussian(STEPS),
    "bandmf": lambda: strategies.bandmf(STEPS, BANDS),
    "bsr": lambda: strategies.bsr(STEPS, BANDS),
    "blt": lambda: strategies.blt(STEPS, 2, min_separation=BANDS),
}


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(3, 4, generator=g), torch.randint(0, 2, (3,), generator=g))
               for _ in range(STEPS)]
    return model, batches, (torch.full((4,), 20.0), torch.tensor(1))


def _audit(strategy, **kwargs):
    model, batches, canary = _setup()
    kwargs.setdefault("sampling", CyclicPoisson(BANDS, 1 / BANDS))
    return audit.run_steps(model, batches, canary, mechanism=strategy, max_grad_norm=C,
                           expected_batch_size=D, threads=1, **kwargs)


@pytest.mark.parametrize("kind", sorted(MECHANISMS))
def test_a_canary_moves_the_releases_by_at_most_the_sensitivity(kind):
    strategy = MECHANISMS[kind]()
    result = _audit(strategy)
    print(result)
    assert result.verdict.startswith("consistent"), str(result)
    k = STEPS // BANDS
    assert (result.separation, result.participations, result.placements) == (BANDS, k, BANDS)
    # the bound, computed independently: the earliest pattern's ||C u|| (these strategies' worst)
    u = torch.zeros(STEPS, dtype=torch.float64)
    u[::BANDS] = 1.0
    sens = float(torch.linalg.vector_norm(strategy.matrix() @ u))
    assert result.bound == pytest.approx(sens * C / D, rel=1e-9)
    # not vacuous: the canary was clipped in each of its steps (moved by C/D exactly) and the
    # earliest placement reaches the bound; without it nothing moved
    assert result.moved_per_step == pytest.approx(C / D, rel=1e-3)
    assert result.moved == pytest.approx(result.bound, rel=1e-3)
    assert result.moved_outside == 0
    if kind == "gaussian":
        assert result.sensitivity == pytest.approx(math.sqrt(k))
    else:
        assert result.worst_offset == 0


def test_a_release_that_does_not_clip_fails():
    result = _audit(strategies.bandmf(STEPS, BANDS), control="no-clip")
    assert result.moved_per_step > 10 * result.step_bound
    assert result.moved > result.bound
    assert result.verdict.startswith("VIOLATION"), str(result)
    assert "control no-clip" in str(result)


def test_a_noise_state_that_reads_the_clipped_sum_fails(monkeypatch):
    """The state keeps a tenth of each step's clipped sum and adds it to the next release: at
    sigma 0 the canary's gradient reaches a step it did not join."""
    add_noise = step_noise.StepNoise.add_release
    calls = []

    def leaky(self, flat, std):
        kept = getattr(self, "_planted", None)
        self._planted = flat.clone()
        add_noise(self, flat, std)
        if kept is not None:
            flat.add_(kept, alpha=0.1)
        calls.append(1)

    monkeypatch.setattr(step_noise.StepNoise, "add_release", leaky)
    result = _audit(strategies.blt(STEPS, 2, min_separation=BANDS))
    assert len(calls) == STEPS * (1 + BANDS)            # the planted state ran in every release
    assert result.moved_outside == pytest.approx(0.1 * C / D, rel=1e-3)
    assert result.verdict.startswith("VIOLATION")
    assert "did not join" in result.verdict


def test_the_schema_sets_the_placements():
    strategy = strategies.bandmf(STEPS, BANDS)
    wide = _audit(strategy, sampling=MinSeparation(4, 2))
    assert (wide.separation, wide.participations, wide.placements) == (4, 2, 4)
    assert wide.sensitivity == pytest.approx(strategy.sensitivity(4, 2))
    assert wide.verdict.startswith("consistent")
    bins = _audit(strategy, sampling=BallsInBins(4))    # separation 1, one per epoch: 2
    assert (bins.separation, bins.participations, bins.placements) == (1, 2, 1)
    assert bins.verdict.startswith("consistent")


def test_bad_arguments():
    model, batches, canary = _setup()
    strategy = strategies.bandmf(STEPS, BANDS)
    settings = dict(mechanism=strategy, max_grad_norm=C, expected_batch_size=D)
    with pytest.raises(ValueError, match="control"):
        audit.run_steps(model, batches, canary, control="sigma/10", **settings)
    with pytest.raises(ValueError, match="9 batches"):
        audit.run_steps(model, batches + batches[:1], canary, **settings)
    with pytest.raises(ValueError, match="drop noise"):
        audit.run_steps(model, batches, canary, noise="graph", **settings)
    with pytest.raises(ValueError, match="within max_grad_norm"):
        audit.run_steps(model, batches, (torch.zeros(4), torch.tensor(1)), **dict(
            settings, max_grad_norm=1e3))
    with pytest.raises(TypeError, match="strategies"):
        audit.run_steps(model, batches, canary, **dict(settings, mechanism="bandmf"))
