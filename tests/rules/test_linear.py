"""Differential tests of the Linear/matmul and broadcast-reduction rules against torch.func.

Wide sweeps run on backend="eager" (the same rewritten graphs, no C++ compile); test_inductor.py
runs a smaller set end to end through Inductor.
"""
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import dpfx
from support.models import (MLP, MatmulParam, SeqModel, TiedAutoencoder, TiedLM, TiedMLP,
                            TwoLookupLM, mse, xent)
from support.reference import assert_close, clip_fraction, dp_sgd_grads, run_dpfx
from support.sweep import examples

aten = torch.ops.aten
SETTINGS = settings(max_examples=examples(25), deadline=None, derandomize=True)


def check(model, loss_fn, x, y, *, C, reduction, expected=None, strategy="auto"):
    """dpfx with sigma = 0 equals the reference; returns {parameter: rules that fired}."""
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction=reduction,
                      expected_batch_size=expected, backend="eager", strategy=strategy)
    got = run_dpfx(dp, model, loss_fn, x, y, reduction)
    want = dp_sgd_grads(model, loss_fn, x, y, max_grad_norm=C, loss_reduction=reduction,
                        expected_batch_size=expected)
    assert_close(got, want)
    grads = dp._dpfx_backend.param_grads
    if strategy != "auto":
        # A weight with a ghost form takes it when asked; everything else materializes.
        for pg in grads:
            want_strategy = "ghost" if strategy == "ghost" and pg.rules and \
                set(pg.rules) == {"mm"} else "materialize"
            assert pg.strategy == want_strategy, (pg.name, pg.strategy)
    return {pg.name: pg.rules for pg in grads}


@SETTINGS
@given(
    d_in=st.integers(1, 6), hidden=st.integers(2, 7), d_out=st.integers(1, 4),
    extra=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    batch=st.integers(0, 8), bias=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]), expected=st.sampled_from([None, 5]),
    strategy=st.sampled_from(["auto", "materialize", "ghost"]),
)
def test_mlp_matches_reference(d_in, hidden, d_out, extra, batch, bias, reduction, expected,
                               strategy):
    if batch == 0 and reduction == "mean" and expected is None:
        expected = 4
    model = MLP(d_in, hidden, d_out, bias)
    x = torch.randn(batch, *extra, d_in) * 3
    y = torch.randn(batch, *extra, d_out)
    C = 0.05
    if batch:
        assert clip_fraction(model, mse, x, y, C) > 0.5
    rules = check(model, mse, x, y, C=C, reduction=reduction, expected=expected,
                  strategy=strategy)
    assert rules["fc1.weight"] == ["mm"] and rules["fc2.weight"] == ["mm"]
    if bias:
        assert rules["fc1.bias"] == ["sum"] and rules["fc2.bias"] == ["sum"]


def _squared_norm_sources(gm) -> list:
    """The tensors whose per-example sums of squares the backward graph takes: the input of
    every emitted ``sum(mul(x, x), dims 1..)`` (through batch_to_front's views)."""
    sources = []
    for node in gm.graph.nodes:
        if node.target is aten.sum.dim_IntList and node.meta.get("dpfx_emitted") and \
                node.args[0].target is aten.mul.Tensor and \
                node.args[0].args[0] is node.args[0].args[1]:
            x = node.args[0].args[0]
            while x.meta.get("dpfx_emitted") and x.target in (aten.unsqueeze.default,
                                                              aten.permute.default):
                x = x.args[0]
            sources.append(x)
    return sources


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_one_squared_norm_per_tensor(reduction):
    """Ghost Linear layers with biases: the weight's ghost norm |a_i|^2 |g_i|^2 and the bias's
    |g_i|^2 share one reduction of g (Note [One squared norm per tensor] in graph/emit.py), so
    the graph takes four sums of squares (the input, fc1's output gradient, the hidden
    activation, fc2's output gradient), each of a different tensor, not six; and the gradients
    stay DP-SGD's for batches of 5, 0 and 1 with clipping that bites."""
    torch.manual_seed(0)
    model = MLP(d_in=5, hidden=6, d_out=3)
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=4,
                      loss_reduction=reduction, backend="eager", strategy="ghost")
    for batch in (5, 0, 1):
        x, y = torch.randn(batch, 5), torch.randn(batch, 3)
        got = run_dpfx(dp, model, mse, x, y, reduction)
        want = dp_sgd_grads(model, mse, x, y, max_grad_norm=0.05, loss_reduction=reduction,
                            expected_batch_size=4)
        assert_close(got, want)
        if batch == 5:
            assert clip_fraction(model, mse, x, y, 0.05) == 1.0
    grads = dp._dpfx_backend.param_grads
    assert {pg.name: pg.strategy for pg in grads if pg.name.endswith("weight")} == \
        {"fc1.weight": "ghost", "fc2.weight": "ghost"}
    sources = _squared_norm_sources(dp._dpfx_backend.last_backward.gm)
    assert len(sources) == 4 and len(set(sources)) == 4, sources


