"""The independent reference every differential test compares against: torch.func per-example
gradients (vmap of grad over the batch), flat clipping over all parameters, sum, divide.

Nothing here shares code with dpfx's compiler. ``check_every_batch_size`` at the end is the
differential check the rule tests share: dpfx against this reference at every batch size.
"""
from __future__ import annotations

import contextlib

import torch
from torch.func import functional_call, grad, vmap

CLIP_EPS = 1e-6


def per_example_grads(model, loss_fn, inputs, targets):
    """{name: (B, *p.shape)}: the gradient of example i's own loss, loss_fn(out_i, y_i)."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}
    buffers = dict(model.named_buffers())

    def one(p, x, y):
        out = functional_call(model, {**p, **frozen, **buffers}, (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    return vmap(grad(one), in_dims=(None, 0, 0))(params, inputs, targets)


def dp_sgd_grads(model, loss_fn, inputs, targets, *, max_grad_norm, loss_reduction="mean",
                 expected_batch_size=None):
    """The DP-SGD gradient with sigma = 0, as Opacus defines it."""
    batch = inputs.shape[0]
    names = [k for k, v in model.named_parameters() if v.requires_grad]
    if batch == 0:
        return {k: torch.zeros_like(dict(model.named_parameters())[k]) for k in names}
    g = per_example_grads(model, loss_fn, inputs, targets)
    norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
    factor = (max_grad_norm / (norms + CLIP_EPS)).clamp(max=1.0)
    if loss_reduction == "mean":
        denom = expected_batch_size or batch
    else:
        denom = 1
    return {k: (g[k] * factor.view(-1, *[1] * (g[k].dim() - 1))).sum(0) / denom for k in names}


def clip_fraction(model, loss_fn, inputs, targets, max_grad_norm) -> float:
    """Share of examples whose gradient norm exceeds C (tests use it to make clipping bite)."""
    if inputs.shape[0] == 0:
        return 0.0
    g = per_example_grads(model, loss_fn, inputs, targets)
    norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
    return float((norms > max_grad_norm).float().mean())


def run_dpfx(dp_model, model, loss_fn, inputs, targets, loss_reduction="mean"):
    """One step through dpfx: returns {name: p.grad clone}, leaving the grads zeroed."""
    model.zero_grad(set_to_none=True)
    out = dp_model(inputs)
    loss = out.sum() * 0.0 if inputs.shape[0] == 0 else batch_loss(loss_fn, out, targets)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def batch_loss(loss_fn, out, targets):
    """``loss_fn`` (written for a batch of one) on the whole batch. The test losses are a mean or
    a sum of elementwise terms, so this is a constant times the sum of the per-example losses,
    and dpfx takes each example's gradient of its own loss whatever the constant (Note
    [The per-example term] in dpfx/loss_check.py); a loop
    over ``out[i:i + 1]`` would write the batch size as a Python number, which dpfx refuses."""
    return loss_fn(out, targets)


def assert_close(got: dict, want: dict, rtol=1e-5, atol=1e-6):
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def loop_dp_sgd_grads(model, loss_fn, inputs: tuple, targets, *, max_grad_norm,
                      loss_reduction="mean", kwargs=None):
    """The DP-SGD gradient with sigma = 0 from a batch-of-one autograd loop: for models with
    several inputs (each with the batch in dim 0), or layers vmap cannot batch."""
    kwargs = kwargs or {}
    params = {k: v for k, v in model.named_parameters() if v.requires_grad}
    batch = targets.shape[0]
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in range(batch):
        one = tuple(t[i:i + 1] for t in inputs)
        one_kw = {k: t[i:i + 1] for k, t in kwargs.items()}
        loss = loss_fn(model(*one, **one_kw), targets[i:i + 1])
        g = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        g = [torch.zeros_like(p) if gi is None else gi for gi, p in zip(g, params.values())]
        norm = torch.sqrt(sum(gi.pow(2).sum() for gi in g))
        factor = (max_grad_norm / (norm + CLIP_EPS)).clamp(max=1.0)
        for k, gi in zip(params, g):
            total[k] += gi * factor
    denom = (batch or 1) if loss_reduction == "mean" else 1
    return {k: v / denom for k, v in total.items()}


def run_dpfx_multi(dp_model, model, loss_fn, inputs: tuple, targets, loss_reduction="mean",
                   kwargs=None):
    """One step through dpfx with several inputs: {name: p.grad clone}, grads left zeroed."""
    model.zero_grad(set_to_none=True)
    out = dp_model(*inputs, **(kwargs or {}))
    loss = batch_loss(loss_fn, out, targets) if targets.shape[0] else out.sum() * 0.0
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def check_every_batch_size(model, loss_fn, x, y, *, max_grad_norm, reduction="mean",
                           expected=None, backend="eager", strategy="auto",
                           first_call=contextlib.nullcontext):
    """One compiled graph serves every batch size: for B = 0..len(x) (B = 0 only where the
    divisor D is known: "sum" or an expected_batch_size), dpfx with sigma = 0 on the first B
    examples equals ``dp_sgd_grads``, and clipping bites on the full batch. ``first_call``: a
    context manager around the first step (where dpfx compiles). Returns the compiled module."""
    import dpfx

    torch._dynamo.reset()  # conftest's fresh dynamo, per hypothesis example (see conftest.py)
    assert clip_fraction(model, loss_fn, x, y, max_grad_norm) > 0
    dp = dpfx.compile(model, max_grad_norm=max_grad_norm, noise_multiplier=0.0,
                      loss_reduction=reduction, expected_batch_size=expected, backend=backend,
                      strategy=strategy)
    # Inductor's parallel CPU reductions may sum in another order than eager: 1e-4 relative.
    tol = {"rtol": 1e-4, "atol": 1e-6} if backend == "inductor" else {}
    first = 0 if reduction == "sum" or expected else 1
    for batch in range(first, x.shape[0] + 1):
        xb, yb = x[:batch], y[:batch]
        with first_call() if batch == first else contextlib.nullcontext():
            got = run_dpfx(dp, model, loss_fn, xb, yb, reduction)
        want = dp_sgd_grads(model, loss_fn, xb, yb, max_grad_norm=max_grad_norm,
                            loss_reduction=reduction, expected_batch_size=expected)
        try:
            assert_close(got, want, **tol)
        except AssertionError as e:
            raise AssertionError(f"batch size {batch}: {e}") from None
    assert dp.compile_count == 2, "one forward and one backward graph for every batch size"
    return dp
