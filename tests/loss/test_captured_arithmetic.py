"""Arithmetic on the captured loss (Note [Arithmetic that keeps the captured loss] in
dpfx/loss/captured.py) and the weight penalty (Note [A weight penalty is the optimizer's]).

A constant scale or shift of ``dp.loss(x, y)`` changes nothing private: its backward releases
exactly what ``dp.loss(x, y).backward()`` does, the batch-of-one reference's clipped mean, as the
plain loop's backward of the same idiom does. Anything else is refused at the backward, before
dpfx's graph writes anything, with a message that says what the loss went through. A weight
penalty in the loss is refused in both forms naming the optimizer's ``weight_decay``, and that fix
trains: SGD's weight_decay = 2 lam steps by the release plus the penalty's gradient 2 lam p.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from support.reference import (assert_close, loop_dp_sgd_grads, loop_example_grads,
                               per_example_norms)

C, LAM = 2.0, 1e-2


def _setup(backend="inductor"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(5, 4) * 2, torch.randint(0, 3, (5,))
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend=backend,
                      loss=F.cross_entropy)
    return model, dp, x, y


def _grads(model):
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


NEUTRAL = {
    "times a 0-d tensor": lambda loss: loss * torch.tensor(2.0),
    "0-d tensor times": lambda loss: torch.tensor(0.5) * loss,
    "over a 0-d tensor": lambda loss: loss / torch.tensor(4.0),
    "plus a number": lambda loss: loss + 1.0,
    "number plus": lambda loss: 3 + loss,
    "minus a 0-d tensor": lambda loss: loss - torch.tensor(3.0),
    "torch.add with alpha": lambda loss: torch.add(torch.tensor(1.0), loss, alpha=2.0),
    "shifted then scaled": lambda loss: (loss + 1.0) / 4 * torch.tensor(3.0),
    "in place": lambda loss: loss.add_(1.0).mul_(torch.tensor(2.0)),
    "mean of the one loss": lambda loss: loss.mean(),
}


@pytest.mark.filterwarnings("ignore::dpfx.LossScaleWarning")  # the loss's scale changed: expected
def test_a_constant_scale_or_shift_releases_the_reference():
    """Through Inductor: every idiom's backward gives the batch-of-one reference exactly, where
    the bound clips some examples and not others; the plain loop gives the same for the first
    two idioms."""
    model, dp, x, y = _setup()
    want = loop_dp_sgd_grads(model, F.cross_entropy, (x,), y, max_grad_norm=C)
    norms = per_example_norms(loop_example_grads(model, F.cross_entropy, (x,), y))
    assert norms.min() < C < norms.max()
    for name, idiom in NEUTRAL.items():
        loss = idiom(dp.loss(x, y))
        assert isinstance(loss, dpfx.loss.captured.CapturedLoss), name
        loss.backward()
        try:
            assert_close(_grads(model), want, rtol=1e-4, atol=1e-6)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    for name in ("times a 0-d tensor", "plus a number"):
        NEUTRAL[name](F.cross_entropy(dp(x), y)).backward()
        assert_close(_grads(model), want, rtol=1e-4, atol=1e-6)


REFUSED = {
    "a weight per example": (lambda loss, x: (loss * torch.full((5,), 2.0)).sum(),
                             r"`mul` of the captured loss with a tensor of shape \(5,\)"),
    "a scale that needs a gradient": (
        lambda loss, x: loss * torch.tensor(2.0, requires_grad=True),
        "a tensor that needs a gradient"),
    "another op": (lambda loss, x: loss.exp(), "`exp` of the captured loss"),
    "a number over the loss": (lambda loss, x: 1.0 / loss, "`__rtruediv__` of the captured"),
    "the model called directly": (lambda loss, x: loss + _MODEL[0](x).sum(),
                                  "computed from trainable tensors outside dpfx's forward"),
    "a negative tensor": (lambda loss, x: loss * torch.tensor(-1.0),
                          "cannot tell a negative constant in a tensor"),
    "zero": (lambda loss, x: loss * torch.tensor(0.0), "multiplied by 0"),
}
_MODEL = []


@pytest.mark.parametrize("name", list(REFUSED))
def test_other_arithmetic_is_refused_naming_what_happened(name):
    model, dp, x, y = _setup(backend="eager")
    _MODEL[:] = [model]
    idiom, match = REFUSED[name]
    with pytest.raises(dpfx.PrivacyError, match=match) as e:
        idiom(dp.loss(x, y), x).backward()
    assert "custom autograd.Function" not in str(e.value)
    assert "test_captured_arithmetic.py" in str(e.value) or "multiplied by" in str(e.value) \
        or "cannot tell a negative constant" in str(e.value)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters()) or \
        name == "the model called directly"


def _penalty(model):
    return LAM * sum(p.pow(2).sum() for p in model.parameters())


def test_a_weight_penalty_is_refused_naming_weight_decay():
    """The captured loss and the plain loop both refuse ``loss + lam * sum ||p||^2`` and name
    the fix with its factor."""
    model, dp, x, y = _setup(backend="eager")
    with pytest.raises(dpfx.PrivacyError, match=r"weight_decay = 2 \* lam"):
        (dp.loss(x, y) + _penalty(model)).backward()
    model.zero_grad(set_to_none=True)
    with pytest.raises(dpfx.PrivacyError, match=r"weight_decay = 2 \* lam"):
        (F.cross_entropy(dp(x), y) + _penalty(model)).backward()


def test_weight_decay_is_the_penalty():
    """The fix the refusal names: SGD(weight_decay = 2 lam) on the released gradient steps by
    the release plus 2 lam p, the penalty's gradient (Note [A weight penalty is the
    optimizer's]), through Inductor at sigma 0."""
    model, dp, x, y = _setup()
    release = loop_dp_sgd_grads(model, F.cross_entropy, (x,), y, max_grad_norm=C)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    penalty_grad = dict(zip(before, torch.autograd.grad(_penalty(model),
                                                        list(model.parameters()))))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=2 * LAM)
    dp.loss(x, y).backward()
    opt.step()
    got = {k: (before[k] - p.detach()) / 0.5 for k, p in model.named_parameters()}
    assert_close(got, {k: release[k] + penalty_grad[k] for k in before}, rtol=1e-4, atol=1e-6)


def test_in_place_ops_keep_or_drop_the_loss():
    """In place, a constant scale and shift keep the loss's multiple (a negation negates the
    release); another op in place makes it a plain tensor, refused naming the op; an op that
    returns the loss itself (``.float()``) keeps it."""
    model, dp, x, y = _setup(backend="eager")
    dp.loss(x, y).float().add_(2.0).mul_(torch.tensor(3.0)).backward()
    assert all(p.grad is not None for p in model.parameters())
    want = _grads(model)
    dp.loss(x, y).neg_().backward()
    assert_close(_grads(model), {k: -v for k, v in want.items()}, rtol=1e-6, atol=1e-7)
    with pytest.raises(dpfx.PrivacyError, match="`pow_` of the captured loss"):
        dp.loss(x, y).pow_(2).backward()
    assert all(p.grad is None for p in model.parameters())