class ThreeReaders(nn.Module):
    """Three Linear layers reading one (B, T, d) input, as q, k and v projections do."""

    def __init__(self, d=6, out=4):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, out), nn.Linear(d, out), nn.Linear(d, out)

    def forward(self, x):
        return (self.q(x) * self.k(x) + self.v(x)).mean(1)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_shared_input_is_processed_once(reduction):
    """Note [Emitted nodes are shared] (graph/emit.py): the three ghost norms take one Gram
    matrix of the shared input (4 bmm: it and the three output gradients' Grams, not 6) and the
    three clipped sums one clip-scaled copy of it; gradients stay DP-SGD's for batches of 5
    (clipping bites), 0 and 1, and through Inductor."""
    for backend in ("eager", "inductor"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = ThreeReaders()
        dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, backend=backend,
                          loss_reduction=reduction, strategy="ghost", expected_batch_size=4)
        for batch in (5, 0, 1):
            x, y = torch.randn(batch, 3, 6), torch.randint(0, 4, (batch,))
            got = run_dpfx(dp, model, xent, x, y, reduction)
            want = dp_sgd_grads(model, xent, x, y, max_grad_norm=0.05, loss_reduction=reduction,
                                expected_batch_size=4)
            assert_close(got, want)
            if batch == 5:
                assert clip_fraction(model, xent, x, y, 0.05) == 1.0
        assert {pg.strategy for pg in dp._dpfx_backend.param_grads
                if pg.name.endswith("weight")} == {"ghost"}
        gm = dp._dpfx_backend.last_backward.gm
        bmms = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.bmm.default)
        assert len(bmms) == 4, [n.format_node() for n in bmms]
        # the book-keeping products' clip-scaled copies of the shared input (last dim 6; the
        # output gradients' is 4): one for the three weights
        scaled = [n for n in gm.graph.nodes if n.meta.get("dpfx") == "clip_apply"
                  and n.args[0].meta["val"].shape[-1] == 6]
        assert len(scaled) == 1, [n.format_node() for n in scaled]


