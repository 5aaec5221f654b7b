"""The auditor's test of a correlated-noise run: one canary example added to every step of its
part moves the stacked releases, mapped into the strategy's space (C times the n x P releases),
by at most the strategy's sensitivity over its participations times C/D: the quantity the
accountant's Gaussian mechanism is calibrated to. At sigma 0 through the default backend, with
the canary's gradient clipped."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from dpfx.privacy import strategies

STEPS, BANDS, C, D = 8, 2, 0.05, 4


def _releases(strategy, with_canary: bool) -> torch.Tensor:
    """(steps, P): every step's released gradient, the canary joining steps 1, 3, 5, 7 (its
    part's, BANDS apart)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(3, 4, generator=g), torch.randint(0, 2, (3,), generator=g))
               for _ in range(STEPS)]
    canary = (torch.full((1, 4), 20.0), torch.tensor([1]))
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, noise="optimizer",
                      expected_batch_size=D)
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp, mechanism=strategy)
    out = []
    for t, (x, y) in enumerate(batches):
        if with_canary and t % BANDS == 1:
            x, y = torch.cat([x, canary[0]]), torch.cat([y, canary[1]])
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(dp(x), y).backward()
        opt.step()
        out.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return torch.stack(out).double()


@pytest.mark.filterwarnings("ignore::dpfx.NoNoiseWarning")
@pytest.mark.parametrize("make", [lambda: strategies.bandmf(STEPS, BANDS),
                                  lambda: strategies.bsr(STEPS, BANDS),
                                  lambda: strategies.blt(STEPS, 2, min_separation=BANDS)])
def test_a_canary_moves_the_releases_by_at_most_the_sensitivity(make):
    strategy = make()
    moved = _releases(strategy, True) - _releases(strategy, False)
    participations = STEPS // BANDS
    bound = strategy.sensitivity(BANDS, participations) * C / D
    in_strategy_space = torch.linalg.matrix_norm(strategy.matrix() @ moved)
    assert in_strategy_space <= bound * (1 + 1e-4)
    # the canary was clipped in each of its steps: it moved each of them by C/D exactly
    per_step = moved.norm(dim=1)
    assert torch.allclose(per_step[1::BANDS], torch.full((participations,), C / D, dtype=torch.float64),
                          rtol=1e-3)
    assert per_step[0::BANDS].max() == 0
