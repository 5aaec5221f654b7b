"""The captured loss's gradient program in its cross-entropy form (Note [The cross-entropy form]
in dpfx/loss/form.py) and ``dpfx::loss_gradient`` (Note [The loss inside the graph], step 4).

The rewritten program against autograd's own, traced the way ``_Program.gradient`` traces it,
over shapes, batch sizes 0 and 1, ignored targets, class weights, label smoothing and all three
reductions; the rewrite's structure; the op's value and gradient; and, through Inductor, the
graphs a captured cross-entropy compiles to (the logits read for the loss, never for the
gradient's surrogate) beside a batch-of-one reference.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import dpfx
from dpfx.loss.form import cross_entropy_form
from support.sweep import examples

aten = torch.ops.aten


def _program(loss):
    """(value, d loss / d x) traced with autograd's formulas and a symbolic batch."""
    def program(x, y, w):
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            value = loss(x, y, w)
            g, = torch.autograd.grad(value, [x])
        return value.detach(), g.detach()
    return program


def _targets(op):
    return {n.target for n in op.graph.nodes if n.op == "call_function"}


@settings(max_examples=examples(40), deadline=None, derandomize=True)
@given(batch=st.sampled_from([0, 1, 2, 5, 7]), classes=st.integers(2, 9),
       time=st.sampled_from([None, 1, 3]), ignored=st.booleans(), weighted=st.booleans(),
       smoothing=st.sampled_from([0.0, 0.2]), reduction=st.sampled_from(["mean", "sum", "none"]))
def test_rewritten_program_against_autograds(batch, classes, time, ignored, weighted,
                                             smoothing, reduction):
    """Value and gradient of the rewritten program against the untouched one; 3-d logits (N, C,
    T) take step 1 only, label smoothing keeps its sum over the classes."""
    torch.manual_seed(batch * 97 + classes * 7 + (time or 0))
    shape = (batch, classes) if time is None else (batch, classes, time)
    x = torch.randn(shape) * 3
    y = torch.randint(0, classes, (batch,) if time is None else (batch, time))
    if ignored and y.numel():
        y.view(-1)[::2] = -100
    w = torch.rand(classes) + 0.5

    def loss(x, y, w):
        out = F.cross_entropy(x, y, weight=w if weighted else None, ignore_index=-100,
                              label_smoothing=smoothing, reduction=reduction)
        return out.sum() if reduction == "none" else out

    want = make_fx(_program(loss), tracing_mode="symbolic")(x, y, w)
    got = make_fx(_program(loss), tracing_mode="symbolic")(x, y, w)
    assert cross_entropy_form(got)
    assert aten._log_softmax_backward_data.default not in _targets(got)
    assert aten._log_softmax.default not in _targets(got)
    with torch.no_grad():
        for a, b in zip(got(x, y, w), want(x, y, w)):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6, equal_nan=True)


def test_the_row_sum_is_read_at_the_target_only_for_class_indices():
    """Step 2 on 2-d logits with class indices; with label smoothing the gradient reaching
    log_softmax is more than nll_loss's and its sum over the classes stays a sum."""
    x, y, w = torch.randn(4, 6), torch.tensor([1, -100, 5, 0]), torch.ones(6)
    for smoothing, summed in ((0.0, False), (0.1, True)):
        gm = make_fx(_program(lambda x, y, w: F.cross_entropy(x, y, label_smoothing=smoothing)),
                     tracing_mode="symbolic")(x, y, w)
        assert cross_entropy_form(gm)
        sums = [n for n in gm.graph.nodes if n.target == aten.sum.dim_IntList]
        over_nll = [n for n in sums if n.args[0].target == aten.nll_loss_backward.default]
        assert not over_nll
        assert bool(sums) == summed, gm.graph
        assert (aten.gather.default in _targets(gm)) != summed
        lse, = [n for n in gm.graph.nodes if n.target == aten.logsumexp.default]
        assert len(lse.users) == 2      # the loss's log-probabilities and the gradient's


def test_a_program_without_the_pattern_is_left_alone():
    x, y, w = torch.randn(3, 4), torch.randn(3, 4), torch.ones(4)
    gm = make_fx(_program(lambda x, y, w: F.mse_loss(x, y)), tracing_mode="symbolic")(x, y, w)
    before = str(gm.graph)
    assert not cross_entropy_form(gm)
    assert str(gm.graph) == before


def test_loss_gradient_is_zero_with_the_gradient_it_is_given():
    from dpfx.ops.loss import loss_gradient

    out = torch.randn(3, 5, requires_grad=True)
    g = torch.randn(3, 5)
    for dtype in (torch.float32, torch.float64):
        z = loss_gradient(out, g, dtype)
        assert z.dtype == dtype and z.shape == () and float(z) == 0.0
        got, = torch.autograd.grad(z * 2.5, out)
        torch.testing.assert_close(got, 2.5 * g)


class _Head(nn.Module):
    def __init__(self, d=6, v=13):
        super().__init__()
        self.body, self.head = nn.Linear(d, d), nn.Linear(d, v)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.parametrize("batch", [3, 1, 13, 0])
def test_captured_cross_entropy_through_inductor(batch):
    """A token-mean cross-entropy with ignored targets through Inductor, self-check on, B = 3,
    1, 13 (= V) and 0 against a batch-of-one loop, a bound that bites; the forward graph returns
    the logits and each row's logsumexp, no product of the logits with a gradient, and the
    backward computes the gradient from them."""
    torch.manual_seed(batch)
    model = _Head()
    dp = dpfx.compile(model, loss=lambda out, y: F.cross_entropy(out, y, ignore_index=-100),
                      max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=4)
    x = torch.randn(batch, 6)
    y = torch.randint(0, 13, (batch,))
    if batch > 1:
        y[1] = -100
    model.zero_grad(set_to_none=True)
    dp.loss(x, y).backward()
    got = {k: p.grad if p.grad is not None else torch.zeros_like(p)
           for k, p in model.named_parameters()}
    want = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    for i in range(batch):
        if y[i] == -100:
            continue
        model.zero_grad(set_to_none=True)
        # each example's own term (Note [The per-example term] in dpfx/loss/check.py), on the
        # model itself: a public use of it (Note [The model passed to dpfx.compile])
        with dpfx.public(model):
            F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        gs = {k: p.grad.clone() for k, p in model.named_parameters()}
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in gs.values())))
        scale = min(1.0, 0.05 / (norm + 1e-6))
        for k in want:
            want[k] += gs[k] * scale
    for k in want:
        torch.testing.assert_close(got[k], want[k] / 4, rtol=1e-4, atol=1e-7)
    if batch == 0:
        return
    graphs = dp._dpfx_backend.stages.graphs
    forward, backward = graphs["forward"], graphs["backward.captured"]
    assert "loss_gradient" not in forward and "loss_gradient" not in backward
    assert "aten.logsumexp" not in forward            # decomposed: amax, sum of exp, log
    assert "aten.exp(" in backward and "aten.gather(" in backward
