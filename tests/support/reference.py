"""The independent reference every differential test compares against: each example's gradient
of its own loss, clipped, summed, divided. The per-example gradients come from torch.func (vmap
of grad over the batch, ``per_example_grads``) or, for models vmap cannot batch or that take
several or keyword inputs, from a batch-of-one autograd loop (``loop_grads``); clipping is flat
over all parameters or per layer (``clipped_sum``).

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
    """The DP-SGD gradient with sigma = 0, as Opacus defines it. ``max_grad_norm``: a number, or
    per-layer bounds {name prefix: C} as dpfx.compile takes them (``clipped_sum``)."""
    batch = inputs.shape[0]
    names = [k for k, v in model.named_parameters() if v.requires_grad]
    if batch == 0:
        return {k: torch.zeros_like(dict(model.named_parameters())[k]) for k in names}
    g = per_example_grads(model, loss_fn, inputs, targets)
    denom = (expected_batch_size or batch) if loss_reduction == "mean" else 1
    return clipped_sum(g, max_grad_norm, denom)


def per_example_norms(g: dict) -> torch.Tensor:
    """(B,): each example's gradient norm over all the parameters of ``g`` ({name: (B, ...)}),
    in float32 at least."""
    return torch.sqrt(sum(v.flatten(1).to(torch.promote_types(v.dtype, torch.float32)).pow(2).sum(1)
                          for v in g.values()))


def clipped_sum(g: dict, max_grad_norm, denom=1, gamma=None) -> dict:
    """sum_i clip(g_i) / denom over per-example gradients {name: (B, *p.shape)}. Flat clipping to
    a number, or per-layer clipping to {name prefix: C}, written independently of dpfx.config: each
    parameter's group is its longest matching prefix ("" matches every name), each group clipped
    to its own bound. With ``gamma``, automatic clipping (Bu et al. 2022): every example of a
    group scaled by C / (||g_i|| + gamma), clipped or not."""
    bounds = max_grad_norm if isinstance(max_grad_norm, dict) else {"": max_grad_norm}

    def group(name):
        return max((k for k in bounds if k == "" or name == k or name.startswith(k + ".")), key=len)

    out = {}
    for key, bound in bounds.items():
        members = {k: v for k, v in g.items() if group(k) == key}
        norms = per_example_norms(members)
        factor = (bound / (norms + CLIP_EPS)).clamp(max=1.0) if gamma is None \
            else bound / (norms + gamma)
        for k, v in members.items():
            out[k] = (v * factor.view(-1, *[1] * (v.dim() - 1))).sum(0) / denom
    return {k: out[k] for k in g}


def bound_that_bites(norms) -> float:
    """A clipping bound that clips about half the examples (the upper median of their norms; half
    the one norm of a batch of one): a wrong per-example scale then changes the result, where all
    clipped would hide it."""
    norms = sorted(float(n) for n in norms)
    return norms[len(norms) // 2] * (1.0 if len(norms) > 1 else 0.5)


def clip_fraction(model, loss_fn, inputs, targets, max_grad_norm) -> float:
    """Share of examples whose gradient norm exceeds C (tests use it to make clipping bite)."""
    if inputs.shape[0] == 0:
        return 0.0
    norms = per_example_norms(per_example_grads(model, loss_fn, inputs, targets))
    return float((norms > max_grad_norm).float().mean())


def run_dpfx(dp_model, model, loss_fn, inputs, targets, loss_reduction="mean"):
    """One step through dpfx: returns {name: p.grad clone}, leaving the grads zeroed. The test
    losses are written as means whatever ``loss_reduction`` is, so the warning that the scale
    changed (dpfx.LossScaleWarning, tested in tests/loss) is expected here and not raised."""
    model.zero_grad(set_to_none=True)
    out = dp_model(inputs)
    loss = out.sum() * 0.0 if inputs.shape[0] == 0 else batch_loss(loss_fn, out, targets)
    with _scale_warnings_expected():
        loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


@contextlib.contextmanager
def _scale_warnings_expected():
    """dpfx.LossScaleWarning is expected: a mean-written test loss under loss_reduction="sum"."""
    import warnings

    import dpfx
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=dpfx.LossScaleWarning)
        yield


def batch_loss(loss_fn, out, targets):
    """``loss_fn`` (written for a batch of one) on the whole batch. The test losses are a mean or
    a sum of elementwise terms, so this is a constant times the sum of the per-example losses,
    and dpfx takes each example's gradient of its own loss whatever the constant (Note
    [The per-example term] in dpfx/loss/check.py); a loop
    over ``out[i:i + 1]`` would write the batch size as a Python number, which dpfx refuses."""
    return loss_fn(out, targets)


def assert_close(got: dict, want: dict, rtol=1e-5, atol=1e-6):
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def loop_grads(model, example_loss, batch: int) -> dict:
    """{name: (B, *p.shape)}: example i's gradient of ``example_loss(i)``, its own loss computed
    on a batch of one, by plain autograd one example at a time (zeros where the example does not
    reach a parameter). For models vmap cannot batch, or called with keywords or several inputs."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    grads = {k: [] for k in params}
    for i in range(batch):
        g = torch.autograd.grad(example_loss(i), list(params.values()), allow_unused=True)
        for (k, p), gi in zip(params.items(), g):
            grads[k].append(torch.zeros_like(p) if gi is None else gi)
    return {k: torch.stack(grads[k]) if batch else p.new_zeros((0, *p.shape))
            for k, p in params.items()}


