"""The optimizer side of DP-SGD: per-layer clipping, noise at the optimizer, virtual batches,
secure noise, norm tracking and make_private (checkpoints: api/test_training_checkpoint.py). Every
gradient is compared with the independent torch.func reference (tests/support/reference.py),
per-layer clipping included."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils.data import DataLoader, TensorDataset

import dpfx
from dpfx.loop.noise import secure_standard_normal
from support.models import MLP, SeqModel, mse
from support.noise_stats import (assert_noise_per_parameter, assert_uncorrelated,
                                 detectable_std_error)
from support.reference import assert_close, clip_fraction, dp_sgd_grads, per_example_grads
from support.sweep import examples


def _backward(dp, x, y, loss_reduction="mean"):
    out = dp(x)
    if x.shape[0] == 0:
        loss = out.sum() * 0.0
    else:
        per_example = ((out - y) ** 2).flatten(1).mean(1)
        loss = per_example.mean() if loss_reduction == "mean" else per_example.sum()
    loss.backward()


def _grads(model):
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.requires_grad}


# -- per-layer clipping ----------------------------------------------------------------------------

@settings(max_examples=examples(12), deadline=None)
@given(batch=st.integers(0, 6), reduction=st.sampled_from(["mean", "sum"]),
       strategy=st.sampled_from(["materialize", "ghost"]),
       bounds=st.sampled_from([{"fc1": 0.05, "fc2": 0.3}, {"": 0.1, "fc2.bias": 0.02},
                               {"fc1.weight": 0.2, "fc1.bias": 0.01, "fc2": 0.05}]))
def test_per_layer_clipping_matches_reference(batch, reduction, strategy, bounds):
    torch._dynamo.reset()
    torch.manual_seed(batch)
    model = MLP(8, 16, 4)
    x, y = torch.randn(batch, 8) * 3, torch.randn(batch, 4)
    dp = dpfx.compile(model, max_grad_norm=bounds, noise_multiplier=0.0, backend="eager",
                      loss_reduction=reduction, strategy=strategy, expected_batch_size=4)
    model.zero_grad(set_to_none=True)
    _backward(dp, x, y, reduction)
    want = dp_sgd_grads(model, mse, x, y, max_grad_norm=bounds, loss_reduction=reduction,
                        expected_batch_size=4)
    assert_close(_grads(model), want)
    flat = dp_sgd_grads(model, mse, x, y, max_grad_norm=min(bounds.values()),
                        loss_reduction=reduction, expected_batch_size=4)
    if batch > 1:   # the groups really are clipped separately: flat clipping differs
        assert any(not torch.allclose(_grads(model)[k], flat[k], atol=1e-6) for k in flat)


def test_per_layer_noise_std_is_sigma_times_total_bound():
    model = MLP(8, 32, 4)
    bounds = {"fc1": 0.3, "fc2": 0.4}          # sqrt(0.09 + 0.16) = 0.5
    # seed: ~420 normals estimate the std to ~3.4%, so an OS-seeded draw failed 6% now and then.
    dp = dpfx.compile(model, max_grad_norm=bounds, noise_multiplier=2.0, backend="eager",
                      expected_batch_size=1, seed=0)
    assert dp.dp_config.noise_std == pytest.approx(1.0)
    model.zero_grad(set_to_none=True)
    _backward(dp, torch.randn(0, 8), torch.randn(0, 4))
    noise = torch.cat([g.flatten() for g in _grads(model).values()])
    assert noise.std().item() == pytest.approx(1.0, rel=0.06)


def test_per_layer_clipping_through_inductor_with_norm_tracking():
    model = SeqModel()
    bounds = {"proj": 0.05, "head": 0.1, "": 0.02}
    x, y = torch.randn(5, 6, 8) * 2, torch.randn(5, 4)
    dp = dpfx.compile(model, max_grad_norm=bounds, noise_multiplier=0.0, track_norms=True)
    model.zero_grad(set_to_none=True)
    _backward(dp, x, y)
    assert_close(_grads(model), dp_sgd_grads(model, mse, x, y, max_grad_norm=bounds),
                 rtol=1e-4, atol=1e-5)
    g = per_example_grads(model, mse, x, y)
    last = dp.norm_stats.last
    assert set(last) == {"proj", "head", ""}
    head = torch.sqrt(g["head.weight"].flatten(1).pow(2).sum(1) + g["head.bias"].pow(2).sum(1))
    torch.testing.assert_close(last["head"], head, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bounds,match", [
    ({"fc3": 1.0, "": 1.0}, "match no trainable parameter"),
    ({"fc1": 1.0}, "'fc2.weight' matches no per-layer key"),
    ({"fc1": -1.0, "fc2": 1.0}, r"max_grad_norm\['fc1'\] must be finite and > 0"),
    ({}, "at least one entry"),
    ((1.0, 2.0), r"per-layer \(name prefix, C\) pairs \(a dict\), got the entry 1\.0"),
])
def test_per_layer_bad_keys(bounds, match):
    with pytest.raises(ValueError, match=match):
        dpfx.compile(MLP(), max_grad_norm=bounds, noise_multiplier=1.0)


# -- norm tracking ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_norm_stats_match_reference(backend):
    model = MLP(8, 16, 4)
    dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=1.0, backend=backend,
                      track_norms=True, expected_batch_size=5)
    seen = []
    for batch in (7, 0, 3):
        x, y = torch.randn(batch, 8) * 2, torch.randn(batch, 4)
        model.zero_grad(set_to_none=True)
        _backward(dp, x, y)
        if batch:
            g = per_example_grads(model, mse, x, y)
            want = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
            torch.testing.assert_close(dp.norm_stats.last[""], want, rtol=1e-4, atol=1e-5)
            assert dp.norm_stats.clipped_fraction == pytest.approx(
                clip_fraction(model, mse, x, y, 0.5))
            seen.append(want)
        else:
            assert dp.norm_stats.last[""].shape == (0,)
            assert math.isnan(dp.norm_stats.clipped_fraction)
    everything = torch.cat(seen)
    assert dp.norm_stats.examples == 10
    assert dp.norm_stats.total_clipped_fraction == pytest.approx(
        float((everything > 0.5).float().mean()))
    torch.testing.assert_close(dp.norm_stats.quantiles([0.5]),
                               torch.quantile(everything, torch.tensor([0.5])), rtol=1e-4,
                               atol=1e-5)
    # printed, it reads as the numbers above
    text = repr(dp.norm_stats)
    median = float(torch.quantile(everything, 0.5))
    assert text.startswith("NormStats(passes=3 (window 100), examples=10, clipped: last=")
    assert f"total={100 * float((everything > 0.5).float().mean()):.1f}%" in text
    assert f"group '' (every parameter): C=0.5, norms p10=" in text
    assert f"p50={median:.4g}" in text and "object at" not in text


def test_no_norm_stats_by_default():
    dp = dpfx.compile(MLP(), max_grad_norm=1.0, noise_multiplier=1.0)
    assert dp.norm_stats is None


# -- noise at the optimizer ------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_optimizer_noise_sigma0_equals_graph_noise(backend):
    torch.manual_seed(1)
    model = MLP(8, 16, 4)
    x, y = torch.randn(6, 8) * 3, torch.randn(6, 4)
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=0.0, backend=backend,
                      noise="optimizer")
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    opt = dpfx.DPOptimizer(inner, dp)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt.zero_grad()
    _backward(dp, x, y)
    # Clipped but un-noised sums never sit in p.grad (Note [Clipped sums stay out of p.grad]).
    assert all(p.grad is None for p in model.parameters())
    assert dp.examples == 6
    want = dp_sgd_grads(model, mse, x, y, max_grad_norm=0.1)
    opt.step()
    assert_close(_grads(model), want, rtol=1e-4, atol=1e-6)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[k] - want[k], rtol=1e-4, atol=1e-6)
    assert dp.clipped_sums == {} and dp.examples == 0


def test_plain_optimizer_never_sees_unnoised_sums():
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, backend="eager",
                      noise="optimizer")
    plain = torch.optim.SGD(model.parameters(), lr=1.0)
    private = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), dp)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(dp, torch.randn(4, 8), torch.randn(4, 4))
    assert set(dp.clipped_sums) == {k for k, _ in model.named_parameters()}
    plain.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    # The positive control: the sums were there, and dpfx's optimizer applies them with noise.
    private.step()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_foreign_gradient_is_refused_at_step():
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, backend="eager",
                      noise="optimizer")
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), dp)
    _backward(dp, torch.randn(4, 8), torch.randn(4, 4))
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)   # e.g. a non-private backward
    with pytest.raises(dpfx.PrivacyError, match="fc1.weight"):
        opt.step()


@pytest.mark.filterwarnings("ignore::dpfx.BatchSizeWarning")   # empty batches: pure noise
def test_optimizer_noise_std_and_seed():
    """DPOptimizer's noise: each parameter's slice (fc2.bias: 3 entries) and the pool have mean 0
    and std sigma*C/D within 5 standard errors (tests/support/noise_stats.py); the seed replays
    it."""
    def noise(seed, steps):
        model = MLP(8, 32, 3)
        dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=4.0, backend="eager",
                          noise="optimizer", expected_batch_size=8, seed=seed)
        opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp)
        draws = {n: [] for n, _ in model.named_parameters()}
        for _ in range(steps):
            opt.zero_grad()
            _backward(dp, torch.randn(0, 8), torch.randn(0, 3))
            opt.step()
            for n, p in model.named_parameters():
                draws[n].append(p.grad.clone())
        return {n: torch.stack(d) for n, d in draws.items()}

    a, b = noise(5, 3), noise(5, 3)
    assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a["fc1.weight"][0], a["fc1.weight"][1])
    draws = noise(6, 40)
    assert detectable_std_error(draws["fc2.bias"].numel()) < 0.5
    assert detectable_std_error(sum(d.numel() for d in draws.values())) < 0.05
    assert_noise_per_parameter(draws, 4.0 * 0.5 / 8)
    flat = torch.cat([d.flatten(1) for d in draws.values()], 1)
    assert_uncorrelated(flat[:-1], flat[1:], "consecutive steps")


# -- virtual batches -------------------------------------------------------------------------------

@settings(max_examples=10, deadline=None)
@given(batch=st.integers(0, 9), physical=st.integers(1, 4),
       reduction=st.sampled_from(["mean", "sum"]), expected=st.sampled_from([None, 6]))
def test_virtual_batches_equal_one_big_batch(batch, physical, reduction, expected):
    if batch == 0 and expected is None and reduction == "mean":
        return
    torch._dynamo.reset()
    torch.manual_seed(batch)
    model = MLP(8, 16, 4)
    x, y = torch.randn(batch, 8) * 3, torch.randn(batch, 4)
    dp = dpfx.compile(model, max_grad_norm=0.2, noise_multiplier=0.0, backend="eager",
                      noise="optimizer", loss_reduction=reduction, expected_batch_size=expected)
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp)
    physical_sizes = []
    for cx, cy in dpfx.VirtualBatches([(x, y)], physical, opt):
        physical_sizes.append(cx.shape[0])
        opt.zero_grad()
        _backward(dp, cx, cy, reduction)
        opt.step()
    assert sum(physical_sizes) == batch and max(physical_sizes) <= physical
    assert opt.steps == 1
    want = dp_sgd_grads(model, mse, x, y, max_grad_norm=0.2, loss_reduction=reduction,
                        expected_batch_size=expected)
    assert_close(_grads(model), want, rtol=1e-4, atol=1e-6)


def test_virtual_batches_loader_and_noise_once_per_logical_step():
    model = MLP(8, 32, 4)
    sigma, c, d = 3.0, 0.5, 10
    dp = dpfx.compile(model, max_grad_norm=c, noise_multiplier=sigma, backend="eager",
                      noise="optimizer", expected_batch_size=d)
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp)
    x, y = torch.zeros(12, 8), torch.zeros(12, 4)
    model.fc2.weight.data.zero_(), model.fc2.bias.data.zero_()   # zero data gradient
    steps = 0
    noise = []
    for px, py in dpfx.VirtualBatches([(x, y)] * 6, 5, opt):     # 3 physical per logical
        opt.zero_grad()
        _backward(dp, px, py)
        if opt.step() is None and not opt._open:
            steps += 1
            noise.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert opt.steps == 6 == steps
    noise = torch.stack(noise)
    # sigma*C/D once per logical step, not sqrt(3) times that.
    assert noise.std().item() == pytest.approx(sigma * c / d, rel=0.06)


def test_virtual_batches_need_optimizer_noise():
    dp = dpfx.compile(MLP(), max_grad_norm=1.0, noise_multiplier=1.0)
    opt = dpfx.DPOptimizer(torch.optim.SGD(dp.parameters(), lr=0.1), dp)
    with pytest.raises(ValueError, match="noise='optimizer'"):
        opt.signal_skip_step()


# -- secure mode -----------------------------------------------------------------------------------

def test_secure_standard_normal_statistics():
    z = secure_standard_normal(200_000)
    assert z.dtype == torch.float64
    assert abs(z.mean().item()) < 5 / math.sqrt(z.numel())
    assert z.std().item() == pytest.approx(1.0, rel=0.01)
    # tails and shape: P(|z| > 2) = 0.0455, kurtosis 3
    assert (z.abs() > 2).double().mean().item() == pytest.approx(0.0455, abs=0.003)
    assert (z ** 4).mean().item() == pytest.approx(3.0, rel=0.05)
    assert not torch.equal(secure_standard_normal(8), secure_standard_normal(8))


@pytest.mark.filterwarnings("ignore::dpfx.BatchSizeWarning")   # empty batches: pure noise
def test_secure_mode_noise_and_refusals():
    model = MLP(8, 32, 4)
    dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=4.0, backend="eager",
                      noise="optimizer", expected_batch_size=8)
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp, secure_mode=True)
    draws = {n: [] for n, _ in model.named_parameters()}
    for _ in range(20):
        opt.zero_grad()
        _backward(dp, torch.randn(0, 8), torch.randn(0, 4))
        opt.step()
        for n, p in model.named_parameters():
            draws[n].append(p.grad.clone())
    draws = {n: torch.stack(d) for n, d in draws.items()}
    # Unseedable by design, so the 5-standard-error tolerance is what keeps it from flaking.
    assert_noise_per_parameter(draws, 0.25)
    assert not torch.allclose(draws["fc1.weight"][0], draws["fc1.weight"][1])

    seeded = dpfx.compile(MLP(), max_grad_norm=1.0, noise_multiplier=1.0, noise="optimizer",
                          seed=3)
    with pytest.raises(ValueError, match="refuses a fixed seed"):
        dpfx.DPOptimizer(torch.optim.SGD(seeded.parameters(), lr=0.1), seeded, secure_mode=True)
    graph = dpfx.compile(MLP(), max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="noise='optimizer'"):
        dpfx.DPOptimizer(torch.optim.SGD(graph.parameters(), lr=0.1), graph, secure_mode=True)


# -- make_private ----------------------------------------------------------------------------------

def _dataset(n=200):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))


def _train(private, epochs=1):
    dp_model, opt, loader, acc = private
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            _backward(dp_model, x, y)
            opt.step()


def test_make_private_wiring():
    model = MLP()
    data = _dataset()
    private = dpfx.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                                batch_size=20, max_grad_norm=1.0, noise_multiplier=1.3,
                                backend="eager")
    assert private.sample_rate == pytest.approx(0.1) and private.steps_per_epoch == 10
    assert private.model.dp_config.expected_batch_size == 20
    assert private.model.dp_config.noise == "graph"
    assert len(private.loader) == 10
    _train(private)
    assert private.accountant.steps == 10
    assert private.model.compile_count == 2        # one forward + one backward for every size
    assert private.accountant.get_epsilon(1e-5) == pytest.approx(dpfx.privacy.epsilon(
        noise_multiplier=1.3, sample_rate=0.1, steps=10, delta=1e-5))


def test_make_private_with_epsilon_spends_the_budget():
    model = MLP()
    data = _dataset()
    private = dpfx.make_private_with_epsilon(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=40,
        target_epsilon=4.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0, backend="eager")
    _train(private, epochs=2)
    assert private.accountant.steps == 10
    eps = private.accountant.get_epsilon(1e-5)
    assert eps <= 4.0 and eps == pytest.approx(4.0, rel=0.02)


def test_make_private_from_dataloader_with_virtual_batches_and_secure_noise():
    model = MLP()
    loader = DataLoader(_dataset(), batch_size=50, shuffle=True)
    private = dpfx.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                                max_grad_norm=1.0, noise_multiplier=1.0,
                                max_physical_batch_size=16, secure_mode=True, backend="eager")
    assert private.model.dp_config.noise == "optimizer"
    assert private.model.dp_config.expected_batch_size == 50
    sizes = []
    for x, y in private.loader:
        assert x.shape[0] <= 16
        sizes.append(x.shape[0])
        private.optimizer.zero_grad()
        _backward(private.model, x, y)
        private.optimizer.step()
    assert private.accountant.steps == private.optimizer.steps == 4
    assert len(sizes) >= 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(noise_multiplier=1.0), "exactly one of batch_size"),
    (dict(batch_size=10), "exactly one of noise_multiplier or target_epsilon"),
    (dict(batch_size=10, noise_multiplier=1.0, target_epsilon=1.0), "exactly one of noise"),
    (dict(batch_size=10, target_epsilon=1.0), "target_delta and epochs"),
    (dict(batch_size=0, noise_multiplier=1.0), "batch_size must be an int"),
    (dict(sample_rate=1.5, noise_multiplier=1.0), "sample_rate"),
    (dict(batch_size=10, noise_multiplier=-1.0), "noise_multiplier"),
    (dict(batch_size=10, target_epsilon=1e-6, target_delta=1e-5, epochs=1), "epsilon"),
    (dict(batch_size=10, target_epsilon=1.0, target_delta=2.0, epochs=1), "delta"),
])
def test_make_private_bad_input(kwargs, match):
    model = MLP()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        dpfx.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), _dataset(),
                          max_grad_norm=1.0, **kwargs)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_lr_scheduler_drives_the_inner_optimizer():
    model = MLP()
    private = dpfx.make_private(model, torch.optim.SGD(model.parameters(), lr=1.0), _dataset(),
                                batch_size=20, max_grad_norm=1.0, noise_multiplier=1.0,
                                backend="eager")
    sched = torch.optim.lr_scheduler.StepLR(private.optimizer, step_size=1, gamma=0.5)
    _train(private)
    sched.step()
    assert private.optimizer.original_optimizer.param_groups[0]["lr"] == 0.5
