"""Adaptive clipping in the training loop (Note [Adaptive clipping] in dpfx/privacy/adaptive.py):
the noise of both releases at their scales, noised in the graph or by DPOptimizer; virtual
batches sum the count and noise it once, as one big batch; make_private threads the options."""
import math

import pytest
import torch
from torch.utils.data import TensorDataset

import dpfx
from support.models import MLP, mse
from support.noise_stats import assert_gaussian_scale, assert_noise_per_parameter


@pytest.mark.filterwarnings("ignore::dpfx.BatchSizeWarning")  # empty batches on purpose
@pytest.mark.parametrize("noise", ["graph", "optimizer"])
def test_the_gradient_noise_is_sigma_grad_c_t_and_the_count_noise_sigma_b(noise):
    """Empty batches, D = 8: p.grad is sigma_grad C_t / D times standard normals, at each step's
    own C_t; the count released is N(0, sigma_b^2), read back from the bound's move
    (log(C_{t+1} / C_t) = -eta (s_t / D + 1/2 - gamma))."""
    sigma, sigma_b, d, eta, gamma, steps = 1.0, 2.0, 8, 0.2, 0.5, 120
    model = MLP(8, 6, 3)
    dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=sigma,
                      count_noise_multiplier=sigma_b, expected_batch_size=d, backend="eager",
                      clipping="adaptive", clip_lr=eta, target_unclipped_quantile=gamma,
                      noise=noise)
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp)
    sigma_grad = dp.dp_config.grad_noise_multiplier
    draws = {n: [] for n, _ in model.named_parameters()}
    counts = []
    for _ in range(steps):
        c = dp.adaptive_clip.bound
        opt.zero_grad()
        (dp(torch.randn(0, 8)).sum() * 0.0).backward()
        opt.step()
        for n, p in model.named_parameters():
            draws[n].append(p.grad / c)     # standardized by the step's own bound
        counts.append(d * (gamma - 0.5 - math.log(dp.adaptive_clip.bound / c) / eta))
    assert_noise_per_parameter({n: torch.stack(v) for n, v in draws.items()},
                               sigma_grad / d)
    assert_gaussian_scale(torch.tensor(counts), sigma_b, "the count's noise")


def test_virtual_batches_move_the_bound_as_one_big_batch():
    """At sigma 0 a logical batch of 7 in physical batches of 3, 3, 1: one gradient and one bound
    move, equal to the step on the whole batch (the count summed, noised once)."""
    def run(chunks):
        torch.manual_seed(4)
        model = MLP()
        dp = dpfx.compile(model, max_grad_norm=0.3, noise_multiplier=0.0, backend="eager",
                          expected_batch_size=7, noise="optimizer", clipping="adaptive",
                          clip_lr=1.0)
        opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(7, 8, generator=g) * 2, torch.randn(7, 4, generator=g)
        opt.zero_grad()
        start = 0
        for i, n in enumerate(chunks):
            mse(dp(x[start:start + n]), y[start:start + n]).backward()
            start += n
            opt.signal_skip_step(i < len(chunks) - 1)
            opt.step()
        return {k: p.grad.clone() for k, p in model.named_parameters()}, dp.adaptive_clip

    whole, state = run([7])
    split, split_state = run([3, 3, 1])
    assert state.steps == split_state.steps == 1
    assert split_state.bound == pytest.approx(state.bound, rel=1e-12) and state.bound != 0.3
    for k in whole:
        torch.testing.assert_close(split[k], whole[k], rtol=1e-5, atol=1e-7)


def test_make_private_threads_adaptive_clipping():
    model = MLP()
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 4))
    run = dpfx.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                            max_grad_norm=0.1, noise_multiplier=1.0, batch_size=16,
                            backend="eager", clipping="adaptive", target_unclipped_quantile=0.8,
                            clip_lr=0.3, count_noise_multiplier=16 / 20 + 0.6,
                            max_physical_batch_size=8)
    config = run.model.dp_config
    assert (config.clipping, config.target_unclipped_quantile, config.clip_lr) == \
        ("adaptive", 0.8, 0.3)
    for x, y in run.loader:
        run.optimizer.zero_grad()
        mse(run.model(x), y).backward()
        run.optimizer.step()
    assert run.model.adaptive_clip.steps == run.optimizer.steps > 0
    assert run.model.adaptive_clip.bound != 0.1
    assert run.accountant.steps == run.optimizer.steps
