"""Recurrent layers (nn.RNN, nn.GRU, nn.LSTM, packed sequences) against a batch-of-one reference.

dpfx captures the stock modules through the stand-in of dpfx/capture/rnn.py (the recurrence in F.linear
and gates). Each test checks the stand-in's forward against torch's own module, then compares
dpfx with sigma = 0 and a C that clips to the DP-SGD gradient computed example by example with
torch autograd on the unmodified module (vmap does not batch torch's fused RNN kernels), for every
batch size 0..N through one compiled graph, and asserts which rules fired.
"""
import pytest
import torch
import torch.nn as nn
from hypothesis import Phase, given, settings, strategies as st

import dpfx
from dpfx.capture import rnn
from support.models import CharLSTM, scale_weights, xent
from support.reference import (loop_dp_sgd_grads, loop_example_grads, per_example_norms,
                               run_dpfx_multi)
from support.sweep import examples

SETTINGS = settings(max_examples=examples(12), deadline=None, derandomize=True,
                    phases=[Phase.explicit, Phase.generate])
C = 0.05
KINDS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn_tanh": nn.RNN, "rnn_relu": nn.RNN}


def check(model, inputs, targets, *, reduction="mean", expected=None, backend="eager",
          batches=None, strategy="auto"):
    """dpfx equals the reference for every batch size (0 where D is known); clipping bites.
    Returns {parameter: rules fired}."""
    torch._dynamo.reset()
    clipped = per_example_norms(loop_example_grads(model, xent, inputs, targets)) > C
    assert clipped.any(), "C must clip some examples for the test to mean anything"
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction=reduction,
                      expected_batch_size=expected, backend=backend, strategy=strategy)
    tol = {"rtol": 1e-4, "atol": 1e-6} if backend == "inductor" else {"rtol": 1e-5,
                                                                       "atol": 1e-6}
    first = 0 if reduction == "sum" or expected else 1
    for batch in batches or range(first, targets.shape[0] + 1):
        part = tuple(t[:batch] for t in inputs)
        got = run_dpfx_multi(dp, model, xent, part, targets[:batch], reduction)
        want = loop_dp_sgd_grads(model, xent, part, targets[:batch], max_grad_norm=C,
                                 loss_reduction=reduction, expected_batch_size=expected)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **tol,
                                       msg=lambda m: f"batch size {batch}, {k}: {m}")
    assert dp.compile_count == 2
    return {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}


# -- models ----------------------------------------------------------------------------------------
class Seq(nn.Module):
    """A recurrent layer, then a Linear on the last step's output and the final hidden states.
    ``init``: None (zeros), "learned" (a parameter broadcast over the batch) or "input" (h0
    passed batch-first as a second input and transposed to torch's (layers, B, H))."""

    def __init__(self, kind, layers=1, bidirectional=False, batch_first=True, bias=True,
                 proj_size=0, init=None, dropout=0.0, d_in=3, hidden=4):
        super().__init__()
        kwargs = {"nonlinearity": kind[4:]} if kind.startswith("rnn") else {}
        if proj_size:
            kwargs["proj_size"] = proj_size
        self.rnn = KINDS[kind](d_in, hidden, num_layers=layers, bidirectional=bidirectional,
                               batch_first=batch_first, bias=bias, dropout=dropout, **kwargs)
        self.lstm, self.batch_first, self.init = kind == "lstm", batch_first, init
        states = layers * (2 if bidirectional else 1)
        out = proj_size or hidden
        if init == "learned":
            self.h0 = nn.Parameter(torch.randn(states, 1, out) * 0.5)
            if kind == "lstm":
                self.c0 = nn.Parameter(torch.randn(states, 1, hidden) * 0.5)
        self.head = nn.Linear(out * (2 if bidirectional else 1) + out, 3)

    def forward(self, x, h0=None):
        batch = x.shape[0]
        if self.init == "learned":
            h0 = self.h0.expand(-1, batch, -1)
            hx = (h0, self.c0.expand(-1, batch, -1)) if self.lstm else h0
        elif self.init == "input":
            h0 = h0.transpose(0, 1).contiguous()
            hx = (h0, torch.tanh(h0)) if self.lstm else h0
        else:
            hx = None
        if not self.batch_first:
            x = x.transpose(0, 1)
        out, h_n = self.rnn(x, hx)
        h_n = h_n[0] if self.lstm else h_n
        last = out[:, -1] if self.batch_first else out[-1]
        return self.head(torch.cat([last, h_n[-1]], -1))


