"""Ordinary user code next to the loss guard's refusals must train, and the refusals no other
test reaches are reached here: each through the defaults (Inductor, the self-check on), every
step compared with the batch-of-one reference at a clipping bound that bites.

Trains: a gradient hook on a tensor that is not computed from dpfx's outputs (a parameter, an
input under ``allow_input_grads``), a constant or detached tensor beside the outputs (a term
``0 * const.sum()``, cross_entropy's class weights, a teacher's detached output), a custom
autograd.Function or a torch.compile'd function used on the targets, and a training forward,
which runs through dpfx's compiled graph. Refused, naming what happened: a custom
autograd.Function or a torch.compile'd function applied to the outputs (its backward is code
dpfx cannot check per example; the refusal of a compiled loss names ``dpfx.compile(loss=...)``,
which proves it, and that trains), and a forward under ``torch.compiler.set_stance("force_eager")``, which never runs
dpfx's graph.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from tests.support.reference import (assert_close, bound_that_bites, clipped_sum, dp_sgd_grads,
                                     loop_example_grads, per_example_grads, per_example_norms)

TOL = {"rtol": 1e-4, "atol": 1e-6}     # Inductor's CPU reductions may sum in another order
BATCHES = (0, 1, 5)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _examples(model, loss_fn, x, y, loop=False):
    """{name: (B, ...)}: each example's gradient of its own loss, by vmap(grad) or (``loop``, for
    a loss vmap cannot batch) a batch-of-one autograd loop."""
    if loop:
        return loop_example_grads(model, loss_fn, (x,), y)
    return per_example_grads(model, loss_fn, x, y)


def _data(loss_fn, model, y_kind="float", loop=False):
    torch.manual_seed(1)
    x = torch.randn(5, 8)
    y = torch.randn(5, 4) if y_kind == "float" else torch.randint(0, 4, (5,))
    bound = bound_that_bites(per_example_norms(_examples(model, loss_fn, x, y, loop)))
    return x, y, bound


def _step(dp, model, loss_fn, x, y):
    model.zero_grad(set_to_none=True)
    loss_fn(dp(x), y).backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _check(dp, model, loss_fn, x, y, bound, loop=False):
    """dpfx's step (sigma 0) equals the clipped sum of the per-example gradients at every batch
    size of BATCHES, with the bound clipping some of the examples but not all."""
    g = _examples(model, loss_fn, x, y, loop)
    norms = per_example_norms(g)
    assert (norms > bound).any() and (norms < bound).any(), "the bound must bite"
    for b in BATCHES:
        want = clipped_sum({k: v[:b] for k, v in g.items()}, bound)
        assert_close(_step(dp, model, loss_fn, x[:b], y[:b]), want, **TOL)


def _compile(model, bound, **kw):
    return dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0, loss_reduction="sum",
                        **kw)


def _untouched(model):
    return all(p.grad is None for p in model.parameters())


# -- trains ----------------------------------------------------------------------------------------
def test_constants_and_detached_tensors_beside_the_outputs_train():
    """A constant, class weights and a teacher's detached output in the loss: no refusal, and
    the reference's step at every batch size."""
    model = _mlp()
    const = torch.randn(3)
    teacher = nn.Linear(8, 4)           # its parameters require grad; the loss detaches them

    def with_const(out, y):
        return F.mse_loss(out, y, reduction="sum") + 0 * const.sum()

    x, y, bound = _data(with_const, model)
    dp = _compile(model, bound)
    _check(dp, model, with_const, x, y, bound)

    def weighted(out, y, weight=torch.tensor([0.5, 2.0, 1.0, 3.0])):
        return F.cross_entropy(out, y, weight=weight, reduction="sum")

    _, labels, own = _data(weighted, model, "labels")
    weight = torch.tensor([0.5, 2.0, 1.0, 3.0]) * (bound / own)     # so that the bound bites

    def weighted_to_bite(out, y):
        return weighted(out, y, weight)

    _check(dp, model, weighted_to_bite, x, labels, bound)

    def distilled(out, xb):
        return F.mse_loss(out, teacher(xb).detach(), reduction="sum")

    with torch.no_grad():
        teacher.weight.mul_(3.0)        # its targets far enough for the bound to bite
    _check(dp, model, distilled, x, x, bound)
    assert all(p.grad is None for p in teacher.parameters())
    assert dp.compile_count == 2, "one forward and one backward graph served every loss"


def test_gradient_hooks_on_tensors_dpfx_did_not_produce_train():
    """A hook on a parameter sees the released (clipped, summed) gradient; a hook on an input the
    user made require grad (``allow_input_grads=True``) sees that input's gradient."""
    model = _mlp()

    def mse(out, y):
        return F.mse_loss(out, y, reduction="sum")

    x, y, bound = _data(mse, model)
    dp = _compile(model, bound, allow_input_grads=True)
    seen = []
    handle = model[0].weight.register_hook(lambda g: seen.append(g.detach().clone()))
    try:
        _check(dp, model, mse, x, y, bound)
    finally:
        handle.remove()
    assert len(seen) == len(BATCHES)
    want = dp_sgd_grads(model, mse, x, y, max_grad_norm=bound, loss_reduction="sum")
    torch.testing.assert_close(seen[-1], want["0.weight"], **TOL)

    xin = x.clone().requires_grad_()
    to_input = []
    xin.register_hook(lambda g: to_input.append(g))
    got = _step(dp, model, mse, xin, y)
    assert_close(got, want, **TOL)
    assert len(to_input) == 1 and to_input[0].shape == x.shape
    torch.testing.assert_close(xin.grad, to_input[0])
    xplain = x.clone().requires_grad_()
    mse(model(xplain), y).backward(inputs=[xplain])     # the input's own (not private) gradient
    torch.testing.assert_close(to_input[0], xplain.grad, **TOL)