def loop_example_grads(model, loss_fn, inputs: tuple, targets, kwargs=None) -> dict:
    """``loop_grads`` of ``loss_fn(model(*inputs_i, **kwargs_i), targets_i)``: every input and
    keyword input with the batch in dim 0."""
    kwargs = kwargs or {}

    def example_loss(i):
        one_kw = {k: t[i:i + 1] for k, t in kwargs.items()}
        return loss_fn(model(*(t[i:i + 1] for t in inputs), **one_kw), targets[i:i + 1])

    return loop_grads(model, example_loss, targets.shape[0])


def loop_dp_sgd_grads(model, loss_fn, inputs: tuple, targets, *, max_grad_norm,
                      loss_reduction="mean", kwargs=None, expected_batch_size=None, gamma=None):
    """The DP-SGD gradient with sigma = 0 from a batch-of-one autograd loop
    (``loop_example_grads``), divided by D: ``expected_batch_size`` or the batch for "mean"."""
    batch = targets.shape[0]
    denom = (expected_batch_size or batch or 1) if loss_reduction == "mean" else 1
    return clipped_sum(loop_example_grads(model, loss_fn, inputs, targets, kwargs),
                       max_grad_norm, denom, gamma)


def run_dpfx_multi(dp_model, model, loss_fn, inputs: tuple, targets, loss_reduction="mean",
                   kwargs=None):
    """One step through dpfx with several inputs: {name: p.grad clone}, grads left zeroed."""
    model.zero_grad(set_to_none=True)
    out = dp_model(*inputs, **(kwargs or {}))
    loss = batch_loss(loss_fn, out, targets) if targets.shape[0] else out.sum() * 0.0
    with _scale_warnings_expected():
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


def check_one_compiled_pair(dp, model, loss_fn, make, batches, reduction, *, max_grad_norm,
                            divisor=1, around=contextlib.nullcontext, tol=None, bites=True,
                            gamma=None):
    """dpfx (sigma 0) against the batch-of-one loop (``loop_dp_sgd_grads``) at each batch size
    of ``batches`` (``make(b)`` gives (inputs, targets)), all through one compiled forward and
    backward pair, the self-check run on both. ``divisor``: D of the "mean" reduction (the
    expected batch size ``dp`` was compiled with); ``around``: a context manager around each
    dpfx step; ``bites``: every example's norm exceeds the bound, so clipping bites on each;
    ``gamma``: automatic clipping's (``clipped_sum``)."""
    for b in batches:
        inputs, y = make(b)
        if bites:
            norms = per_example_norms(loop_example_grads(model, loss_fn, inputs, y))
            assert bool((norms > max_grad_norm + CLIP_EPS).all()), f"batch size {b}: {norms}"
        with around():
            got = run_dpfx_multi(dp, model, loss_fn, inputs, y, reduction)
        want = loop_dp_sgd_grads(model, loss_fn, inputs, y, max_grad_norm=max_grad_norm,
                                 loss_reduction="sum", gamma=gamma)
        if reduction == "mean":
            want = {k: v / divisor for k, v in want.items()}
        try:
            assert_close(got, want, **(tol or {"rtol": 2e-4, "atol": 1e-6}))
        except AssertionError as e:
            raise AssertionError(f"batch size {b}: {e}") from None
    assert dp.compile_count == 2, "one compiled pair serves every batch size"
    checks = list(dp._dpfx_backend._checks.values())
    assert checks and all(c.done and c.backward is not None for c in checks), \
        "the self-check must have run on the compiled forward and backward"