class TwoBiases(nn.Module):
    """y = fc(x) + b1 + b2: both biases get the same gradient, so the same clipped sum node."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.b1 = nn.Parameter(torch.zeros(3))
        self.b2 = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return self.fc(x) + self.b1 + self.b2


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_parameters_with_one_clipped_sum_get_their_own_noise(backend):
    """The emitter shares the two biases' clipped sum; dpfx::add_noise_ then takes a copy of it
    for the second, so each is noised on its own (a base passed twice is refused by the
    verifier, and one noise for both would leave b1 - b2 noiseless)."""
    model = TwoBiases()
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, backend=backend)
    assert_close(run_dpfx(dp, model, mse, x, y),
                 dp_sgd_grads(model, mse, x, y, max_grad_norm=0.05))
    noisy = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=1.0, backend=backend)
    grads = run_dpfx(noisy, model, mse, x, y)
    assert (grads["b1"] - grads["b2"]).abs().min() > 0


def test_random_and_mutating_ops_are_never_shared():
    """The noise draw is emitted anew every time: two draws must stay two."""
    from dpfx.graph.emit import _pure_key

    assert _pure_key(torch.ops.dpfx.standard_normal.default, (10, "cpu"), {}, "noise") is None
    assert _pure_key(torch.ops.aten.randn.default, ([10],), {}, "noise") is None
    assert _pure_key(torch.ops.aten.add_.Tensor, (1, 2), {}, None) is None
    assert _pure_key(torch.ops.aten.mul.Tensor, (1, 0.0), {}, None) != \
        _pure_key(torch.ops.aten.mul.Tensor, (1, -0.0), {}, None)


@SETTINGS
@given(batch=st.integers(1, 6), T=st.integers(1, 5), reduction=st.sampled_from(["mean", "sum"]),
       C=st.sampled_from([0.01, 0.3, 100.0]),
       strategy=st.sampled_from(["auto", "materialize", "ghost"]))
def test_params_without_batch_dim(batch, T, reduction, C, strategy):
    """A positional parameter (1, T, d) and an elementwise scale: broadcast over the batch in the
    forward, so their gradients are batch sums in the backward; dpfx keeps them per-sample."""
    model = SeqModel(T=T)
    x = torch.randn(batch, T, 8)
    y = torch.randint(0, 4, (batch,))
    rules = check(model, xent, x, y, C=C, reduction=reduction, strategy=strategy)
    assert rules["pos"] == ["sum"] and rules["gamma"] == ["sum"]
    assert rules["proj.weight"] == ["mm"]


@pytest.mark.parametrize("batch", [0, 1, 5])
def test_tied_weights_sum_their_uses(batch):
    """Two uses are summed before the norm. On (B, d) inputs both uses' products are stacked
    into one (passes/stack_time.py), whose ghost norm is the norm of the sum: the tied weight
    takes the ghost form when asked (check() asserts that and the numbers)."""
    model = TiedMLP()
    x = torch.randn(batch, 8)
    y = torch.randint(0, 3, (batch,))
    rules = check(model, xent, x, y, C=0.1, reduction="mean", expected=4, strategy="ghost")
    assert rules["shared.weight"] == ["mm"] and rules["shared.bias"] == ["sum"]


def _seq_xent(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")


@settings(max_examples=examples(30), deadline=None, derandomize=True)
@given(kind=st.sampled_from(["lm", "lm_last", "autoencoder", "two_lookups", "seq_mlp"]),
       batch=st.sampled_from([0, 1, 2, 5]), T=st.integers(1, 4),
       reduction=st.sampled_from(["mean", "sum"]), strategy=st.sampled_from(["auto", "ghost"]))
def test_tied_weights_ghost_matches_reference(kind, batch, T, reduction, strategy):
    """Note [Tied weights without per-sample gradients]: a parameter with several uses gets the
    ghost norm with the uses' cross terms (embedding x head: a gather; mm x mm: Grams; a
    transposed use: its sides swapped; two lookups: index equality) and the sum of their
    book-keeping products, with no (B, *param) tensor; equal to the per-example reference, with
    clipping biting. strategy="ghost" always takes it."""
    torch.manual_seed(T + 10 * batch)
    vocab = 7
    if kind in ("lm", "lm_last"):
        model, name = TiedLM(vocab, 8, last_only=kind == "lm_last"), "tok.weight"
        x = torch.randint(0, vocab, (batch, T))
        y = torch.randint(0, vocab, (batch,) if kind == "lm_last" else (batch, T))
        loss_fn = xent if kind == "lm_last" else _seq_xent
    elif kind == "two_lookups":
        model, name, loss_fn = TwoLookupLM(9, 4), "tok.weight", xent
        x, y = torch.randint(0, 9, (batch, T)), torch.randint(0, 9, (batch,))
    elif kind == "autoencoder":
        model, name, loss_fn = TiedAutoencoder(), "W", mse
        x, y = torch.randn(batch, T, 6) * 2, torch.randn(batch, T, 3)
    else:
        model, name, loss_fn = TiedMLP(), "shared.weight", xent
        x, y = torch.randn(batch, T, 8) * 3, torch.randint(0, 3, (batch, T))
        loss_fn = _seq_xent
    C = 0.02
    if batch:
        assert clip_fraction(model, loss_fn, x, y, C) > 0.5
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction=reduction,
                      expected_batch_size=4 if batch == 0 else None, backend="eager",
                      strategy=strategy)
    got = run_dpfx(dp, model, loss_fn, x, y, reduction)
    want = dp_sgd_grads(model, loss_fn, x, y, max_grad_norm=C, loss_reduction=reduction,
                        expected_batch_size=4 if batch == 0 else None)
    assert_close(got, want, rtol=1e-4, atol=1e-6)
    pg = next(p for p in dp._dpfx_backend.param_grads if p.name == name)
    assert len(pg.rules) >= 2 or kind == "seq_mlp" and T == 1      # stacked (stack_time.py)
    if strategy == "ghost":
        assert pg.strategy == "ghost"
        graph = dp._dpfx_backend.last_backward.gm.graph
        shape = list(model.get_parameter(name).shape)
        built = [n for n in graph.nodes if n.meta.get("dpfx_emitted")
                 and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 3
                 and all(isinstance(s, int) for s in n.meta["val"].shape[1:])
                 and list(n.meta["val"].shape[1:]) in (shape, shape[::-1])]
        assert not built, f"a (B, *param) tensor was built: {built}"


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_raw_parameter_matmul(reduction):
    model = MatmulParam()
    x = torch.randn(6, 4, 5)
    y = torch.randn(6, 3)
    assert check(model, mse, x, y, C=0.1, reduction=reduction)["w"] == ["mm"]


@pytest.mark.parametrize("strategy", ["materialize", "ghost"])
def test_raw_parameter_matmul_strategies(strategy):
    model = MatmulParam()
    x, y = torch.randn(6, 4, 5), torch.randn(6, 3)
    assert check(model, mse, x, y, C=0.1, reduction="mean", strategy=strategy)["w"] == ["mm"]


class TimeFirst(nn.Module):
    """A Linear run on a (T, B, d) transpose: the weight gradient's contraction is over T*B with
    the batch as the *inner* factor (outer=T), the layout of a seq-first layer."""

    def __init__(self, d_in=4, d_out=3):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x):
        return self.fc(x.transpose(0, 1)).transpose(0, 1).sum(1)


@SETTINGS
@given(batch=st.integers(0, 6), T=st.integers(1, 4), reduction=st.sampled_from(["mean", "sum"]),
       strategy=st.sampled_from(["auto", "materialize", "ghost"]))
def test_batch_second_layout(batch, T, reduction, strategy):
    """Both forms follow the time-major flattening: the materialized bmm and the book-keeping
    product, whose clipped sum scales each example's rows where they lie in (T*B, out)."""
    torch.manual_seed(batch * 10 + T)
    model = TimeFirst()
    x, y = torch.randn(batch, T, 4) * 3, torch.randn(batch, 3)
    if batch:
        assert clip_fraction(model, mse, x, y, 0.1) > 0.5
    rules = check(model, mse, x, y, C=0.1, reduction=reduction, strategy=strategy,
                  expected=None if batch or reduction == "sum" else 4)
    assert rules["fc.weight"] == ["mm"]


