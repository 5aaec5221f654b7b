"""dpfx.report.RunHistory: the figure it writes draws the values the run recorded.

The clipped fraction is compared with the share of examples whose gradient norm, from the
torch.func reference, exceeds C, at a bound that clips some examples and not others; epsilon
with dpfx.privacy.epsilon for the steps taken; the adaptive bound with ``adaptive_clip.bound``
read after each step.
"""
import pytest
import torch

import dpfx
from dpfx.report.history import NOT_PRIVATE
from support.models import MLP, mse
from support.reference import bound_that_bites, per_example_grads, per_example_norms

EPSILON = "epsilon (delta=1e-05)"


def _optimizer(dp, model, accountant):
    return dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), dp,
                            accountant=accountant, sample_rate=0.1)


def _step(opt, dp, x, y, history):
    opt.zero_grad()
    mse(dp(x), y).backward()
    opt.step()
    history.record()


def test_the_figure_draws_epsilon_and_the_clipped_fraction_recorded(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    batches = [(torch.randn(8, 8), torch.randn(8, 4)) for _ in range(3)]
    bound = bound_that_bites(per_example_norms(per_example_grads(model, mse, *batches[0])))
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=1.0, track_norms=True)
    accountant = dpfx.privacy.Accountant()
    history = dpfx.report.RunHistory(dp, accountant, delta=1e-5)
    opt, want = _optimizer(dp, model, accountant), []
    for x, y in batches:      # the reference's norms at the parameters the step sees
        norms = per_example_norms(per_example_grads(model, mse, x, y))
        want.append(float((norms > bound).float().mean()))
        _step(opt, dp, x, y, history)
    assert any(0 < w < 1 for w in want), "the bound must clip some examples and not others"

    path = tmp_path / "run.png"
    drawn = history.plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(drawn) == [EPSILON, NOT_PRIVATE]          # a flat bound is no series
    steps, eps = drawn[EPSILON]
    assert steps == [1, 2, 3]
    assert eps == pytest.approx([dpfx.privacy.epsilon(noise_multiplier=1.0, sample_rate=0.1,
                                                      steps=int(k), delta=1e-5) for k in steps])
    assert drawn[NOT_PRIVATE] == ([1, 2, 3], pytest.approx(want))


def test_the_figure_draws_the_adaptive_bound_after_each_step(tmp_path):
    """The bound is read, not computed; the clipped fraction of each step is against C_t, the
    bound that step clipped to (not the initial max_grad_norm)."""
    torch.manual_seed(1)
    model = MLP()
    batches = [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(3)]
    initial = bound_that_bites(per_example_norms(per_example_grads(model, mse, *batches[0])))
    dp = dpfx.compile(model, max_grad_norm=initial, noise_multiplier=1.0, clipping="adaptive",
                      count_noise_multiplier=1.0, expected_batch_size=16, clip_lr=3.0,
                      target_unclipped_quantile=0.9, track_norms=True)
    accountant = dpfx.privacy.Accountant()
    history = dpfx.report.RunHistory(dp, accountant, delta=1e-5)
    opt, bounds, want, at_initial = _optimizer(dp, model, accountant), [], [], []
    for x, y in batches:
        norms = per_example_norms(per_example_grads(model, mse, x, y))
        want.append(float((norms > dp.adaptive_clip.bound).float().mean()))
        at_initial.append(float((norms > initial).float().mean()))
        _step(opt, dp, x, y, history)
        bounds.append(dp.adaptive_clip.bound)
    assert len(set(bounds)) == 3, "the bound must move"
    assert want != at_initial, "C_t must clip another share than the initial bound would"

    drawn = history.plot(str(tmp_path / "run.png"), points=2)
    assert list(drawn) == [EPSILON, NOT_PRIVATE, "adaptive clipping bound C"]
    assert drawn["adaptive clipping bound C"] == ([1, 2, 3], pytest.approx(bounds))
    assert drawn[NOT_PRIVATE] == ([1, 2, 3], pytest.approx(want))
    assert drawn[EPSILON][0] == [1, 3]                    # two points: the first and the last


def test_nothing_recorded_is_refused(tmp_path):
    dp = dpfx.compile(MLP(), max_grad_norm=1.0, noise_multiplier=1.0, backend="eager")
    history = dpfx.report.RunHistory(dp, dpfx.privacy.Accountant(), delta=1e-5)
    with pytest.raises(ValueError, match="call record"):
        history.plot(str(tmp_path / "run.png"))
