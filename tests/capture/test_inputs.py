"""What dpfx does with the user's inputs: several tensors share one batch symbol, keyword inputs
work, the caller's tensors come back untouched, and two forwards into one backward are refused
(Note [One forward per backward] in dpfx/loss/gate.py). What a capture meets in the process: an
earlier plain compile of the same class, earlier captures and Logger methods added since."""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import dpfx
from support.reference import assert_close, loop_dp_sgd_grads, run_dpfx_multi
from support.sweep import examples


class MaskedAttention(nn.Module):
    """SDPA with an attention-mask input: (x, mask) both carry the batch."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.fc = nn.Linear(d, 3)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.fc(o.transpose(1, 2).reshape(b, t, d).mean(1))


def _mask(b, t=6):
    mask = torch.rand(b, 1, t, t) > 0.3
    mask[..., 0] = True      # every query sees at least one key
    return mask


@settings(max_examples=examples(6), deadline=None)
@given(batch=st.sampled_from([0, 1, 2, 5]), reduction=st.sampled_from(["mean", "sum"]),
       as_kwarg=st.booleans())
def test_mask_input_shares_the_batch_symbol(batch, reduction, as_kwarg):
    torch.manual_seed(batch)
    model = MaskedAttention()
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, backend="eager",
                      loss_reduction=reduction, expected_batch_size=4)
    x, mask, y = torch.randn(batch, 6, 8), _mask(batch), torch.randint(0, 3, (batch,))
    args, kwargs = ((x,), {"mask": mask}) if as_kwarg else ((x, mask), {})
    got = run_dpfx_multi(dp, model, F.cross_entropy, args, y, reduction, kwargs)
    want = loop_dp_sgd_grads(model, F.cross_entropy, args, y, max_grad_norm=0.05,
                             loss_reduction="sum", kwargs=kwargs)
    denom = 4 if reduction == "mean" else 1
    assert_close(got, {k: v / denom for k, v in want.items()}, rtol=1e-4, atol=1e-6)


def test_mask_input_through_inductor():
    model = MaskedAttention()
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0)
    for batch in [4, 2, 1]:
        x, mask, y = torch.randn(batch, 6, 8), _mask(batch), torch.randint(0, 3, (batch,))
        got = run_dpfx_multi(dp, model, F.cross_entropy, (x, mask), y)
        want = loop_dp_sgd_grads(model, F.cross_entropy, (x, mask), y, max_grad_norm=0.05)
        assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert dp.compile_count == 2


def test_inputs_of_different_batch_sizes_refused():
    dp = dpfx.compile(MaskedAttention(), max_grad_norm=1.0, noise_multiplier=0.0,
                      backend="eager")
    with pytest.raises(ValueError, match="same size"):
        dp(torch.randn(3, 6, 8), _mask(2))


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


@pytest.mark.parametrize("case", ["linear", "conv", "captured loss"])
def test_wrong_feature_size_is_named(case):
    """An input that does not fit a layer (Note [Naming the layer an input does not fit] in
    capture/errors.py): one error naming the layer's path and type, what it expects and the
    shapes it got, without torch's fake-tensor traceback in the log; the model still trains on
    inputs that fit afterwards."""
    if case == "conv":
        model, good, bad = _ConvNet(), torch.randn(4, 3, 6, 6), torch.randn(4, 1, 6, 6)
        want = (r"the input of layer 'features.0' \(Conv2d\) does not fit it: it expects "
                r"\[B, 3, \.\.\.\] \(3 channels\) and got \[4, 1, 6, 6\]")
    else:
        model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
        good, bad = torch.randn(4, 20), torch.randn(4, 21)
        want = (r"the input of layer '0' \(Linear\) does not fit it: it expects \[\.\.\., 20\] "
                r"and got \[4, 21\] \(.*\[4, 21\]")
    loss = (lambda out, y: F.cross_entropy(out, y)) if case == "captured loss" else None
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, loss=loss)
    y = torch.tensor([0, 1, 1, 0])

    def step(x):
        return dp.loss(x, y) if loss else F.cross_entropy(dp(x), y)

    logged = []
    handler = logging.Handler()
    handler.emit = logged.append
    log = logging.getLogger("torch._subclasses.fake_tensor")
    log.addHandler(handler)
    try:
        with pytest.raises(dpfx.CaptureError, match=want) as caught:
            step(bad)
        log.error("failed while attempting to run meta for %s", "an op outside dpfx")
    finally:
        log.removeHandler(handler)
    assert "u0" not in str(caught.value) and caught.value.__cause__ is None
    assert [r.getMessage() for r in logged] == [   # only dpfx's captures are quiet
        "failed while attempting to run meta for an op outside dpfx"]
    model.zero_grad()
    step(good).backward()
    assert_close({k: p.grad for k, p in model.named_parameters()},
                 loop_dp_sgd_grads(model, F.cross_entropy, (good,), y, max_grad_norm=1.0),
                 rtol=1e-4, atol=1e-6)


@pytest.mark.filterwarnings("ignore::dpfx.LossScaleWarning")  # the loss's scale changed: expected
def test_caller_tensors_untouched():
    """The batch marks live on the tensor only during the call; a later plain torch.compile of
    the same tensor sees none of them."""
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    x.note = "mine"
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    dp(x).sum().backward()
    assert x.__dict__ == {"note": "mine"}
    out = torch.compile(lambda t: t * 2, fullgraph=True)(x)
    torch.testing.assert_close(out, x * 2)


class Twice(nn.Module):
    """Both inputs through one Linear: its weight and bias are used twice per example."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(4, 2)

    def forward(self, a, b):
        return self.f(a) + self.f(b)