def test_batch_second_layout_ghost_through_inductor():
    """The time-major book-keeping product compiled by Inductor, at batch sizes equal to T and to
    the feature dims (a layout mix-up between B and T would go unseen at B != T)."""
    model = TimeFirst()
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=3,
                      strategy="ghost")
    for batch in (3, 4, 0, 1, 5):
        x, y = torch.randn(batch, 3, 4) * 3, torch.randn(batch, 3)
        want = dp_sgd_grads(model, mse, x, y, max_grad_norm=0.1, expected_batch_size=3)
        assert_close(run_dpfx(dp, model, mse, x, y), want)
    assert dp.compile_count == 2
    assert {pg.name: pg.strategy for pg in dp._dpfx_backend.param_grads}["fc.weight"] == "ghost"


def test_time_major_gram_operand_copied_once():
    """Note [One batch-major copy per operand]: the Gram matrix of a time-major output gradient
    reads it as X and X^T; Inductor's backward holds one batch-major (B, T, out) copy of it, not
    one per read. Counted in the generated code: buffers of B*T*out entries with T=7, out=5."""
    from torch._inductor.utils import run_and_get_code

    T, d_out = 7, 5
    model = TimeFirst(d_in=6, d_out=d_out)
    x, y = torch.randn(4, T, 6), torch.randn(4, d_out)
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=4,
                      strategy="ghost")
    want = dp_sgd_grads(model, mse, x, y, max_grad_norm=0.1, expected_batch_size=4)
    with torch._inductor.config.patch(force_disable_caches=True):
        got, codes = run_and_get_code(run_dpfx, dp, model, mse, x, y)
    assert_close(got, want)
    backward = [c for c in codes if "bmm" in c]
    assert len(backward) == 1
    copies = 0
    for sizes in re.findall(r"empty_strided_cpu\(\(([^)]*)\)", backward[0]):
        dims = [d.strip() for d in sizes.split(",") if d.strip()]
        ints = sorted(int(d) for d in dims if d.isdigit() and d != "1")
        symbolic = [d for d in dims if not d.isdigit()]
        copies += len(symbolic) == 1 and symbolic[0].isidentifier() and ints == [d_out, T]
    assert copies == 1