class PackedLSTM(nn.Module):
    """pack_padded_sequence -> (bi)LSTM -> pad_packed_sequence, reading outputs and h_n."""

    def __init__(self, kind="lstm", bidirectional=True, layers=1, enforce_sorted=False):
        super().__init__()
        self.rnn = KINDS[kind](3, 4, num_layers=layers, bidirectional=bidirectional,
                               batch_first=True)
        self.lstm, self.enforce_sorted = kind == "lstm", enforce_sorted
        d = 2 if bidirectional else 1
        self.head = nn.Linear(4 * d + 4, 3)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=self.enforce_sorted)
        out, h_n = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True,
                                                  total_length=x.shape[1])
        h_n = h_n[0] if self.lstm else h_n
        return self.head(torch.cat([out.sum(1), h_n[-1]], -1))


def data(batch=4, steps=4, d_in=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, steps, d_in, generator=g) * 2, torch.arange(batch) % 3


# -- the stand-in computes torch's values ---------------------------------------------------------
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layers,bidirectional,proj", [(1, False, 0), (2, True, 0), (2, True, 2)])
@pytest.mark.parametrize("packed", [False, True])
def test_stand_in_matches_torch(kind, layers, bidirectional, proj, packed):
    if proj and kind != "lstm":
        pytest.skip("proj_size is LSTM's")
    torch.manual_seed(0)
    kwargs = {"nonlinearity": kind[4:]} if kind.startswith("rnn") else {}
    if proj:
        kwargs["proj_size"] = proj
    m = KINDS[kind](3, 4, num_layers=layers, bidirectional=bidirectional, batch_first=True,
                    dropout=0.3 if layers > 1 else 0.0, **kwargs).eval()
    x = torch.randn(3, 5, 3)
    out_size = proj or 4
    states = layers * (2 if bidirectional else 1)
    h0 = torch.randn(states, 3, out_size)
    hx = (h0, torch.randn(states, 3, 4)) if kind == "lstm" else h0
    lengths = torch.tensor([2, 5, 1])
    for state in (None, hx):
        if packed:
            want_out, want_h = m(nn.utils.rnn.pack_padded_sequence(
                x, lengths, batch_first=True, enforce_sorted=False), state)
            want_out = nn.utils.rnn.pad_packed_sequence(want_out, True, 0.5, 6)[0]
            got_out, got_h = rnn.rnn_forward(m, rnn.pack_padded_sequence(
                x, lengths, batch_first=True, enforce_sorted=False), state)
            got_out = rnn.pad_packed_sequence(got_out, True, 0.5, 6)[0]
        else:
            want_out, want_h = m(x, state)
            got_out, got_h = rnn.rnn_forward(m, x, state)
        torch.testing.assert_close(got_out, want_out)
        torch.testing.assert_close(got_h, want_h)


def test_stand_in_matches_torch_unbatched_and_train_mode():
    torch.manual_seed(0)
    m = nn.GRU(3, 4, num_layers=2, bidirectional=True).train()   # no dropout: deterministic
    x = torch.randn(5, 3)
    torch.testing.assert_close(rnn.rnn_forward(m, x), m(x))
    m = nn.LSTM(3, 4, num_layers=2, dropout=0.5).train()
    torch.manual_seed(1)
    got, _ = rnn.rnn_forward(m, torch.randn(5, 2, 3))
    m.eval()
    torch.manual_seed(1)
    assert not torch.allclose(got, rnn.rnn_forward(m, torch.randn(5, 2, 3))[0]), \
        "dropout between layers must apply in training"