def test_two_forwards_one_backward_refused():
    model = nn.Linear(4, 2)
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager",
                      loss_reduction="sum")
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    with pytest.raises(dpfx.PrivacyError, match="two forwards"):
        (dp(a) + dp(b)).sum().backward()
    model.zero_grad(set_to_none=True)
    dp(a).sum().backward()       # one backward per forward: two separate DP steps, allowed
    dp(b).sum().backward()
    assert model.weight.grad is not None


@pytest.mark.filterwarnings("ignore::dpfx.LossScaleWarning")  # the loss's scale changed: expected
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_one_module_for_both_views_is_exact(backend):
    """The fix the refusal suggests: one forward taking both views, clipped jointly."""
    model = Twice()
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, backend=backend)
    a, b, y = torch.randn(5, 4), torch.randn(5, 4), torch.randn(5, 2)
    mse = lambda out, t: F.mse_loss(out, t, reduction="sum")  # noqa: E731
    got = run_dpfx_multi(dp, model, mse, (a, b), y)
    assert_close(got, loop_dp_sgd_grads(model, mse, (a, b), y, max_grad_norm=0.05),
                 rtol=1e-4, atol=1e-6)


class EmbeddingLSTM(nn.Module):
    """Plain torch.compile breaks its graph at the nn.LSTM (dynamo does not trace RNN modules)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 4)
        self.lstm = nn.LSTM(4, 5, batch_first=True)
        self.fc = nn.Linear(5, 3)

    def forward(self, ids):
        return self.fc(self.lstm(self.emb(ids))[1][0][-1])


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_plain_compile_of_the_same_class_first(backend):
    """dynamo caches compiled code per code object, whatever the backend: after a plain
    torch.compile of another EmbeddingLSTM, dpfx's call was served the plain graph for the
    embedding (never clipped) and given only the LSTM frame. dpfx's own entry frame (Note [dpfx's
    own entry frame] in capture/entry.py) keeps the whole model in its graph: exact, every parameter with
    its rule."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ids, y = torch.randint(0, 30, (4, 6)), torch.arange(4) % 3
    plain = torch.compile(EmbeddingLSTM())
    F.cross_entropy(plain(ids), y).backward()
    model = EmbeddingLSTM()
    dp = dpfx.compile(model, max_grad_norm=0.01, noise_multiplier=0.0, backend=backend)
    for batch in (4, 1):
        got = run_dpfx_multi(dp, model, F.cross_entropy, (ids[:batch],), y[:batch])
        want = loop_dp_sgd_grads(model, F.cross_entropy, (ids[:batch],), y[:batch],
                                 max_grad_norm=0.01)
        assert_close(got, want, rtol=1e-4, atol=1e-6)
    rules = {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}
    assert rules["emb.weight"] == ["embedding"], rules
    assert set(rules) == {n for n, _ in model.named_parameters()}
    assert dp.compile_count == 2


