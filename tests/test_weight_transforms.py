"""Weights transformed before use by a function of the parameters alone, against torch.func.

Weight standardization, ``nn.utils.parametrizations.weight_norm``, a user's own
``register_parametrization``: the per-sample gradient of the parameter is the transform's VJP
applied to each example's gradient of the transformed weight, which dpfx gets by vmapping the
backward chain between the frontier and the parameter (Note [The vmap lift: data-independent
transforms of a weight] in dpfx/rules/fallback.py). Each test asserts the rule fired ("vmap-lift")
and compares dpfx (sigma = 0, a C that clips) with the reference for batch sizes 0..4 through one
graph. Transforms that cannot be handled are refused with the parameter and the construct named.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize, parametrizations

import dpfx
from reference import assert_close, clip_fraction, dp_sgd_grads, run_dpfx

C = 0.05


def xent(out, y):
    return F.cross_entropy(out, y)


def check(model, x, y, *, reduction="mean", expected=None, backend="eager"):
    torch._dynamo.reset()
    assert clip_fraction(model, xent, x, y, C) > 0
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction=reduction,
                      expected_batch_size=expected, backend=backend)
    tol = {"rtol": 1e-4, "atol": 1e-6} if backend == "inductor" else {"rtol": 1e-5,
                                                                       "atol": 1e-6}
    first = 0 if reduction == "sum" or expected else 1
    for batch in range(first, x.shape[0] + 1):
        got = run_dpfx(dp, model, xent, x[:batch], y[:batch], reduction)
        want = dp_sgd_grads(model, xent, x[:batch], y[:batch], max_grad_norm=C,
                            loss_reduction=reduction, expected_batch_size=expected)
        try:
            assert_close(got, want, **tol)
        except AssertionError as e:
            raise AssertionError(f"batch size {batch}: {e}") from None
    assert dp.compile_count == 2
    return {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}


class StandardizedConv(nn.Conv2d):
    """Weight standardization (Qiao et al. 2019), as in NFNets and BiT."""

    def forward(self, x):
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        std = w.std(dim=(1, 2, 3), keepdim=True)
        return F.conv2d(x, (w - mean) / (std + 1e-5), self.bias, self.stride, self.padding)


class StandardizedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 4))
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(F.linear(x, (self.w - self.w.mean()) / self.w.std())))


class CenteredUnitRows(nn.Module):
    """A user parametrization: every row of the weight has mean 0 and norm 1."""

    def forward(self, w):
        w = w - w.mean(dim=1, keepdim=True)
        return w / w.norm(dim=1, keepdim=True)


def conv_net(conv):
    return nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def images(batch=4):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 2, 4, 4, generator=g) * 2, torch.arange(batch) % 3


def vectors(batch=4):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 4, generator=g) * 2, torch.arange(batch) % 3


@pytest.mark.parametrize("config", [("mean", None), ("sum", None), ("mean", 4)])
def test_weight_standardization_linear(config):
    torch.manual_seed(0)
    fired = check(StandardizedLinear(), *vectors(), reduction=config[0], expected=config[1])
    assert fired["w"] == ["mm", "vmap-lift"]
    assert fired["head.weight"] == ["mm"]


def test_weight_standardization_conv():
    torch.manual_seed(0)
    fired = check(conv_net(StandardizedConv(2, 4, 3, padding=1)), *images())
    assert fired["0.weight"] == ["convolution", "vmap-lift"]


@pytest.mark.parametrize("dim", [0, 1])
def test_weight_norm_parametrization_linear(dim):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    parametrizations.weight_norm(model[0], dim=dim)
    fired = check(model, *vectors(), reduction="sum")
    assert fired["0.parametrizations.weight.original0"] == ["mm", "vmap-lift"]
    assert fired["0.parametrizations.weight.original1"] == ["mm", "vmap-lift"]


def test_weight_norm_parametrization_conv():
    torch.manual_seed(0)
    model = conv_net(nn.Conv2d(2, 4, 3, padding=1))
    parametrizations.weight_norm(model[0])
    fired = check(model, *images(), expected=4)
    assert fired["0.parametrizations.weight.original1"] == ["convolution", "vmap-lift"]


def test_user_parametrization():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    parametrize.register_parametrization(model[0], "weight", CenteredUnitRows())
    fired = check(model, *vectors())
    assert fired["0.parametrizations.weight.original"] == ["mm", "vmap-lift"]


def test_weight_norm_inductor():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    parametrizations.weight_norm(model[0])
    check(model, *vectors(), expected=4, backend="inductor")


def test_old_weight_norm_hook_is_refused_with_the_fix():
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    with pytest.warns(FutureWarning):
        nn.utils.weight_norm(model[0])
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    x, y = vectors()
    with pytest.raises(dpfx.UnsupportedOpError,
                       match=r"parameter '0\.weight_(g|v)'.*nn\.utils\.weight_norm.*"
                             r"parametrizations\.weight_norm"):
        xent(dp(x), y).backward()


def test_orthogonal_is_refused_naming_parameter_and_construct():
    """torch's matrix_exp cannot be batched over a symbolic batch size (its backward
    exponentiates a block matrix holding the gradient)."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    parametrizations.orthogonal(model[0])
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    x, y = torch.randn(4, 3), torch.arange(4) % 2
    with pytest.raises(dpfx.UnsupportedOpError,
                       match=r"parameter '0\.parametrizations\.weight\.original' is used through "
                             r"code `Q = torch\.matrix_exp\(A\)`"):
        xent(dp(x), y).backward()