# -- DP-SGD gradients ------------------------------------------------------------------------------
def test_char_lstm_opacus_tutorial():
    torch.manual_seed(0)
    model = scale_weights(CharLSTM(), 2.0)
    x = torch.randint(0, 12, (5, 7))
    y = torch.arange(5) % 4
    fired = check(model, (x,), y)
    assert fired["lstm.weight_ih_l0"] == ["mm"]
    # one mm per step, stacked over time into one product (passes/stack_time.py)
    assert fired["lstm.weight_hh_l0"] == ["mm"]
    assert fired["lstm.bias_hh_l0"] == ["sum"]   # its 7 per-step sums, stacked likewise
    assert fired["embedding.weight"][0] == "embedding"


@SETTINGS
@given(kind=st.sampled_from(list(KINDS)), layers=st.sampled_from([1, 2]),
       bidirectional=st.booleans(), batch_first=st.booleans(), bias=st.booleans(),
       init=st.sampled_from([None, "learned", "input"]),
       config=st.sampled_from([("mean", None), ("mean", 6), ("sum", None)]))
def test_recurrent_layers(kind, layers, bidirectional, batch_first, bias, init, config):
    torch.manual_seed(0)
    model = scale_weights(Seq(kind, layers, bidirectional, batch_first, bias, init=init))
    x, y = data(steps=3)
    inputs = (x,) if init != "input" else (x, torch.randn(4, layers * (1 + bidirectional), 4))
    fired = check(model, inputs, y, reduction=config[0], expected=config[1])
    assert fired["rnn.weight_hh_l0"] == ["mm"]   # 3 steps stacked over time
    if init == "learned":
        assert fired["h0"] and set(fired["h0"]) == {"sum"}


@pytest.mark.parametrize("strategy,reduction", [("materialize", "mean"), ("ghost", "sum")])
def test_per_step_products_stacked_over_time(strategy, reduction):
    """The hidden weight's per-step products are one product over time (passes/stack_time.py),
    in either per-sample form: one bmm over time, or Gram matrices over time with book-keeping.
    The bias's per-step sums are one sum over time. Planted bugs caught: h_t paired with another
    step's g_t; the pass not firing."""
    torch.manual_seed(0)
    model = scale_weights(Seq("lstm", hidden=6))
    x, y = data(steps=5)
    fired = check(model, (x,), y, reduction=reduction, strategy=strategy, batches=[0, 1, 4],
                  expected=4)
    assert fired["rnn.weight_hh_l0"] == ["mm"]
    assert fired["rnn.bias_hh_l0"] == ["sum"]
    report = dpfx.explain(model, x, max_grad_norm=C, noise_multiplier=0.0, strategy=strategy)
    row = next(r for r in report.rows if r.name == "rnn.weight_hh_l0")
    assert row.strategy == strategy
    assert ("Gram [B, 5, 5]" if strategy == "ghost" else "bmm([B, 24, 5], [B, 5, 6])") in row.form
    # The weight and its bias read the same 5 per-step gate gradients: one stacked copy (B, 5*24).
    stacked = [line for line in report.graphs["backward.private"].splitlines()
               if "f32[B, 120] = aten.cat(" in line]
    assert len(stacked) == 1, stacked


def test_lstm_proj_size():
    torch.manual_seed(0)
    model = scale_weights(Seq("lstm", layers=2, bidirectional=True, proj_size=2))
    x, y = data()
    fired = check(model, (x,), y, reduction="sum")
    assert fired["rnn.weight_hr_l1_reverse"] == ["mm"]   # 4 steps stacked over time


@pytest.mark.parametrize("kind,bidirectional,enforce_sorted",
                         [("lstm", True, False), ("gru", False, True), ("rnn_tanh", True, False)])