_LOG = logging.getLogger("dpfx.tests")


class Logs(nn.Module):
    """Logs from its forward through the Logger method ``method``, as Hugging Face models do."""

    def __init__(self, method="warning"):
        super().__init__()
        self.method, self.fc = method, nn.Linear(4, 3)

    def forward(self, x):
        getattr(_LOG, self.method)("inside the forward")
        return self.fc(x)


def test_logging_inside_the_forward_across_captures(monkeypatch):
    """Note [Logging inside the forward] in capture/entry.py: every capture in the process skips the
    Logger calls, that of a second model, one after torch._dynamo.reset(), and one calling a
    Logger method added after the first capture (transformers adds ``warning_once`` when it is
    imported, which may be after dpfx compiled another model)."""
    def step(model):
        dp = dpfx.compile(model, max_grad_norm=0.01, noise_multiplier=0.0, backend="eager")
        x, y = torch.randn(4, 4), torch.arange(4) % 3
        got = run_dpfx_multi(dp, model, F.cross_entropy, (x,), y)
        assert_close(got, loop_dp_sgd_grads(model, F.cross_entropy, (x,), y, max_grad_norm=0.01))

    torch.manual_seed(0)
    step(Logs())
    step(Logs())
    torch._dynamo.reset()
    step(Logs())
    monkeypatch.setattr(logging.Logger, "warning_once",
                        lambda self, *args, **kwargs: self.warning(*args, **kwargs), raising=False)
    step(Logs("warning_once"))


def test_gradient_from_outside_the_graph_refused():
    """A trainable parameter the compiled forward does not read but the loss does: its gradient
    would be plain. Refused when autograd computes it (Note [Every gradient a parameter receives
    is dpfx's] in grad_guards.py); an unused parameter trips nothing."""
    class WithSpare(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.spare, self.unused = nn.Linear(4, 3), nn.Linear(3, 3), nn.Linear(2, 2)

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    model = WithSpare()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    x, y = torch.randn(5, 4), torch.arange(5) % 3
    F.cross_entropy(dp(x), y).backward()
    assert model.body.weight.grad is not None and model.unused.weight.grad is None
    model.zero_grad(set_to_none=True)
    with pytest.raises(dpfx.PrivacyError, match=r"parameter 'spare\.(weight|bias)' received a "
                                                r"gradient, but dpfx's compiled graph does not"):
        F.cross_entropy(model.spare(dp(x)), y).backward()
    assert model.spare.weight.grad is None and model.spare.bias.grad is None


@pytest.mark.filterwarnings("ignore::dpfx.PlainGradientWarning")   # a plain backward on purpose
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_second_use_outside_the_graph_refused(backend):
    """A parameter the graph reads and the loss uses as well: autograd would add the plain
    gradient of the second use to dpfx's private one. Refused before accumulation; plain autograd
    on the raw model (a backward that never ran dpfx's graph) is left alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend=backend)
    x, y = torch.randn(5, 4), torch.arange(5) % 3
    F.cross_entropy(dp(x), y).backward()
    model.zero_grad(set_to_none=True)
    with pytest.raises(dpfx.PrivacyError, match=r"parameter '2\.weight' received a gradient "
                                                r"beyond the private one"):
        (F.cross_entropy(dp(x), y) + (model[2].weight * x.mean()).sum()).backward()
    assert model[2].weight.grad is None
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()   # non-private by the caller's choice: not dpfx's
    assert model[2].weight.grad is not None
    model.zero_grad(set_to_none=True)
    F.cross_entropy(dp(x), y).backward()      # and dpfx's next step is fine
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_parameter_reached_through_an_input_is_refused_at_the_forward(backend):
    """With ``allow_input_grads``, an input computed from one of the model's own parameters
    outside its forward would carry that parameter's plain gradient into p.grad beside the
    private one: refused at the forward, naming the parameter. An input computed by a trainable
    module of another model is the caller's accepted non-private input gradient: it trains, and
    the model's own gradients are exactly the private ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=0.0, backend=backend,
                      allow_input_grads=True)
    x, y = torch.randn(6, 4), torch.arange(6) % 3
    with pytest.raises(dpfx.PrivacyError, match=r"parameter '0\.weight' reaches dpfx's compiled "
                                                r"module through one of its inputs"):
        dp(x * model[0].weight[0])
    assert all(p.grad is None for p in model.parameters())
    upstream = nn.Linear(4, 4)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(dp(upstream(x)), y).backward()
    assert upstream.weight.grad is not None
    ref = loop_dp_sgd_grads(model, F.cross_entropy, (upstream(x).detach(),), y,
                            max_grad_norm=0.5)
    assert_close({n: p.grad for n, p in model.named_parameters()}, ref)