def test_frozen_parameters_take_no_part():
    model = MLP()
    model.fc1.weight.requires_grad_(False)
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    rules = check(model, mse, x, y, C=0.1, reduction="mean")
    assert "fc1.weight" not in rules
    assert model.fc1.weight.grad is None


@settings(max_examples=examples(12), deadline=None, derandomize=True)
@given(d_in=st.integers(1, 4), d_out=st.integers(1, 3),
       extra=st.lists(st.integers(1, 3), max_size=1), batch=st.integers(0, 6), bias=st.booleans(),
       reduction=st.sampled_from(["mean", "sum"]),
       strategy=st.sampled_from(["auto", "materialize", "ghost"]))
def test_width_one_hidden_layer_matches_reference(d_in, d_out, extra, batch, bias, reduction,
                                                  strategy):
    """A Linear fed one feature that needs a gradient used to fail capture on Eq(u0, 1) (Note
    [A Linear with one input feature] in capture/swaps.py): fc2 is written as a broadcast
    product, so its weight takes the sum rule; fc1, on data that needs no gradient, is untouched."""
    torch._dynamo.reset()
    model = MLP(d_in, 1, d_out, bias)
    x = torch.randn(batch, *extra, d_in) * 3
    y = torch.randn(batch, *extra, d_out)
    C = 0.01
    if batch:
        assert clip_fraction(model, mse, x, y, C) > 0
    expected = 4 if batch == 0 and reduction == "mean" else None
    rules = check(model, mse, x, y, C=C, reduction=reduction, expected=expected,
                  strategy=strategy)
    # fc1's gradient is (1, B) @ (B, d_in); Inductor's CPU decompositions make it a sum for d_in 1.
    assert rules["fc1.weight"] == (["sum"] if d_in == 1 else ["mm"])
    assert rules["fc2.weight"] == ["sum"]


def test_width_one_hidden_layer_through_inductor():
    """The same through Inductor: one forward and one backward graph for every batch size."""
    model = MLP(3, 1, 2)
    dp = dpfx.compile(model, max_grad_norm=0.01, noise_multiplier=0.0, expected_batch_size=3)
    for batch in (4, 0, 1, 3):
        x, y = torch.randn(batch, 3) * 3, torch.randn(batch, 2)
        if batch:
            assert clip_fraction(model, mse, x, y, 0.01) > 0
        want = dp_sgd_grads(model, mse, x, y, max_grad_norm=0.01, expected_batch_size=3)
        assert_close(run_dpfx(dp, model, mse, x, y), want)
    assert dp.compile_count == 2
    assert {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}["fc2.weight"] == ["sum"]


class OneColumnProduct(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.w = nn.Parameter(torch.randn(1, 2))

    def forward(self, x):
        return self.fc(x) @ self.w


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_raw_product_of_one_column_matches_reference(reduction):
    """torch's mm backward tests a (B, 1) first operand's strides against the batch (Eq(u0, 1)),
    inside torch: dpfx takes torch's size-oblivious answer (Note [Deciding a branch on the batch
    size]), a layout choice, exact at every size including 1."""
    model = OneColumnProduct()
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=0.0, backend="eager",
                      loss_reduction=reduction, expected_batch_size=4)
    for b in (3, 1, 0, 5):
        x, y = torch.randn(b, 3), torch.randint(0, 2, (b,))
        got = run_dpfx(dp, model, F.cross_entropy, x, y, reduction)
        want = dp_sgd_grads(model, F.cross_entropy, x, y, max_grad_norm=0.1,
                            loss_reduction=reduction, expected_batch_size=4)
        assert_close(got, want)
    assert dp.compile_count == 2


class BilinearModel(nn.Module):
    def __init__(self, d1=3, d2=5, out=4, bias=True):
        super().__init__()
        self.d1 = d1
        self.bil = nn.Bilinear(d1, d2, out, bias=bias)

    def forward(self, x):
        return self.bil(x[..., :self.d1], x[..., self.d1:])


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(0, 5), d1=st.integers(2, 4), d2=st.integers(2, 4), seq=st.sampled_from([None, 3]),
       bias=st.booleans(), reduction=st.sampled_from(["mean", "sum"]),
       strategy=st.sampled_from(["materialize", "ghost", "auto"]))
