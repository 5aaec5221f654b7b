"""Post-processing of dpfx's release reaches a private step; a plain gradient does not
(Note [Only dpfx's gradients reach a private step] in dpfx/loss/gate.py).

Every allowed edit is checked against the update computed by hand from the released gradient;
every refused order leaves the parameters as they were, and the same loop without the foreign
gradient then steps (the positive control)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx

LR = 0.5


def _setup(backend="eager", noise="graph", share=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=1.0, backend=backend,
                      noise=noise, expected_batch_size=6)
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), dp)
    other = None
    if share:                          # a module outside dpfx sharing the last layer's weight
        other = nn.Linear(8, 3)
        other.weight = model[2].weight
    return model, dp, opt, other


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 4, generator=g) * 3, torch.arange(6) % 3


def _private_backward(dp):
    x, y = _data()
    F.cross_entropy(dp(x), y).backward()


def _raw_backward(model):
    x, y = _data()
    F.cross_entropy(model(x), y).backward()


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _released(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_stepped(model, before, grads):
    """SGD without momentum: p <- p - lr * g, with g the post-processed release."""
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n] - LR * grads[n], rtol=0, atol=1e-7,
                                   msg=lambda m: f"{n}: {m}")
        assert not torch.equal(p.detach(), before[n]), n


# -- allowed: edits of the release, in place ------------------------------------------------------

def _clip_norm(model, opt, r, before):
    total = torch.sqrt(sum(g.pow(2).sum() for g in r.values()))
    assert total > 0.05                         # the clip bites
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    return {n: g * (0.05 / (total + 1e-6)) for n, g in r.items()}


def _clip_value(model, opt, r, before):
    assert any(bool((g.abs() > 0.01).any()) for g in r.values())
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    return {n: g.clamp(-0.01, 0.01) for n, g in r.items()}


def _weight_decay(model, opt, r, before):
    for p in model.parameters():
        p.grad.add_(p, alpha=0.1)
    return {n: g + 0.1 * before[n] for n, g in r.items()}


def _read(model, opt, r, before):
    for p in model.parameters():                # what a logger does
        float(p.grad.norm()), p.grad.tolist(), p.grad.detach().clone(), p.grad.numpy()
    return r


def _raw_autograd_grad(model, opt, r, before):
    x, y = _data()                              # computes gradients, accumulates none
    torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    return r


_ALLOWED = {"clip_grad_norm_": _clip_norm, "clip_grad_value_": _clip_value,
            "weight decay in place": _weight_decay, "reading": _read,
            "autograd.grad of the raw model": _raw_autograd_grad}


@pytest.mark.parametrize("edit", list(_ALLOWED))
def test_post_processing_reaches_the_step(edit):
    model, dp, opt, _ = _setup()
    for _ in range(2):                          # the second round edits a reused p.grad
        opt.zero_grad(set_to_none=False)
        _private_backward(dp)
        before, r = _params(model), _released(model)
        want = _ALLOWED[edit](model, opt, r, before)
        opt.step()
        _assert_stepped(model, before, want)


def test_grad_scaler_unscale_reaches_the_step():
    """What GradScaler.unscale_ does to p.grad: its kernel multiplies every gradient by 1/scale in
    place and flags non-finite values; the step then takes the unscaled release."""
    model, dp, opt, _ = _setup()
    _private_backward(dp)
    before, r = _params(model), _released(model)
    found_inf = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(
        [p.grad for p in model.parameters()], found_inf, torch.full((1,), 1 / 8.0))
    assert found_inf.item() == 0
    opt.step()
    _assert_stepped(model, before, {n: g / 8.0 for n, g in r.items()})


@pytest.mark.filterwarnings("ignore::dpfx.PlainGradientWarning")   # a plain backward on purpose
def test_plain_gradient_zeroed_in_place_is_gone():
    """A plain gradient zeroed in place (zero_grad(set_to_none=False)) carries nothing: the
    private backward accumulates into it and the step takes the release."""
    model, dp, opt, _ = _setup()
    _raw_backward(model)
    opt.zero_grad(set_to_none=False)
    _private_backward(dp)
    before, r = _params(model), _released(model)
    opt.step()
    _assert_stepped(model, before, r)


# -- refused: a gradient autograd accumulated outside dpfx's graph, a replaced p.grad -------------

def _raw_after(model, dp, other):
    _private_backward(dp)
    _raw_backward(model)


def _sharing_module_after(model, dp, other):
    _private_backward(dp)
    x, y = _data()
    F.cross_entropy(other(torch.tanh(model[0](x)).detach()), y).backward()


def _plain_create_graph_after(model, dp, other):
    _private_backward(dp)
    x, y = _data()
    F.cross_entropy(model(x), y).backward(create_graph=True)   # a new p.grad tensor


def _replaced(model, dp, other):
    _private_backward(dp)
    model[0].weight.grad = torch.randn_like(model[0].weight)


def _replaced_out_of_place(model, dp, other):
    _private_backward(dp)              # the value is post-processing, but dpfx cannot
    model[2].bias.grad = model[2].bias.grad * 0.5     # vouch for a tensor it did not write


def _raw_before(model, dp, other):
    _raw_backward(model)
    with pytest.raises(dpfx.PrivacyError, match="already holds a gradient that is not dpfx's "
                                                "release: autograd accumulated a plain"):
        _private_backward(dp)


def _one_backward_call(model, dp, other):
    x, y = _data()
    with pytest.raises(dpfx.PrivacyError, match="beyond the private one"):
        (F.cross_entropy(dp(x), y)
         + F.cross_entropy(F.linear(torch.randn(6, 8), model[2].weight), y)).backward()
    assert model[2].weight.grad is None         # refused before accumulating


_PLAIN = "autograd accumulated a plain gradient"
_ASSIGNED = r"a tensor assigned to p\.grad"
_REFUSED = {"raw model after": (_raw_after, _PLAIN),
            "sharing module after": (_sharing_module_after, _PLAIN),
            "raw model after, create_graph": (_plain_create_graph_after, _PLAIN),
            "p.grad replaced": (_replaced, _ASSIGNED),
            "p.grad replaced out of place": (_replaced_out_of_place, _ASSIGNED),
            "raw model before": (_raw_before, _PLAIN),
            "one backward call": (_one_backward_call, None)}     # refused at the backward


@pytest.mark.filterwarnings("ignore::dpfx.PlainGradientWarning")   # a plain backward on purpose
@pytest.mark.parametrize("order, noise", [
    (order, noise) for order in _REFUSED for noise in ("graph", "optimizer")
    if not (noise == "optimizer" and order == "p.grad replaced out of place")])   # p.grad: None
def test_foreign_gradient_refused_parameters_untouched(order, noise):
    model, dp, opt, other = _setup(noise=noise, share=True)
    foreign, why = _REFUSED[order]
    before = _params(model)
    foreign(model, dp, other)
    if why is not None:
        with pytest.raises(dpfx.PrivacyError, match=f"has a gradient that is not dpfx's "
                                                    f"release: .*{why}"):
            opt.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    opt.zero_grad()                             # positive control: the loop without it steps
    _private_backward(dp)
    r = _released(model) if noise == "graph" else None
    opt.step()
    if r is not None:
        _assert_stepped(model, before, r)
    else:
        assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())


# -- noise="optimizer": the release exists inside step() only ------------------------------------

def test_optimizer_noise_post_processing_in_the_inner_step_hook():
    """Between backward and step p.grad is None: clip_grad_norm_ there finds nothing. The noised
    gradient DPOptimizer writes is post-processed in a pre-hook of the inner optimizer."""
    model, dp, opt, _ = _setup(noise="optimizer")
    seen = {}

    def clip_release(optimizer, args, kwargs):
        seen.update(_released(model))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)

    opt.original_optimizer.register_step_pre_hook(clip_release)
    for _ in range(2):
        opt.zero_grad()
        _private_backward(dp)
        assert all(p.grad is None for p in model.parameters())
        assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)) == 0.0
        before = _params(model)
        opt.step()
        total = torch.sqrt(sum(g.pow(2).sum() for g in seen.values()))
        assert total > 0.05
        _assert_stepped(model, before, {n: g * (0.05 / (total + 1e-6)) for n, g in seen.items()})


@pytest.mark.filterwarnings("ignore::dpfx.PlainGradientWarning")   # a plain backward on purpose
@pytest.mark.parametrize("after", [0, 1])
def test_virtual_batches_refuse_a_plain_gradient(after):
    """A plain backward after a physical batch's: refused at the next physical backward, or at
    the logical batch's step; nothing is stepped."""
    model, dp, opt, _ = _setup(noise="optimizer")
    x, y = _data()
    before = _params(model)
    with pytest.raises(dpfx.PrivacyError, match=_PLAIN):
        for i, (cx, cy) in enumerate(dpfx.VirtualBatches([(x, y)], 3, opt)):
            opt.zero_grad()
            F.cross_entropy(dp(cx), cy).backward()
            if i == after:
                _raw_backward(model)
            opt.step()
    assert opt.steps == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# -- the same through Inductor ---------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::dpfx.PlainGradientWarning")   # a plain backward on purpose
def test_post_processing_and_refusals_through_inductor():
    """One compile of the default backend: clip_grad_norm_ and weight decay step exactly; a plain
    backward after dpfx's and a replaced p.grad are refused with the parameters untouched."""
    model, dp, opt, _ = _setup(backend="inductor")
    for edit in (_clip_norm, _weight_decay):
        opt.zero_grad()
        _private_backward(dp)
        before, r = _params(model), _released(model)
        want = edit(model, opt, r, before)
        opt.step()
        _assert_stepped(model, before, want)
    for foreign, why in (_REFUSED["raw model after"], _REFUSED["p.grad replaced"]):
        opt.zero_grad()
        before = _params(model)
        foreign(model, dp, None)
        with pytest.raises(dpfx.PrivacyError, match=why):
            opt.step()
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert dp.compile_count == 2