@pytest.mark.filterwarnings("ignore::dpfx.PlainGradientWarning")
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_backward_of_several_roots_is_walked_before_it_runs(backend):
    """``torch.autograd.backward([loss, other])`` with ``other`` not computed from dpfx's
    outputs by the ops it follows: a root that reaches one of the model's parameters, or dpfx's
    compiled function itself (a coupling term computed with torch function dispatch off, which
    ran unchecked beside the checked loss), is refused before anything is written; one over
    another model's parameters alone runs, that model's gradient plain and the private one
    exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=0.0, backend=backend)
    x, y = torch.randn(6, 4), torch.arange(6) % 3
    with pytest.raises(dpfx.PrivacyError, match=r"parameter '2\.weight' received a gradient "
                                                r"beyond the private one"):
        torch.autograd.backward([F.cross_entropy(dp(x), y), model[2].weight.pow(2).sum()])
    assert all(p.grad is None for p in model.parameters())
    out = dp(x)
    with torch._C.DisableTorchFunctionSubclass():     # a term that left dpfx's tracking
        coupled = (out - out.mean(0)).pow(2).sum()
    with pytest.raises(dpfx.PrivacyError, match="one of which reaches dpfx's compiled module "
                                                "without being computed"):
        torch.autograd.backward([F.cross_entropy(out, y), coupled])
    assert all(p.grad is None for p in model.parameters())
    other = nn.Linear(4, 3)
    torch.autograd.backward([F.cross_entropy(dp(x), y), F.cross_entropy(other(x), y)])
    assert other.weight.grad is not None
    assert_close({n: p.grad for n, p in model.named_parameters()},
                 loop_dp_sgd_grads(model, F.cross_entropy, (x,), y, max_grad_norm=0.5))


@pytest.mark.filterwarnings("ignore::dpfx.PlainGradientWarning")   # a plain backward on purpose
def test_autograd_grad_reads_no_p_grad():
    """``torch.autograd.grad`` accumulates nothing, so a plain gradient left in p.grad is not its
    concern (exact both ways): it returns the private gradients and leaves p.grad as it was,
    while ``backward`` over that p.grad is refused before writing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=0.0, backend="eager")
    x, y = torch.randn(6, 4), torch.arange(6) % 3
    F.cross_entropy(model(x), y).backward()          # plain, on the raw model
    held = {n: p.grad.clone() for n, p in model.named_parameters()}
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(F.cross_entropy(dp(x), y), params)
    assert_close(dict(zip(names, grads)),
                 loop_dp_sgd_grads(model, F.cross_entropy, (x,), y, max_grad_norm=0.5))
    assert_close({n: p.grad for n, p in model.named_parameters()}, held)
    with pytest.raises(dpfx.PrivacyError, match="already holds a gradient that is not dpfx's"):
        F.cross_entropy(dp(x), y).backward()
    assert_close({n: p.grad for n, p in model.named_parameters()}, held)


