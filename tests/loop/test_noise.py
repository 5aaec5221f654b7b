"""The Gaussian noise: std sigma*C/D on every coordinate, mean 0, fresh each step, reproducible with
a seed. Each parameter's slice is tested on its own and in the pool, seeded, at 5 standard errors
(tests/support/noise_stats.py): that rejects a wrong scale on one 3-entry bias, an error of 5% on
all (and the plausible wrong formulas: sigma*C, sigma*C/sqrt(D), noise added per example)."""
import math

import pytest
import torch

import dpfx
from dpfx.passes import clip_noise
from support.models import MLP, mse
from support.noise_stats import (assert_gaussian_scale, assert_noise_per_parameter,
                                 assert_uncorrelated, detectable_std_error)
from support.reference import clip_fraction, dp_sgd_grads, run_dpfx

SIGMA, C, D = 4.0, 0.5, 8


def _noise_draws(backend: str, steps: int, seed=None, tokens: tuple = ()) -> dict:
    """{name: (steps, *p.shape)}: the noise each step added to each parameter's gradient, on a
    batch of 6 (clipping bites) minus the sigma = 0 reference. fc2.bias has 3 entries. With
    ``tokens`` (extra input dims), the biases' per-sample gradients are sums over them: on CPU
    graphs one stacked base releases both (Note [Vector parameters' per-sample gradients
    stacked])."""
    model = MLP(8, 32, 3)  # 387 parameters
    x, y = torch.randn(6, *tokens, 8) * 3, torch.randn(6, *tokens, 3)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=D,
                      seed=seed, backend=backend)
    clean = dp_sgd_grads(model, mse, x, y, max_grad_norm=C, expected_batch_size=D)
    assert clip_fraction(model, mse, x, y, C) == 1.0
    runs = [run_dpfx(dp, model, mse, x, y) for _ in range(steps)]
    if tokens and clip_noise.NOISE_IN_PLACE:
        private = dp._dpfx_backend.last_backward.private
        assert private["fc1.bias"].target is private["fc2.bias"].target is \
            torch.ops.aten.slice.Tensor
    return {k: torch.stack([r[k] for r in runs]) - clean[k] for k in clean}


def _noise_samples(backend: str, steps: int, seed=None) -> torch.Tensor:
    draws = _noise_draws(backend, steps, seed)
    return torch.cat([d.flatten(1) for d in draws.values()], 1)


@pytest.mark.parametrize("release", ["in_place", "expression", "in_place_stacked"])
@pytest.mark.parametrize("backend,steps", [("eager", 40), ("inductor", 100)])
def test_noise_statistics_per_parameter(backend, steps, release, monkeypatch):
    """Each parameter's noise on its own (the 3-entry bias included) has mean 0 and std
    sigma*C/D within 5 standard errors, and so has the pool; steps are uncorrelated, and so are
    two parameters' entries at the same positions (dpfx::add_noise_ gives each its own Philox
    stream under one key); the tails are Gaussian. Seeded: deterministic. Both releases: the
    CPU graphs' dpfx::add_noise_, and the GPU graphs' slices of one draw (built here on CPU);
    and the CPU release of stacked vector parameters (the two biases: slices of one noised
    base, so their entries at the same positions must still be uncorrelated)."""
    if release == "expression":
        monkeypatch.setattr(clip_noise, "NOISE_IN_PLACE", set())
    draws = _noise_draws(backend, steps, seed=2024,
                         tokens=(4,) if release == "in_place_stacked" else ())
    expected_std = SIGMA * C / D
    # The resolution this buys: halving one small parameter's noise, or a 5% error on all.
    assert detectable_std_error(draws["fc2.bias"].numel()) < 0.5
    assert detectable_std_error(sum(d.numel() for d in draws.values())) < 0.05
    assert_noise_per_parameter(draws, expected_std)
    noise = torch.cat([d.flatten(1) for d in draws.values()], 1)
    _assert_fresh_and_independent(draws, noise)
    # Gaussian: P(|z| > 2) = 0.0455, within 5 binomial standard errors.
    n = noise.numel()
    tail = (noise.abs() > 2 * expected_std).double().mean().item()
    assert abs(tail - 0.0455) < 5 * math.sqrt(0.0455 * 0.9545 / n)


