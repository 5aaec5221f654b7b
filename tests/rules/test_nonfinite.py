"""An example with a non-finite gradient contributes zero and cannot poison the release.

One example gets a NaN or an inf feature (or, in fp16, a per-sample gradient that overflows);
the release must be finite and equal, at sigma 0, the DP-SGD gradient of the other examples
(tests/support/reference.py's batch-of-one loop over them), divided by the same D. Every strategy
(materialize; ghost for mm with one and with several rows per example, conv and embedding),
both loss reductions, batch sizes 1 (only the bad example: the release is zero) and 4, clipping
that bites. Note [Non-finite examples contribute zero] in dpfx/rules/registry.py.
"""
import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn

import dpfx
from dpfx.ops import norms as stats
from support.models import MLP, mse
from support.reference import (assert_close, batch_loss, dp_sgd_grads, loop_dp_sgd_grads,
                               run_dpfx_multi)

C = 0.05


class SeqLinear(nn.Module):            # (B, T, 8): the mm ghost form's Gram branch
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))).mean(1)


class ConvNet(nn.Module):              # (B, 2, 6, 6)
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(2, 4, 3, padding=1), nn.Linear(4 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class ScaledEmbedding(nn.Module):      # (B, 5) ids and a (B, 1) scale: NaN reaches the table
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(30, 8), nn.Linear(8, 4)

    def forward(self, idx, scale):
        return self.fc(self.emb(idx).mean(1) * scale)


def _inputs(case, g, batch):
    if case == "mlp":
        return (torch.randn(batch, 8, generator=g) * 3,)
    if case == "seq":
        return (torch.randn(batch, 5, 8, generator=g) * 3,)
    if case == "conv":
        return (torch.randn(batch, 2, 6, 6, generator=g) * 3,)
    return (torch.randint(0, 30, (batch, 5), generator=g), torch.randn(batch, 1, generator=g) * 3)


MODELS = {"mlp": MLP, "seq": SeqLinear, "conv": ConvNet, "embedding": ScaledEmbedding}


def _poison(inputs, bad):
    """Example 0's last floating-point input gets one ``bad`` feature."""
    x = inputs[-1].clone()
    x.view(x.shape[0], -1)[0, -1] = bad
    return (*inputs[:-1], x)


def _reference(model, inputs, y, reduction, bounds=None):
    """sigma = 0 DP-SGD over examples 1.. only, divided by the whole batch's D."""
    return loop_dp_sgd_grads(model, mse, tuple(t[1:] for t in inputs), y[1:],
                             max_grad_norm=C if bounds is None else bounds,
                             loss_reduction=reduction, expected_batch_size=y.shape[0])


def _check(dp, model, case, reduction, batches=(1, 4), bads=(math.nan, math.inf), bounds=None,
           dtype=torch.float32, read=None):
    g = torch.Generator().manual_seed(0)
    for batch in batches:
        for bad in bads:
            inputs = _poison(_inputs(case, g, batch), bad)
            y = torch.randn(batch, 4, generator=g)
            cast = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
            reference = copy.deepcopy(model).float()
            want = _reference(reference, inputs, y, reduction, bounds)
            if batch > 1 and bounds is None:   # clipping bites on the clean examples
                loose = loop_dp_sgd_grads(reference, mse, tuple(t[1:] for t in inputs), y[1:],
                                          max_grad_norm=1e6, loss_reduction="sum")
                assert any((loose[k] / (batch if reduction == "mean" else 1) - want[k]).abs()
                           .max() > 1e-3 for k in want)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", stats.NonFiniteExampleWarning)
                got = (read or run_dpfx_multi)(dp, model, mse, cast, y.to(dtype), reduction)
            for name, grad in got.items():
                assert torch.isfinite(grad).all(), (name, batch, bad)
            tol = dict(rtol=0.05, atol=C * 2e-3) if dtype != torch.float32 else {}
            assert_close({k: v.float() for k, v in got.items()}, want, **tol)


@pytest.mark.filterwarnings("ignore::dpfx.LossScaleWarning")  # the loss's scale changed: expected
@pytest.mark.parametrize("strategy", ["materialize", "ghost"])
@pytest.mark.parametrize("case", sorted(MODELS))
def test_non_finite_example_contributes_zero(case, strategy):
    torch.manual_seed(0)
    model = MODELS[case]()
    reduction = "sum" if case == "mlp" else "mean"
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction=reduction,
                      strategy=strategy, backend="eager")
    _check(dp, model, case, reduction)
    weights = [pg for pg in dp._dpfx_backend.param_grads if pg.name.endswith("weight")]
    assert {pg.strategy for pg in weights} == {strategy}