class TokenModel(nn.Module):
    def __init__(self, vocab=30, d=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.fc(torch.tanh(self.emb(ids)))


def _token_loss(out, y):
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1).sum()


def test_strided_input_after_a_contiguous_one():
    """Note [Inputs enter row-major] in dpfx/compiled_call.py: a graph captured on a
    contiguous batch serves ``ids[:, :-1]`` and an ``unfold`` window (overlapping rows) through
    Inductor, in training (exact against the batch-of-one loop) and under no_grad."""
    torch.manual_seed(0)
    model = TokenModel()
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, loss_reduction="sum")
    ids = torch.randint(0, 30, (6, 9))
    run_dpfx_multi(dp, model, _token_loss, (ids[:, :-1].contiguous(),), ids[:, 1:],
                   loss_reduction="sum")
    windows = torch.randint(0, 30, (80,)).unfold(0, 9, 3)[:5]       # rows overlap in storage
    for x in (ids[:, :-1], windows[:, :-1]):
        assert not x.is_contiguous()
        y = x.roll(1, 1).contiguous()
        got = run_dpfx_multi(dp, model, _token_loss, (x,), y, loss_reduction="sum")
        want = loop_dp_sgd_grads(model, _token_loss, (x,), y, max_grad_norm=0.05,
                                 loss_reduction="sum")
        assert_close(got, want, rtol=1e-4, atol=1e-6)
        with torch.no_grad():
            torch.testing.assert_close(dp(x), model(x))