def test_packed_sequences(kind, bidirectional, enforce_sorted):
    torch.manual_seed(0)
    model = scale_weights(PackedLSTM(kind, bidirectional, enforce_sorted=enforce_sorted))
    x, y = data(batch=4, steps=5)
    lengths = torch.tensor([5, 4, 2, 1]) if enforce_sorted else torch.tensor([2, 5, 1, 4])
    check(model, (x, lengths), y, expected=4)


def test_pad_packed_sequence_needs_total_length():
    class NoTotal(PackedLSTM):
        def forward(self, x, lengths):
            packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
            return nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)[0]

    dp = dpfx.compile(NoTotal(), max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    with pytest.raises(dpfx.CaptureError) as e:
        dp(torch.randn(2, 3, 3), torch.tensor([3, 2]))
    # the stand-in's ValueError reaches the user in the message, with the line that raised it
    assert "pad_packed_sequence needs total_length=3" in str(e.value)
    assert "in forward" in str(e.value) and "pad_packed_sequence(self.rnn" in str(e.value)


def test_directly_imported_pack_padded_sequence_is_refused_with_the_fix():
    from torch.nn.utils.rnn import pack_padded_sequence

    class Imported(PackedLSTM):
        def forward(self, x, lengths):
            return self.rnn(pack_padded_sequence(x, lengths, batch_first=True))[1][0][-1]

    dp = dpfx.compile(Imported(), max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    with pytest.raises(dpfx.CaptureError, match=r"(?s)pack_padded_sequence.*through the module"):
        dp(torch.randn(2, 3, 3), torch.tensor([3, 2]))


def test_dropout_between_layers_trains_privately():
    """Dropout masks cannot be replayed by the reference; the clipped mean is still bounded by C
    and torch's stock module still sees the same weights afterwards."""
    torch.manual_seed(0)
    model = scale_weights(Seq("lstm", layers=2, dropout=0.5)).train()
    x, y = data(batch=6)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager")
    grads = run_dpfx_multi(dp, model, xent, (x,), y, "mean")
    total = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
    assert 0 < total <= C + 1e-6
    # every weight and bias of both layers gets a gradient through the dropout between them
    for name in model.rnn._flat_weights_names:
        assert grads[f"rnn.{name}"].abs().sum() > 0, name
    # one SGD step on dpfx's gradient; the stock module computes with the stepped weights
    with torch.no_grad():
        for k, p in model.named_parameters():
            p -= grads[k]
    assert all(w is getattr(model.rnn, n)
               for w, n in zip(model.rnn._flat_weights, model.rnn._flat_weights_names))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(dp(x), model(x))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_inductor(kind):
    torch.manual_seed(0)
    model = scale_weights(Seq(kind, layers=2, bidirectional=True, init="learned"))
    x, y = data(steps=3)
    check(model, (x,), y, backend="inductor", batches=[0, 1, 4], expected=4)


def test_inductor_char_lstm():
    torch.manual_seed(0)
    model = scale_weights(CharLSTM(), 2.0)
    x = torch.randint(0, 12, (4, 4))
    y = torch.arange(4) % 4
    check(model, (x,), y, backend="inductor", batches=[0, 1, 4], expected=4)


def test_unbind_over_time_is_not_mixing():
    """A hand-written recurrence over x.unbind(1): unbind's omitted dim is its default 0 of the
    time-major view, not the batch dim (the forward check read it as "every dim")."""

    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.Linear(3, 3)
            self.head = nn.Linear(3, 3)

        def forward(self, x):
            h = torch.zeros_like(x[:, 0])
            for x_t in x.transpose(0, 1).unbind():
                h = torch.tanh(self.cell(x_t) + h)
            return self.head(h)

    torch.manual_seed(0)
    x, y = data(steps=3)
    fired = check(scale_weights(Loop(), 2.0), (x,), y)
    assert fired["cell.weight"] == ["mm"]   # 3 steps stacked over time
