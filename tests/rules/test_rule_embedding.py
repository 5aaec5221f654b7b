"""Differential tests of the embedding rules (dpfx/rules/embedding.py) against torch.func.

Every test compiles with noise_multiplier=0 and a small C, so the clipped DP-SGD gradient must match
the reference exactly; backend="eager" runs the same rewritten graphs as Inductor without the C++
compile (one small test goes through Inductor).
"""

import pytest
import torch
import torch._inductor.compile_fx as compile_fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import dpfx
import dpfx.passes
from support.models import TiedTable
from support.reference import assert_close, clip_fraction, dp_sgd_grads, run_dpfx
from support.sweep import examples

aten = torch.ops.aten
SETTINGS = settings(max_examples=examples(20), deadline=None, derandomize=True)
REDUCTIONS = ["mean", "sum"]


# -- models ----------------------------------------------------------------------------------------
class EmbeddingClassifier(nn.Module):
    """Embedding over (B, T) token ids, mean over T, Linear head."""

    def __init__(self, vocab=10, dim=4, padding_idx=None, n_classes=3, scale_grad_by_freq=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx,
                                scale_grad_by_freq=scale_grad_by_freq)
        self.head = nn.Linear(dim, n_classes)

    def forward(self, x):
        return self.head(self.emb(x).mean(1))


class TiedLM(nn.Module):
    """The LM head shares the embedding matrix: two uses of one weight."""

    def __init__(self, vocab=9, dim=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)

    def forward(self, x):
        h = torch.tanh(self.mix(self.emb(x).mean(1)))
        return F.linear(h, self.emb.weight)


class TableLookup(nn.Module):
    """A raw parameter indexed by token ids: ``table[x]``, whose backward is ``index_put``."""

    def __init__(self, vocab=8, dim=3, n_classes=3):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, dim))
        self.head = nn.Linear(dim, n_classes)

    def forward(self, x):
        return self.head(self.table[x].mean(1))


class FlatLookup(nn.Module):
    """Batch-first ids flattened to (B*T,) before the lookup: ``torch.index_select`` on a raw
    table (its backward an index_put) or ``nn.Embedding`` (the masked scatter)."""

    def __init__(self, kind, vocab=9, dim=4, n_classes=3):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, n_classes)

    def forward(self, x):
        flat = x.reshape(-1)
        rows = torch.index_select(self.emb.weight, 0, flat) if self.kind == "index_select" \
            else self.emb(flat)
        return self.head(torch.tanh(rows.view(*x.shape, rows.shape[-1])).mean(1))


class BagClassifier(nn.Module):
    """EmbeddingBag over (B, T) ids (one bag per example); optional per-token weights computed in
    the graph from the ids, so the model still takes one input."""

    def __init__(self, mode, vocab=9, dim=4, padding_idx=None, weighted=False, n_classes=3):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, dim, mode=mode, padding_idx=padding_idx)
        self.head = nn.Linear(dim, n_classes)
        self.weighted = weighted

    def forward(self, x):
        weights = (x % 3 + 1).float() / 3 if self.weighted else None
        return self.head(self.bag(x, per_sample_weights=weights))


# -- helpers ---------------------------------------------------------------------------------------
def compile_and_compare(model, x, y, *, C, reduction, backend="eager", strategy="auto",
                        ghost=("emb.weight",)):
    """dpfx with sigma = 0 equals the reference; returns {param name: rules that fired}.

    Dynamo is reset first: every example then compiles from a clean state, instead of one in which
    earlier examples of the same model class made the sequence dim dynamic."""
    torch._dynamo.reset()
    expected = 4 if x.shape[0] == 0 and reduction == "mean" else None
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction=reduction,
                      expected_batch_size=expected, backend=backend, strategy=strategy)
    got = run_dpfx(dp, model, F.cross_entropy, x, y, reduction)
    if strategy == "ghost":
        strategies = {pg.name: pg.strategy for pg in dp._dpfx_backend.param_grads}
        assert all(strategies[name] == "ghost" for name in ghost), strategies
    want = dp_sgd_grads(model, F.cross_entropy, x, y, max_grad_norm=C, loss_reduction=reduction,
                        expected_batch_size=expected)
    assert_close(got, want)
    return {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}, got