class _Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def _freeze_counts_inside_captures(monkeypatch) -> list:
    """``gc.get_freeze_count()`` as each capture's backward is rewritten, appended to the list."""
    import gc

    import dpfx.backend as backend_module
    seen = []
    compile_backward = backend_module.compile_backward

    def spying(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return compile_backward(*args, **kwargs)

    monkeypatch.setattr(backend_module, "compile_backward", spying)
    return seen


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_heap_frozen_only_during_a_capture(monkeypatch, backend):
    """Note [The heap frozen during a capture] in capture/entry.py: while dpfx captures, the objects
    that existed before are frozen; after it, none are, and cyclic garbage from before the capture
    is collected; a refused capture unfreezes too; the gradient is DP-SGD's."""
    import gc
    import weakref

    seen = _freeze_counts_inside_captures(monkeypatch)
    assert gc.get_freeze_count() == 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    dp = dpfx.compile(model, max_grad_norm=0.01, noise_multiplier=0.0,
                      **({} if backend == "inductor" else {"backend": "eager"}))
    threshold = gc.get_threshold()
    gc.set_threshold(1 << 30, *threshold[1:])   # the cycle is still there when the capture starts
    try:
        garbage = _Cycle()
        dead = weakref.ref(garbage)
        del garbage
        before = len(gc.get_objects())
        x, y = torch.randn(5, 4), torch.arange(5) % 3
        got = run_dpfx_multi(dp, model, F.cross_entropy, (x,), y)
    finally:
        gc.set_threshold(*threshold)
    # (frozen objects that reference counting frees leave the permanent generation)
    assert len(seen) == 1 and seen[0] > before // 2, (seen, before)
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert dead() is None
    assert_close(got, loop_dp_sgd_grads(model, F.cross_entropy, (x,), y, max_grad_norm=0.01))

    class Mixes(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x - x.mean(0))

    with pytest.raises(dpfx.PrivacyError):
        dpfx.compile(Mixes(), max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")(x)
    assert gc.get_freeze_count() == 0


def test_heap_left_alone_where_the_process_froze_it(monkeypatch):
    """A process that froze objects itself (a forking server does) keeps them frozen, and dpfx
    neither freezes nor unfreezes; with the collector off, nothing is frozen either."""
    import gc

    seen = _freeze_counts_inside_captures(monkeypatch)
    x, y = torch.randn(3, 4), torch.arange(3) % 3
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        model = nn.Sequential(nn.Linear(4, 3))
        dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
        F.cross_entropy(dp(x), y).backward()
        # the count only falls (reference counting frees frozen objects); unfrozen it would be 0
        assert len(seen) == 1 and frozen // 2 < seen[0] <= frozen
        assert frozen // 2 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        model = nn.Sequential(nn.Linear(4, 3))
        dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
        F.cross_entropy(dp(x), y).backward()
        assert seen[1:] == [0] and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_a_calls_tensors_are_read_in_pytrees_order():
    """The call reads its tensors without pytree's walk where they are given directly; the
    tensors and their order are pytree's in every case (the batch check, the marks and the
    loss tracking pair them by position)."""
    import torch.utils._pytree as pytree
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    from dpfx.compiled_call import output_leaves, tensor_leaves

    a, b, c = torch.zeros(2, 3), torch.ones(2), torch.arange(2)
    calls = [((a,), {}), ((), {"input_ids": c, "attention_mask": b}),
             ((a, None, 3), {"use_cache": False, "mask": b}), ((a, [b, c]), {"x": (b,)}),
             ((), {"batch": {"ids": c, "mask": b}, "flag": True}), ((a, "text", 1.5), {})]
    for args, kwargs in calls:
        expected = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        got = tensor_leaves(args, kwargs)
        assert len(got) == len(expected) and all(g is e for g, e in zip(got, expected))
    outputs = [a, (a, b), [b, c], (a, None), (a, (b, c)), {"logits": a},
               CausalLMOutputWithCrossAttentions(logits=a),
               CausalLMOutputWithCrossAttentions(loss=b, logits=a),
               CausalLMOutputWithCrossAttentions(logits=a, hidden_states=(b, c))]
    for out in outputs:
        expected = pytree.tree_leaves(out)
        got = output_leaves(out)
        assert len(got) == len(expected) and all(g is e for g, e in zip(got, expected))


def test_inputs_without_one_batch_dim_are_refused():
    """Every tensor input carries the batch in dim 0, of one size: a 0-d input and inputs of
    two sizes are refused by name, before anything is captured."""
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x, w):
            return self.fc(x) * w

    model = Two()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    with pytest.raises(dpfx.errors.CaptureError, match="got a 0-d tensor"):
        dp(torch.randn(5, 4), torch.tensor(2.0))
    with pytest.raises(ValueError, match=r"same size; got shapes \[\(5, 4\), \(4, 1\)\]"):
        dp(torch.randn(5, 4), torch.ones(4, 1))
    assert dp.compile_count == 0 and model.fc.weight.grad is None
    assert dp(torch.randn(5, 4), torch.ones(5, 1)).shape == (5, 3)


def test_a_steady_step_compares_no_tensor_with_eq(monkeypatch):
    """Note [Tensors are compared by identity] (grad_guards.py): a steady step of the plain loop
    and of the captured loss calls no ``Tensor.__eq__`` (``list.count(None)`` over gradients
    did, raising and catching a TypeError inside torch for every parameter)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=1.0, backend="eager")
    captured = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=1.0, backend="eager",
                            loss=F.cross_entropy)
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp)
    x, y = torch.randn(6, 4), torch.arange(6) % 3

    def steps():
        for _ in range(2):
            F.cross_entropy(dp(x), y).backward()
            opt.step()
            opt.zero_grad()
        for _ in range(2):
            captured.loss(x, y).backward()
            model.zero_grad(set_to_none=True)

    steps()
    calls = []
    eq = torch.Tensor.__eq__
    monkeypatch.setattr(torch.Tensor, "__eq__", lambda a, b: calls.append(b) or eq(a, b))
    steps()
    assert calls == []