@pytest.mark.parametrize("path", ["in_place", "flat"])
def test_noise_at_the_optimizer_per_parameter(path, monkeypatch):
    """``noise="optimizer"``: DPOptimizer's noise, as the graph's above, on each parameter and
    pooled, fresh each step, independent between parameters, Gaussian tails; added where each
    clipped sum lies (one process on the CPU) or into the flat buffer several ranks reduce."""
    if path == "flat":
        monkeypatch.setattr(dpfx.loop.grads.GradWriter, "_write_in_place", lambda *args: False)
    model = MLP(8, 32, 3)
    x, y = torch.randn(6, 8) * 3, torch.randn(6, 3)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=D,
                      seed=2024, backend="eager", noise="optimizer")
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp)  # the same weights
    clean = dp_sgd_grads(model, mse, x, y, max_grad_norm=C, expected_batch_size=D)
    runs = []
    for _ in range(60):
        opt.zero_grad()
        mse(dp(x), y).backward()
        opt.step()
        runs.append({k: p.grad.clone() for k, p in model.named_parameters()})
    draws = {k: torch.stack([r[k] for r in runs]) - clean[k] for k in clean}
    expected_std = SIGMA * C / D
    assert_noise_per_parameter(draws, expected_std)
    noise = torch.cat([d.flatten(1) for d in draws.values()], 1)
    _assert_fresh_and_independent(draws, noise)
    tail = (noise.abs() > 2 * expected_std).double().mean().item()
    assert abs(tail - 0.0455) < 5 * math.sqrt(0.0455 * 0.9545 / noise.numel())


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_seed_reproducible(backend):
    a = _noise_samples(backend, steps=2, seed=123)
    b = _noise_samples(backend, steps=2, seed=123)
    c = _noise_samples(backend, steps=2, seed=124)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a[0], a[1])  # different each step
    assert not torch.allclose(a, c)

def _assert_fresh_and_independent(draws: dict, noise: torch.Tensor) -> None:
    """Fresh every step (each step's draw uncorrelated with the next one) and independent
    across parameters (the MLP's two biases, its two weights)."""
    assert_uncorrelated(noise[:-1], noise[1:], "consecutive steps")
    assert_uncorrelated(draws["fc1.bias"][:, :3], draws["fc2.bias"], "fc1.bias and fc2.bias")
    assert_uncorrelated(draws["fc1.weight"].flatten(1)[:, :96],
                        draws["fc2.weight"].flatten(1)[:, :96], "fc1.weight and fc2.weight")



def test_unseeded_noise_is_not_predictable_from_torch_manual_seed():
    """torch's default generator starts from a fixed seed in every process; unseeded noise must
    not replay from it (backend/runtime.py, Note [Where the graph's noise seed comes from])."""
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
    MLP(8, 32, 3), torch.randn(6, 8), torch.randn(6, 3)
    torch.testing.assert_close(model_init_draws, torch.rand(3))


@pytest.mark.filterwarnings("ignore::dpfx.BatchSizeWarning")  # empty batches on purpose
def test_empty_batch_gives_noise_over_expected_batch_size():
    """Poisson sampling yields empty batches; the step is then pure noise / D, on every
    parameter (fc2.bias: 4 entries)."""
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=D,
                      backend="eager", seed=5)
    runs = [run_dpfx(dp, model, mse, torch.randn(0, 8), torch.randn(0, 4)) for _ in range(30)]
    assert_noise_per_parameter({k: torch.stack([r[k] for r in runs]) for k in runs[0]},
                               SIGMA * C / D)


def test_a_generator_state_from_another_device_type_is_refused():
    """A seeded run's optimizer noise generator is the parameters' device's (Philox on CUDA,
    cpu_noise's key on the CPU); its state cannot load into another kind, and seeding afresh would
    repeat the noise of earlier steps: the load is refused before anything changes."""
    torch.manual_seed(0)
    model = MLP(4, 8, 2)
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4,
                      seed=3, noise="optimizer", backend="eager")
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp)
    state = opt.state_dict()
    assert state["generator_device"] == "cpu" and state["generator"] is not None
    before = opt._generator.get_state()
    with pytest.raises(ValueError, match="noise generator ran on cuda.*Resume on a cuda device"):
        opt.load_state_dict({**state, "generator_device": "cuda",
                             "generator": torch.zeros(16, dtype=torch.uint8)})
    assert torch.equal(opt._generator.get_state(), before)
    legacy = {k: v for k, v in state.items() if k != "generator_device"}   # saved as "cpu"
    opt.load_state_dict(legacy)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_add_gaussian_in_place(layout):
    """noise.add_gaussian_ adds N(0, std^2) to every entry where the tensor lies, seeded by its
    generator: the kernel's in-place pass, or (a layout it cannot take) a buffer of normals."""
    from dpfx.loop.noise import add_gaussian_
    x = torch.full((300, 200), 5.0)
    x = x if layout == "contiguous" else x.t()
    before = x.data_ptr()
    add_gaussian_(x, 2.0, torch.Generator().manual_seed(1))
    assert x.data_ptr() == before
    assert_gaussian_scale(x - 5.0, 2.0, f"a {layout} tensor's noise")
    again = torch.full((300, 200), 5.0)
    again = again if layout == "contiguous" else again.t()
    add_gaussian_(again, 2.0, torch.Generator().manual_seed(1))
    assert torch.equal(x, again)
