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
from hypothesis import Phase, given, settings, strategies as st
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize, parametrizations

import dpfx
from support.models import xent
from support.reference import (assert_close, check_every_batch_size, clip_fraction,
                               dp_sgd_grads, run_dpfx)
from support.sweep import examples

C = 0.05


def check(model, x, y, *, reduction="mean", expected=None, backend="eager"):
    dp = check_every_batch_size(model, xent, x, y, max_grad_norm=C, reduction=reduction,
                                expected=expected, backend=backend)
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


def old_weight_norm_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    with pytest.warns(FutureWarning):
        nn.utils.weight_norm(model[0])
    return model


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_old_weight_norm_hook(backend):
    """The deprecated hook stores g * v / ||v|| on the module each forward; dynamo returns it as a
    batch-free output whose tangent (zeros: nothing uses the stored weight) is added to the
    weight's gradient. dpfx drops that add and checks the tangent is zero at run time (Note
    [Batch-free forward outputs: gradient zero or refused])."""
    fired = check(old_weight_norm_model(), *vectors(), reduction="sum", backend=backend)
    assert fired["0.weight_g"] == ["mm", "vmap-lift"]
    assert fired["0.weight_v"] == ["mm", "vmap-lift"]


def test_old_weight_norm_hook_refuses_a_loss_on_the_stored_weight():
    """A regularizer on the stored weight sends it a nonzero gradient that belongs to no
    example: the step is refused before any gradient is written."""
    model = old_weight_norm_model()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    x, y = vectors()
    # The loss check sees the stored weight enter dpfx's backward beside the outputs; the
    # backend's zero-tangent check (Note [Batch-free forward outputs: gradient zero or refused])
    # stays behind it as defence in depth.
    with pytest.raises(dpfx.PrivacyError, match=r"did not return.*nn\.utils\.weight_norm"):
        (xent(dp(x), y) + model[0].weight.pow(2).sum()).backward()
    assert all(p.grad is None for p in model.parameters())
    xent(dp(x), y).backward()     # the same graph still trains without the regularizer
    assert all(p.grad is not None for p in model.parameters())


def transformed(kind: str, d_in: int, d_out: int) -> nn.Module:
    """A Linear(d_in, d_out) -> tanh -> Linear(d_out, 3) whose first weight is transformed."""
    first = nn.Linear(d_in, d_out)
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(d_out, 3))
    if kind == "standardized":
        model[0] = StandardizedRows(d_in, d_out)
    elif kind.startswith("weight_norm"):
        parametrizations.weight_norm(first, dim=int(kind[-1]))
    elif kind == "old_hook":
        with pytest.warns(FutureWarning):
            nn.utils.weight_norm(first)
    else:
        parametrize.register_parametrization(first, "weight", CenteredUnitRows())
    return model


class StandardizedRows(nn.Linear):
    def forward(self, x):
        w = self.weight
        w = (w - w.mean(1, keepdim=True)) / (w.std(1, keepdim=True) + 1e-5)
        return F.linear(x, w, self.bias)


@settings(max_examples=examples(10), deadline=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate])
@given(kind=st.sampled_from(["standardized", "weight_norm0", "weight_norm1", "old_hook",
                             "user"]),
       d_in=st.integers(2, 5), d_out=st.integers(2, 5), batch=st.integers(2, 5),
       config=st.sampled_from([("mean", None), ("sum", None), ("mean", 4)]))
def test_transforms_hypothesis(kind, d_in, d_out, batch, config):
    """Every transform, shapes and batch sizes that collide with the feature dims (batch 0 and 1
    too, through the same graph), both reductions, clipping that bites."""
    torch.manual_seed(0)
    model = transformed(kind, d_in, d_out)
    g = torch.Generator().manual_seed(batch)
    x, y = torch.randn(batch, d_in, generator=g) * 3, torch.arange(batch) % 3
    fired = check(model, x, y, reduction=config[0], expected=config[1])
    assert any("vmap-lift" in rules for rules in fired.values()), fired


@pytest.mark.parametrize("orthogonal_map, code", [
    ("matrix_exp", r"torch\.matrix_exp\(A\)"),
    ("householder", r"torch\.linalg\.householder_product\(A, tau\)")])
def test_orthogonal_is_refused_naming_parameter_and_construct(orthogonal_map, code):
    """torch cannot vmap these backwards over a symbolic batch size: matrix_exp's exponentiates a
    block matrix holding the gradient, lu_solve's and householder_product's guard on the batch."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    parametrizations.orthogonal(model[0], orthogonal_map=orthogonal_map)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    x, y = torch.randn(4, 3), torch.arange(4) % 2
    with pytest.raises(dpfx.UnsupportedOpError,
                       match=r"parameter '0\.parametrizations\.weight\.original' \(the original "
                             r"of the parametrization on '0\.weight'.*\) is used through code "
                             r"`Q = " + code):
        xent(dp(x), y).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_orthogonal_cayley_matches_reference(backend):
    """The Cayley map's linalg.solve backward traces with a symbolic batch since torch's size
    questions inside kernels are answered by dpfx (Note [Deciding a branch on the batch size] in
    capture/batch_branches.py): one compile, exact at batch sizes 4, 1 and 3 with clipping biting."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    parametrizations.orthogonal(model[0], orthogonal_map="cayley")
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, backend=backend)
    for b in (4, 1, 3):
        x, y = torch.randn(b, 3), torch.arange(b) % 2
        assert clip_fraction(model, F.cross_entropy, x, y, 0.05) > 0
        assert_close(run_dpfx(dp, model, F.cross_entropy, x, y),
                     dp_sgd_grads(model, F.cross_entropy, x, y, max_grad_norm=0.05))
