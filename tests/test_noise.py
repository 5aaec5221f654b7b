"""The Gaussian noise: std sigma*C/D on every coordinate, mean 0, fresh each step, reproducible with
a seed. The tolerances reject the plausible wrong formulas (sigma*C, sigma*C/sqrt(D), noise added
per example, noise on the per-sample gradients before the sum)."""
import math

import pytest
import torch

import dpfx
from models import MLP, mse
from reference import dp_sgd_grads, run_dpfx

SIGMA, C, D = 4.0, 0.5, 8


def _flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads.values()])


def _noise_samples(backend: str, steps: int, seed=None):
    model = MLP(8, 32, 4)  # 420 parameters
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=D,
                      seed=seed, backend=backend)
    clean = _flat(dp_sgd_grads(model, mse, x, y, max_grad_norm=C, expected_batch_size=D))
    return torch.stack([_flat(run_dpfx(dp, model, mse, x, y)) - clean for _ in range(steps)])


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_noise_statistics(backend):
    noise = _noise_samples(backend, steps=10)
    n = noise.numel()
    expected_std = SIGMA * C / D
    assert abs(noise.mean().item()) < 5 * expected_std / math.sqrt(n)
    # n = 4200 draws: the std estimate is within ~1.1% (1 sigma); 5% rejects sqrt(D) or any
    # factor-of-two mistake.
    assert noise.std().item() == pytest.approx(expected_std, rel=0.05)
    # Fresh every step: consecutive steps are uncorrelated.
    corr = torch.corrcoef(torch.stack([noise[0], noise[1]]))[0, 1]
    assert abs(corr.item()) < 5 / math.sqrt(noise.shape[1])
    # Gaussian: the fraction beyond 2 std is about 4.55%.
    tail = (noise.abs() > 2 * expected_std).float().mean().item()
    assert tail == pytest.approx(0.0455, abs=0.012)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_seed_reproducible(backend):
    a = _noise_samples(backend, steps=2, seed=123)
    b = _noise_samples(backend, steps=2, seed=123)
    c = _noise_samples(backend, steps=2, seed=124)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a[0], a[1])  # different each step
    assert not torch.allclose(a, c)


def test_unseeded_noise_is_not_predictable_from_torch_manual_seed():
    """torch's default generator starts from a fixed seed in every process; unseeded noise must
    not replay from it (backend.py, Note [Where the graph's noise seed comes from])."""
    torch.manual_seed(7)
    a = _noise_samples("eager", steps=1)
    torch.manual_seed(7)
    b = _noise_samples("eager", steps=1)
    assert not torch.allclose(a, b)
    # ... and the user's own random stream is untouched by the noise draws.
    torch.manual_seed(7)
    _noise_samples("eager", steps=1)
    model_init_draws = torch.rand(3)   # MLP init and the data consumed the stream first
    torch.manual_seed(7)
    MLP(8, 32, 4), torch.randn(6, 8), torch.randn(6, 4)
    torch.testing.assert_close(model_init_draws, torch.rand(3))


def test_empty_batch_gives_noise_over_expected_batch_size():
    """Poisson sampling yields empty batches; the step is then pure noise / D."""
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=D,
                      backend="eager")
    grads = torch.stack([_flat(run_dpfx(dp, model, mse, torch.randn(0, 8), torch.randn(0, 4)))
                         for _ in range(5)])
    assert grads.std().item() == pytest.approx(SIGMA * C / D, rel=0.08)