def token_ids(batch, seq, vocab, repeat, seed):
    """(batch, seq) ids; ``repeat`` draws from two ids only, so ids repeat within an example."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 2) if repeat else vocab, (batch, seq), generator=gen)


def assert_clipping_bites(model, x, y, C):
    if x.shape[0]:
        assert clip_fraction(model, F.cross_entropy, x, y, C) > 0


# -- nn.Embedding ----------------------------------------------------------------------------------
@SETTINGS
@given(vocab=st.integers(2, 12), dim=st.integers(2, 5), seq=st.integers(1, 6),
       batch=st.integers(0, 4), pad=st.one_of(st.none(), st.integers(0, 11)),
       repeat=st.booleans(), reduction=st.sampled_from(REDUCTIONS), seed=st.integers(0, 99),
       strategy=st.sampled_from(["materialize", "ghost"]))
def test_embedding_matches_reference(vocab, dim, seq, batch, pad, repeat, reduction, seed,
                                     strategy):
    """Both strategies: the (B, V, d) per-sample tables, and the index-equality ghost norm with
    the clip-scaled scatter-add (same gradients)."""
    pad = None if pad is None else pad % vocab
    model = EmbeddingClassifier(vocab, dim, padding_idx=pad)
    x = token_ids(batch, seq, vocab, repeat, seed)
    y = torch.randint(0, 3, (batch,))
    C = 0.05
    assert_clipping_bites(model, x, y, C)
    rules, _ = compile_and_compare(model, x, y, C=C, reduction=reduction, strategy=strategy)
    assert rules["emb.weight"] == ["embedding"]


class TimeFirstEmbedding(nn.Module):
    """The ids reach the table time-first: (T, B) (Opacus's batch_first=False models), or that
    flattened to (T*B,); the examples sit in dim 1 or in the middle of dim 0."""

    def __init__(self, flat, vocab=10, dim=4, padding_idx=None, n_classes=3):
        super().__init__()
        self.flat = flat
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.head = nn.Linear(dim, n_classes)

    def forward(self, x):
        ids = x.t()                                        # (T, B)
        if self.flat:
            h = self.emb(ids.reshape(-1)).view(ids.shape[0], -1, self.emb.embedding_dim)
        else:
            h = self.emb(ids)
        return self.head(torch.tanh(h).mean(0))


@SETTINGS
@given(flat=st.booleans(), seq=st.integers(1, 5), batch=st.integers(0, 4),
       pad=st.one_of(st.none(), st.integers(0, 9)), repeat=st.booleans(),
       reduction=st.sampled_from(REDUCTIONS),
       strategy=st.sampled_from(["auto", "materialize", "ghost"]))
def test_time_first_ids_match_reference(flat, seq, batch, pad, repeat, reduction, strategy):
    """Note [The index's batch layout]: the per-example rows follow the index's batch dim, and
    the ghost form reads each example's tokens from there."""
    model = TimeFirstEmbedding(flat, padding_idx=pad)
    x = token_ids(batch, seq, 10, repeat, seed=seq * 7 + batch)
    y = torch.randint(0, 3, (batch,))
    assert_clipping_bites(model, x, y, 0.05)
    rules, _ = compile_and_compare(model, x, y, C=0.05, reduction=reduction, strategy=strategy)
    assert rules["emb.weight"] == ["embedding"]


@pytest.mark.parametrize("strategy", ["materialize", "ghost"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_padding_row_is_zero_and_repeats_accumulate(reduction, strategy):
    model = EmbeddingClassifier(vocab=6, dim=3, padding_idx=0)
    x = torch.tensor([[0, 0, 4, 4, 4], [1, 0, 2, 2, 5], [0, 0, 0, 0, 0]])
    y = torch.tensor([0, 1, 2])
    assert_clipping_bites(model, x, y, 0.05)
    rules, got = compile_and_compare(model, x, y, C=0.05, reduction=reduction, strategy=strategy)
    assert rules["emb.weight"] == ["embedding"]
    assert torch.all(got["emb.weight"][0] == 0)
    assert torch.all(got["emb.weight"][3] == 0)


@pytest.mark.parametrize("batch", [0, 1, 3])
def test_tied_lm_head_sums_both_uses(batch):
    model = TiedLM()
    x = token_ids(batch, 5, 9, repeat=False, seed=batch)
    y = torch.randint(0, 9, (batch,))
    assert_clipping_bites(model, x, y, 0.05)
    rules, _ = compile_and_compare(model, x, y, C=0.05, reduction="mean")
    assert sorted(rules["emb.weight"]) == ["embedding", "mm"]


def test_varying_sequence_length_recompiles_with_symbolic_length():
    """A second length makes Dynamo mark the sequence dim dynamic: the rule must hold for a
    symbolic T as well as for a static one."""
    model = EmbeddingClassifier(vocab=9, dim=4, padding_idx=0)
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, backend="eager")
    y = torch.tensor([0, 1, 2])
    for seq in (3, 5, 2):
        x = token_ids(3, seq, 9, repeat=True, seed=seq)
        got = run_dpfx(dp, model, F.cross_entropy, x, y)
        assert_close(got, dp_sgd_grads(model, F.cross_entropy, x, y, max_grad_norm=0.05))
        assert dp._dpfx_backend.param_grads[0].rules == ["embedding"]


def test_scale_grad_by_freq_is_refused():
    """Counting ids over the whole batch lets example j's ids into example i's gradient."""
    model = EmbeddingClassifier(vocab=7, dim=3, scale_grad_by_freq=True)
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    with pytest.raises(dpfx.UnsupportedOpError, match="scale_grad_by_freq"):
        dp(torch.randint(0, 7, (3, 4))).sum().backward()


@pytest.mark.parametrize("strategy", ["materialize", "ghost"])
def test_inductor_embedding_matches_reference(strategy):
    model = EmbeddingClassifier(vocab=8, dim=4, padding_idx=1)
    x = token_ids(3, 4, 8, repeat=True, seed=0)
    y = torch.tensor([0, 2, 1])
    rules, _ = compile_and_compare(model, x, y, C=0.05, reduction="mean", backend="inductor",
                                   strategy=strategy)
    assert rules["emb.weight"] == ["embedding"]


# -- other graph forms of the same gradient -------------------------------------------------------
@SETTINGS
@given(vocab=st.integers(1, 8), dim=st.integers(2, 4), seq=st.integers(1, 5),
       batch=st.integers(0, 4), repeat=st.booleans(), reduction=st.sampled_from(REDUCTIONS),
       strategy=st.sampled_from(["materialize", "ghost"]))
def test_table_indexing_matches_reference(vocab, dim, seq, batch, repeat, reduction, strategy):
    """``table[x]``'s index_put, per-sample tables or the index-equality ghost norm."""
    model = TableLookup(vocab, dim)
    x = token_ids(batch, seq, vocab, repeat, seed=vocab * 10 + seq)
    y = torch.randint(0, 3, (batch,))
    assert_clipping_bites(model, x, y, 0.05)
    rules, _ = compile_and_compare(model, x, y, C=0.05, reduction=reduction, strategy=strategy,
                                   ghost=("table",))
    assert rules["table"] == ["index_put"]


@settings(SETTINGS, max_examples=examples(12))
@given(vocab=st.integers(2, 8), dim=st.integers(2, 4), seq=st.integers(1, 5),
       batch=st.integers(0, 4), repeat=st.booleans(), wrap=st.booleans(),
       reduction=st.sampled_from(REDUCTIONS), strategy=st.sampled_from(["ghost", "materialize"]))
def test_tied_table_indexing_matches_reference(vocab, dim, seq, batch, repeat, wrap, reduction,
                                               strategy):
    """A table indexed (index_put) and used as the head (mm): each use's ghost form and their
    cross term, the one-hot side at the index as the op reads it (a negative
    index is row idx + V, equal to the same row given positive)."""
    model = TiedTable(vocab, dim, wrap=wrap)
    x = token_ids(batch, seq, vocab, repeat, seed=vocab * 10 + seq)
    y = torch.randint(0, vocab, (batch,))
    assert_clipping_bites(model, x, y, 0.05)
    rules, _ = compile_and_compare(model, x, y, C=0.05, reduction=reduction, strategy=strategy,
                                   ghost=("table",))
    assert sorted(rules["table"]) == ["index_put", "mm"]


@settings(SETTINGS, max_examples=examples(12))
@given(kind=st.sampled_from(["index_select", "embedding"]), seq=st.integers(1, 5),
       batch=st.integers(0, 4), repeat=st.booleans(), reduction=st.sampled_from(REDUCTIONS),
       strategy=st.sampled_from(["ghost", "materialize"]))
def test_flattened_batch_first_ids_match_reference(kind, seq, batch, repeat, reduction, strategy):
    """(B*T,) ids with the examples outermost: the ghost form reads them as (B, T) tokens."""
    model = FlatLookup(kind)
    x = token_ids(batch, seq, 9, repeat, seed=seq * 5 + batch)
    y = torch.randint(0, 3, (batch,))
    assert_clipping_bites(model, x, y, 0.05)
    rules, _ = compile_and_compare(model, x, y, C=0.05, reduction=reduction, strategy=strategy)
    assert rules["emb.weight"] == ["index_put" if kind == "index_select" else "embedding"]


def _scatter_decomposition(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    """embedding_dense_backward as torch before 2.13 decomposed it (the form a CUDA GPT-2 graph
    showed under torch 2.11): the padding tokens' rows zeroed by a where, then a plain
    index_put(zeros, [ids], rows, accumulate=True)."""
    assert not scale_grad_by_freq
    pad = (indices == padding_idx).unsqueeze(-1)
    rows = torch.where(pad, torch.zeros((), dtype=grad_output.dtype), grad_output)
    table = grad_output.new_zeros((num_weights, *grad_output.shape[indices.dim():]))
    return aten.index_put(table, [indices], rows, True)


@pytest.fixture
def embedding_backward_as_scatter(monkeypatch):
    table = {**compile_fx.select_decomp_table(),
             aten.embedding_dense_backward.default: _scatter_decomposition}
    monkeypatch.setattr(compile_fx, "select_decomp_table", lambda: table)


def test_tied_lm_head_through_index_put_is_ghost(embedding_backward_as_scatter):
    """GPT-2's tie where the embedding's backward is a plain index_put: no (B, V, d) tables,
    the same gradient, at batches 3, 1 and 0 through one compile."""
    model = TiedLM()
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, strategy="ghost",
                      expected_batch_size=3, backend="eager")
    for batch in (3, 1, 0):
        x = token_ids(batch, 5, 9, repeat=True, seed=batch)
        y = torch.randint(0, 9, (batch,))
        assert_clipping_bites(model, x, y, 0.05)
        got = run_dpfx(dp, model, F.cross_entropy, x, y)
        assert_close(got, dp_sgd_grads(model, F.cross_entropy, x, y, max_grad_norm=0.05,
                                       expected_batch_size=3))
    found = {pg.name: (pg.strategy, sorted(pg.rules)) for pg in dp._dpfx_backend.param_grads}
    assert found["emb.weight"] == ("ghost", ["index_put", "mm"])


@pytest.mark.parametrize("name", ["tied_table", "flat_index_select", "time_first_flat"])
def test_inductor_index_put_ghost_matches_reference(name):
    """One Inductor compile serves batches of 3, 4 (= T), 1 and 0: index_put's ghost form, tied
    to the head with its cross term, or on (B*T,) ids from index_select; the masked op's on
    (T*B,) ids, each example's tokens gathered to the front."""
    model = {"tied_table": lambda: TiedTable(vocab=8, dim=4, wrap=True),
             "flat_index_select": lambda: FlatLookup("index_select", vocab=8),
             "time_first_flat": lambda: TimeFirstEmbedding(True, vocab=8)}[name]()
    param = "table" if name == "tied_table" else "emb.weight"
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, strategy="ghost",
                      expected_batch_size=4)
    for batch in (3, 4, 1, 0):
        x = token_ids(batch, 4, 8, repeat=True, seed=batch)
        y = torch.randint(0, 3, (batch,))
        got = run_dpfx(dp, model, F.cross_entropy, x, y)
        assert_close(got, dp_sgd_grads(model, F.cross_entropy, x, y, max_grad_norm=0.05,
                                       expected_batch_size=4))
    assert dp.compile_count == 2
    found = {pg.name: (pg.strategy, sorted(pg.rules)) for pg in dp._dpfx_backend.param_grads}
    assert found[param] == ("ghost", {"tied_table": ["index_put", "mm"],
                                      "flat_index_select": ["index_put"]}.get(name, ["embedding"]))


@pytest.fixture
def without_embedding_decomposition(monkeypatch):
    """Capture with Inductor's table minus embedding_dense_backward, so the op stays whole."""
    table = {k: v for k, v in compile_fx.select_decomp_table().items()
             if k is not aten.embedding_dense_backward.default}
    monkeypatch.setattr(compile_fx, "select_decomp_table", lambda: table)


@pytest.mark.parametrize("time_first", [False, True])
@pytest.mark.parametrize("pad", [None, 2])
def test_embedding_dense_backward_matches_reference(without_embedding_decomposition, pad,
                                                    time_first):
    model = TimeFirstEmbedding(False, vocab=7, dim=3, padding_idx=pad) if time_first \
        else EmbeddingClassifier(vocab=7, dim=3, padding_idx=pad)
    x = torch.tensor([[2, 2, 5, 1], [0, 6, 6, 2], [3, 3, 3, 3]])
    y = torch.tensor([1, 0, 2])
    assert_clipping_bites(model, x, y, 0.05)
    rules, _ = compile_and_compare(model, x, y, C=0.05, reduction="mean")
    assert rules["emb.weight"] == ["embedding_dense_backward"]


def test_embedding_dense_backward_refuses_scale_grad_by_freq(without_embedding_decomposition):
    model = EmbeddingClassifier(vocab=7, dim=3, scale_grad_by_freq=True)
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    with pytest.raises(dpfx.UnsupportedOpError,
                       match="embedding_dense_backward.*scale_grad_by_freq"):
        dp(torch.randint(0, 7, (3, 4))).sum().backward()


# -- nn.EmbeddingBag -------------------------------------------------------------------------------
@settings(max_examples=12, deadline=None)
@given(mode=st.sampled_from(["sum", "mean", "max"]), batch=st.integers(0, 4),
       bag=st.integers(1, 5), padding_idx=st.sampled_from([None, 0, -1]),
       weighted=st.booleans(), reduction=st.sampled_from(["mean", "sum"]),
       strategy=st.sampled_from(["auto", "materialize"]))
def test_embedding_bag(mode, batch, bag, padding_idx, weighted, reduction, strategy):
    """nn.EmbeddingBag over (B, L) ids (dpfx.capture.swaps writes the bag out): sum (optionally
    weighted), mean and max, padding entries left out of the bag, repeated ids in a bag."""
    weighted = weighted and mode == "sum"
    torch.manual_seed(batch * 7 + bag)
    model = BagClassifier(mode, padding_idx=padding_idx, weighted=weighted)
    x = torch.randint(0, 4, (batch, bag))          # a small range: repeats and padding
    y = torch.randint(0, 3, (batch,))
    if batch > 1:
        assert clip_fraction(model, F.cross_entropy, x, y, 0.05) > 0
    rules, _ = compile_and_compare(model, x, y, C=0.05, reduction=reduction, strategy=strategy)
    if batch:
        assert "embedding" in rules["bag.weight"] or "index_put" in rules["bag.weight"], rules


def test_embedding_bag_matches_torch_forward():
    """The written-out bag equals torch's kernel, empty (all-padding) bags included."""
    from dpfx.capture.swaps import _embedding_bag_written_out

    w = torch.randn(6, 3)
    x = torch.tensor([[1, 2, 2, 0], [0, 0, 0, 0], [5, 4, 3, 1]])
    psw = torch.rand(3, 4)
    for mode in ("sum", "mean", "max"):
        for pad in (None, 0):
            want = F.embedding_bag(x, w, mode=mode, padding_idx=pad)
            torch.testing.assert_close(_embedding_bag_written_out(x, w, mode=mode,
                                                                  padding_idx=pad), want)
    torch.testing.assert_close(
        _embedding_bag_written_out(x, w, mode="sum", per_sample_weights=psw, padding_idx=0),
        F.embedding_bag(x, w, mode="sum", per_sample_weights=psw, padding_idx=0))


class FlatBags(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(9, 4, mode="sum")

    def forward(self, x):                  # 1-D ids with offsets: one bag per example
        flat = x.flatten()
        offsets = torch.arange(0, flat.shape[0], x.shape[1])
        return self.bag(flat, offsets)


def test_embedding_bag_with_offsets_is_refused():
    model = FlatBags()
    before = [p.detach().clone() for p in model.parameters()]
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    with pytest.raises(dpfx.DPFXError):
        dp(torch.randint(0, 9, (3, 4)))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
