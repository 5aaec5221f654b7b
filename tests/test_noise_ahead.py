"""Unseeded graph noise is drawn one step ahead on a background thread (Note [Drawing the noise
ahead] in dpfx/noise_ahead.py): every buffer is used once, the noise keeps its distribution and
is fresh each step, and seeded runs and the self-check draw in place."""
import pytest
import torch

import dpfx
from dpfx import cpu_noise, noise_ahead
from models import MLP, mse
from noise_stats import assert_noise_per_parameter, assert_uncorrelated
from reference import clip_fraction, dp_sgd_grads, run_dpfx

pytestmark = pytest.mark.skipif(not cpu_noise.available(), reason="no C compiler for the kernel")

SIGMA, C, D = 4.0, 0.5, 8
SIZE = 8 * 32 + 32 + 32 * 3 + 3       # MLP(8, 32, 3): 387 parameters, one noise draw a step


def _draws(backend: str, steps: int, seed=None) -> dict:
    model = MLP(8, 32, 3)
    x, y = torch.randn(6, 8) * 3, torch.randn(6, 3)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=D,
                      backend=backend, seed=seed)
    clean = dp_sgd_grads(model, mse, x, y, max_grad_norm=C, expected_batch_size=D)
    assert clip_fraction(model, mse, x, y, C) == 1.0
    runs = [run_dpfx(dp, model, mse, x, y) for _ in range(steps)]
    return {k: torch.stack([r[k] for r in runs]) - clean[k] for k in clean}


@pytest.mark.parametrize("backend,steps", [("eager", 40), ("inductor", 60)])
def test_noise_drawn_ahead_is_fresh_and_gaussian(backend, steps, monkeypatch):
    """Unseeded: each step takes the buffer drawn during the step before (counted), and the
    noise per parameter has std sigma*C/D, consecutive steps uncorrelated (a buffer handed out
    twice makes two steps' noise equal)."""
    taken = []
    take = noise_ahead.take

    def counting_take(n):
        z = take(n)
        taken.append(z)
        return z

    monkeypatch.setattr(noise_ahead, "take", counting_take)
    draws = _draws(backend, steps)
    assert len(taken) == steps and all(z.numel() == SIZE for z in taken)
    assert len({id(z) for z in taken}) == steps          # a fresh buffer every step
    assert SIZE in noise_ahead._wanted                   # the next forward will queue one
    assert_noise_per_parameter(draws, SIGMA * C / D)
    noise = torch.cat([d.flatten(1) for d in draws.values()], 1)
    assert_uncorrelated(noise[:-1], noise[1:], "consecutive steps")


def test_seeded_runs_draw_in_place(monkeypatch):
    """A seeded run's noise is a function of the seed (checkpoints restore it): nothing is taken
    from the buffers drawn ahead."""
    monkeypatch.setattr(noise_ahead, "take", lambda n: pytest.fail("seeded run drew ahead"))
    a = _draws("inductor", 2, seed=11)
    b = _draws("inductor", 2, seed=11)
    for k in a:
        torch.testing.assert_close(a[k], b[k])


def test_buffers_are_queued_by_the_next_forward(monkeypatch):
    """A backward records the sizes it took; the next training forward queues them (never the
    backward itself: a buffer held from then on would sit beside the step's gradients), and a
    different noise size gets its own buffer. The backward after takes what was queued."""
    started = []
    monkeypatch.setattr(noise_ahead, "_wanted", set())
    monkeypatch.setattr(noise_ahead, "_start", lambda n: started.append(n))
    with noise_ahead.serving():
        z1 = noise_ahead.take(5)
        z2 = noise_ahead.take(7)
    assert started == [] and z1.shape == (5,) and z2.shape == (7,)
    assert not noise_ahead.active()
    model = MLP(8, 32, 3)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=D,
                      backend="eager")
    dp(torch.randn(4, 8))
    assert sorted(started) == [5, 7]