def test_bilinear(batch, d1, d2, seq, bias, reduction, strategy):
    """nn.Bilinear captures through dpfx.capture.swaps's written-out F.bilinear: the weight is an mm
    (either strategy), the bias a sum."""
    torch._dynamo.reset()
    torch.manual_seed(batch)
    model = BilinearModel(d1, d2, 4, bias)
    shape = (batch, d1 + d2) if seq is None else (batch, seq, d1 + d2)
    x, y = torch.randn(*shape) * 3, torch.randn(*shape[:-1], 4)
    if batch > 1:
        assert clip_fraction(model, mse, x, y, 0.05) > 0
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, backend="eager",
                      loss_reduction=reduction, strategy=strategy, expected_batch_size=3)
    got = run_dpfx(dp, model, mse, x, y, reduction)
    want = dp_sgd_grads(model, mse, x, y, max_grad_norm=0.05, loss_reduction=reduction,
                        expected_batch_size=3)
    assert_close(got, want, rtol=1e-4, atol=1e-6)
    rules = {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}
    assert "mm" in rules["bil.weight"]


class ViewMinusOne(nn.Module):
    """``x.view(x.shape[0], -1)`` and ``reshape(x.size(0), -1, 4)``: torch's size inference
    divides by the batch; dpfx.capture.swaps writes the -1 out so that B = 0 still runs."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 8)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.tanh(self.fc1(x.view(x.shape[0], -1)))
        return self.fc2(h.reshape(x.size(0), -1, 4)).sum(1)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_view_with_minus_one_runs_every_batch_size_on_one_graph(backend):
    model = ViewMinusOne()
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=0.0, backend=backend,
                      expected_batch_size=3)
    tol = dict(rtol=1e-4, atol=1e-6)
    for batch in (4, 0, 1, 3):
        x, y = torch.randn(batch, 3, 4) * 3, torch.randn(batch, 4)
        got = run_dpfx(dp, model, mse, x, y)
        assert_close(got, dp_sgd_grads(model, mse, x, y, max_grad_norm=0.1,
                                       expected_batch_size=3), **tol)
    assert dp.compile_count == 2


class TransformedWeight(nn.Module):
    """A weight reshaped by a fixed, data-independent map before its matmul: an autoregressive
    mask (MADE), a kernel padded to a larger size, a flip, a roll."""

    def __init__(self, kind, d_in, d_out):
        super().__init__()
        self.kind = kind
        shape = (d_in, d_out - 3) if kind == "pad" else (d_in, d_out)
        self.w = nn.Parameter(torch.randn(*shape) / d_in ** 0.5)

    def forward(self, x):
        w = {"triu": lambda w: torch.triu(w, 1), "tril": torch.tril,
             "pad": lambda w: torch.nn.functional.pad(w, (1, 2)),
             "flip": lambda w: torch.flip(w, [0, 1]),
             "roll": lambda w: torch.roll(w, 2, 1)}[self.kind](self.w)
        return x @ w


@SETTINGS
@given(kind=st.sampled_from(["triu", "tril", "pad", "flip", "roll"]), d_in=st.integers(2, 5),
       d_out=st.integers(4, 6), extra=st.lists(st.integers(1, 3), max_size=1),
       batch=st.integers(0, 6), reduction=st.sampled_from(["mean", "sum"]),
       C=st.sampled_from([0.01, 100.0]))
def test_weight_transformed_before_use(kind, d_in, d_out, extra, batch, reduction, C):
    """The transform's backward (where / constant_pad_nd / rev / index) sits between the mm and
    the gradient output; its lift rule re-applies it to each example's gradient."""
    model = TransformedWeight(kind, d_in, d_out)
    x, y = torch.randn(batch, *extra, d_in) * 3, torch.randn(batch, *extra, d_out)
    if batch and C < 1:
        assert clip_fraction(model, mse, x, y, C) == 1.0
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction=reduction,
                      expected_batch_size=4, backend="eager")
    got = run_dpfx(dp, model, mse, x, y, reduction)
    assert_close(got, dp_sgd_grads(model, mse, x, y, max_grad_norm=C, loss_reduction=reduction,
                                   expected_batch_size=4))
    (pg,) = dp._dpfx_backend.param_grads
    lifted = {"triu": aten.where.self, "tril": aten.where.self, "pad": aten.constant_pad_nd.default,
              "flip": torch.ops.prims.rev.default, "roll": aten.index.Tensor}[kind]
    assert pg.rules == ["mm"] and pg.per_sample.target is lifted
    assert tuple(pg.per_sample.meta["val"].shape[1:]) == tuple(model.w.shape)