def test_a_hook_that_transforms_a_parameters_release_trains():
    """A hook on a parameter that returns another tensor (a gradient scaled by a constant)
    transforms dpfx's release before autograd accumulates it: post-processing, which trains
    (Note [Every gradient a parameter receives is dpfx's] in grad_guards.py), registered before
    or after dpfx.compile; a DPOptimizer steps it."""
    model = _mlp()

    def mse(out, y):
        return F.mse_loss(out, y, reduction="sum")

    x, y, bound = _data(mse, model)
    before = model[0].weight.register_hook(lambda g: g * 0.5)
    dp = _compile(model, bound)
    after = model[2].bias.register_hook(lambda g: g * 2.0)
    want = dp_sgd_grads(model, mse, x, y, max_grad_norm=bound, loss_reduction="sum")
    want["0.weight"], want["2.bias"] = want["0.weight"] * 0.5, want["2.bias"] * 2.0
    try:
        got = _step(dp, model, mse, x, y)
        assert_close(got, want, **TOL)
        opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp)
        mse(dp(x), y).backward()
        opt.step()
    finally:
        before.remove()
        after.remove()


def test_a_custom_function_or_compiled_function_on_the_targets_trains():
    """Both kinds of function the loss must not go through are fine on the targets, which hold
    no gradient of the model."""
    model = _mlp()

    class Halve(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t / 2

        @staticmethod
        def backward(ctx, g):
            return g / 2

    scale = torch.compile(lambda t: t * 3.0, backend="aot_eager")

    def loss_fn(out, y):
        return F.mse_loss(out, Halve.apply(scale(y)), reduction="sum")

    x, y, bound = _data(loss_fn, model, loop=True)
    _check(_compile(model, bound), model, loss_fn, x, y, bound, loop=True)


def test_a_training_forward_runs_through_dpfx_graph():
    """Every training forward runs dpfx's compiled graph (the gate's check that it did passes at
    each batch size); under ``set_stance("force_eager")`` it does not, and the step is refused
    before any gradient is written, then trains again once the stance is back."""
    model = _mlp()

    def mse(out, y):
        return F.mse_loss(out, y, reduction="sum")

    x, y, bound = _data(mse, model)
    dp = _compile(model, bound)
    _check(dp, model, mse, x, y, bound)
    assert dp.compile_count == 2
    with torch.compiler.set_stance("force_eager"):
        with pytest.raises(dpfx.PrivacyError, match="did not run through dpfx's compiled graph"):
            mse(dp(x), y).backward()
    assert _untouched(model)
    _check(dp, model, mse, x, y, bound)


# -- refused, naming what happened -----------------------------------------------------------------
def test_a_function_whose_backward_dpfx_cannot_see_on_the_outputs_is_refused():
    """A custom autograd.Function (here a straight-through clamp) or a torch.compile'd loss
    applied to the outputs: the message names the function's backward and the fix, nothing is
    written, and the same model then trains the loss written with torch ops. For the compiled
    loss the fix named is the captured loss, and it trains: ``dpfx.compile(model,
    loss=compiled)`` then ``dp.loss(x, y)`` gives the reference at every batch size. The custom
    Function's message does not name it (dynamo's capture cannot take that Function)."""
    model = _mlp()

    class StraightThrough(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clamp(-1, 1)

        @staticmethod
        def backward(ctx, g):
            return g

    def mse(out, y):
        return F.mse_loss(out, y, reduction="sum")

    x, y, bound = _data(mse, model)
    dp = _compile(model, bound)
    with pytest.raises(dpfx.PrivacyError, match="custom autograd.Function") as e:
        mse(StraightThrough.apply(dp(x)), y).backward()
    assert "StraightThroughBackward" in str(e.value) and "torch ops" in str(e.value)
    assert "dp.loss" not in str(e.value)
    assert _untouched(model)
    compiled = torch.compile(mse, backend="inductor")
    with pytest.raises(dpfx.PrivacyError, match="torch.compile'd function") as e:
        compiled(dp(x), y).backward()
    assert "CompiledFunctionBackward" in str(e.value)
    assert "dpfx.compile(model, ..., loss=fn), then loss = dp.loss(x, y)" in str(e.value)
    assert _untouched(model)
    _check(dp, model, mse, x, y, bound)
    captured = _compile(model, bound, loss=compiled)
    g = _examples(model, mse, x, y)
    for b in BATCHES:
        model.zero_grad(set_to_none=True)
        captured.loss(x[:b], y[:b]).backward()
        got = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        assert_close(got, clipped_sum({k: v[:b] for k, v in g.items()}, bound), **TOL)