def test_non_finite_example_through_inductor():
    """The default backend: conv and mm book-keeping products, both operands selected."""
    torch.manual_seed(0)
    model = ConvNet()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, strategy="ghost")
    _check(dp, model, "conv", "mean")


@pytest.mark.slow
@pytest.mark.parametrize("case,strategy", [
    ("conv", "materialize"), ("seq", "materialize"), ("seq", "ghost"),
    ("embedding", "materialize"), ("embedding", "ghost")])
def test_non_finite_example_through_inductor_sweep(case, strategy):
    torch.manual_seed(0)
    model = MODELS[case]()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, strategy=strategy)
    _check(dp, model, case, "mean")


@pytest.mark.parametrize("strategy", ["materialize", "ghost"])
def test_fp16_per_sample_gradient_that_overflows_contributes_zero(strategy):
    """Example 0's features are large enough that its per-sample gradient overflows fp16
    (65504) while the forward stays finite: it is dropped, the others are clipped as usual."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(torch.float16)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction="sum",
                      strategy=strategy, backend="eager")
    x = torch.randn(4, 8).to(torch.float16).float()
    x[0] = 3000.0
    y = torch.randn(4, 4)
    reference = copy.deepcopy(model).float()
    out = reference(x[:1])
    assert torch.isfinite(out.half()).all()
    g = torch.autograd.grad(mse(out, y[:1]), reference.weight)[0]
    assert g.abs().max() > 65504, "the setup must overflow fp16"
    got = run_dpfx_multi(dp, model, mse, (x.half(),), y.half(), "sum")
    assert all(torch.isfinite(v).all() for v in got.values())
    want = _reference(reference, (x,), y, "sum")
    assert_close({k: v.float() for k, v in got.items()}, want, rtol=0.05, atol=C * 2e-3)


def test_optimizer_noise_clipped_sums_stay_finite():
    """noise="optimizer": the clipped sums DPOptimizer noises leave the bad example out."""
    torch.manual_seed(0)
    model = SeqLinear()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, strategy="ghost",
                      backend="eager", noise="optimizer")
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), dp)

    def read(dp, model, loss_fn, inputs, y, reduction):
        opt.zero_grad()
        out = dp(*inputs)
        batch_loss(loss_fn, out, y).backward()
        sums = {k: v.clone() for k, v in dp.clipped_sums.items()}
        opt.zero_grad()
        return {k: v / y.shape[0] for k, v in sums.items()}

    _check(dp, model, "seq", "mean", read=read)


@pytest.mark.parametrize("strategy", ["materialize", "ghost"])
def test_per_layer_clipping_drops_the_example(strategy):
    torch.manual_seed(0)
    model = MLP()
    bounds = {"fc1": C, "fc2": 2 * C}
    dp = dpfx.compile(model, max_grad_norm=bounds, noise_multiplier=0.0, strategy=strategy,
                      backend="eager")
    _check(dp, model, "mlp", "mean", bounds=bounds, bads=(math.nan,))
    # An inf feature saturates tanh: fc2's gradient of example 0 is finite, so only the fc1
    # group drops it; fc2 clips it as usual (each group has its own norm and clip factor).
    x, y = torch.randn(4, 8) * 3, torch.randn(4, 4)
    x[0, 3] = math.inf
    got = run_dpfx_multi(dp, model, mse, (x,), y)
    others = _reference(model, (x,), y, "mean", bounds)
    everyone = dp_sgd_grads(model, mse, x, y, max_grad_norm=bounds)
    assert torch.isfinite(everyone["fc2.weight"]).all()
    assert_close(got, {k: (others if k.startswith("fc1") else everyone)[k] for k in got})


def test_non_finite_examples_are_counted_and_reported_once():
    torch.manual_seed(0)
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=1.0, backend="eager",
                      track_norms=True)
    x = torch.randn(4, 8)
    x[1, 2], x[3, 0] = math.nan, math.inf
    with pytest.warns(stats.NonFiniteExampleWarning, match="2 example"):
        dp(x).pow(2).mean().backward()
    assert dp.norm_stats.non_finite == 2
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", stats.NonFiniteExampleWarning)   # reported once
        dp(x[:2]).pow(2).mean().backward()
    assert dp.norm_stats.non_finite == 3
    assert torch.isfinite(dp.norm_stats.quantiles([0.5])).all()
