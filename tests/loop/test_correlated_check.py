"""The run-time check of correlated noise (Note [Checking the releases] in dpfx/loop/correlated.py):
with ``check_noise_every``, every checked release must be the clipped sum plus sigma * S * (C^{-1}
z)_t recomputed from the recorded draws with the dense C^{-1}. Planted faults, each caught as a
PrivacyError before the parameters move:

- a state whose update reads the gradient (the clipped sums);
- a skipped state update (the buffers left as they were for one step);
- a reused seed (the same draw z twice), and a draw scaled down (not standard normal).

And a correct state passes the check on each recursion kind, on the schedule it promises (the
first window + 1 steps, then every N-th).
"""
import pytest
import torch

import dpfx
from dpfx.errors import PrivacyError
from dpfx.loop import step_noise
from support import mf_strategy
from support.models import MLP, mse

KINDS = sorted(mf_strategy.ALL)
C, D = 0.3, 5


def _training(kind: str, steps: int = 12, every: int = 4):
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=1.5, expected_batch_size=D,
                      backend="eager", noise="optimizer")
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp,
                           mechanism=mf_strategy.ALL[kind](steps), check_noise_every=every)
    return model, dp, opt


def _steps(model, dp, opt, n: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        opt.zero_grad()
        mse(dp(torch.randn(6, 8, generator=g) * 3), torch.randn(6, 4, generator=g)).backward()
        opt.step()


def _caught(model, dp, opt, steps: int, match: str) -> None:
    """The fault is refused within ``steps`` steps, and the refused step moved nothing."""
    g = torch.Generator().manual_seed(1)
    for t in range(steps):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt.zero_grad()
        mse(dp(torch.randn(6, 8, generator=g) * 3), torch.randn(6, 4, generator=g)).backward()
        try:
            opt.step()
        except PrivacyError as e:
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
            assert match in str(e), str(e)
            return t
    pytest.fail(f"the planted fault was not caught in {steps} steps")


@pytest.mark.parametrize("kind", KINDS)
def test_a_correct_state_passes_on_the_promised_schedule(kind):
    model, dp, opt = _training(kind, steps=12, every=4)
    _steps(model, dp, opt, 12)
    first = opt._correlated.window + 1
    want = sum(1 for t in range(12) if t < first or t % 4 == 0)
    assert opt._check.checked == want, (opt._check.checked, want)


@pytest.mark.parametrize("kind", KINDS)
def test_a_state_that_reads_the_gradient_is_caught(kind):
    model, dp, opt = _training(kind)
    state, step = opt._correlated, opt._correlated.step

    def leaky(z):                       # w + a little of the clipped sums
        leak = torch.cat([dp.clipped_sums[n].reshape(-1) for n, _ in opt._named])
        return step(z) + 0.01 * leak

    state.step = leaky
    assert _caught(model, dp, opt, 3, "not the clipped sum plus the strategy's noise") == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_skipped_state_update_is_caught(kind):
    model, dp, opt = _training(kind)
    state, step = opt._correlated, opt._correlated.step

    def forgetful(z):                   # step 1 leaves the buffers as step 0 left them
        if state.t != 1:
            return step(z)
        kept = (state._buffers.clone(), list(state._dense))
        w = step(z)
        state._buffers.copy_(kept[0])
        state._dense[:] = kept[1]
        return w

    state.step = forgetful
    assert _caught(model, dp, opt, 4, "not the clipped sum plus the strategy's noise") == 2


def test_a_reused_seed_is_caught(monkeypatch):
    model, dp, opt = _training("blt2")
    draw = step_noise.gaussian
    monkeypatch.setattr(step_noise, "gaussian", lambda n, std, generator, **kw: draw(
        n, std, torch.Generator().manual_seed(9), **kw))      # re-seeded every step
    assert _caught(model, dp, opt, 3, "repeats step 0's") == 1


def test_a_draw_that_is_not_standard_normal_is_caught(monkeypatch):
    model, dp, opt = _training("toeplitz3")
    draw = step_noise.gaussian
    monkeypatch.setattr(step_noise, "gaussian", lambda *a, **kw: draw(*a, **kw) * 0.5)
    assert _caught(model, dp, opt, 2, "mean square") == 0


def test_the_check_carries_over_a_checkpoint():
    model, dp, opt = _training("dense", steps=6, every=1)
    _steps(model, dp, opt, 2)
    state = opt.state_dict()
    resumed = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp,
                               mechanism=opt.mechanism, check_noise_every=1)
    resumed.load_state_dict(state)
    _steps(model, dp, resumed, 3)
    assert resumed._check.checked == 3 and len(resumed._check._draws) == 5
