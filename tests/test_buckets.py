"""``batch_buckets``: a batch padded up to a bucket trains exactly as the unpadded batch does.

Every step is compared twice, with sigma = 0 and a clipping bound that bites: against the same
model compiled without buckets (the unpadded dpfx step), and against support/reference.py's
torch.func vmap(grad) per-example gradients clipped and summed by hand. Batch sizes inside the
buckets and on their edges (B = 1, B = a bucket, B = a bucket + 1, B = 0). Note [Padded rows
contribute zero] in dpfx/passes/clip_noise.py, Note [Padded rows are proven out] in
dpfx/passes/verify/clip.py.
"""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
import dpfx.compiled_call
import dpfx.passes
from dpfx.config import DPConfig
from dpfx.errors import OptionError
from dpfx.ops.norms import NonFiniteExampleWarning
from support.models import MLP, Block, TinyGPT
from support.reference import assert_close, dp_sgd_grads, per_example_grads, per_example_norms

BUCKETS = (4, 8)
C = 0.05        # the MLP's per-example norms at init are ~0.1-0.4: most examples are clipped
SIZES = (1, 3, 4, 5, 8)     # inside a bucket, on its edge, one past it; B = 0 where D allows


def _mse(out, y):
    return F.mse_loss(out, y, reduction="sum")


def _loss(reduction):
    return (lambda out, y: F.cross_entropy(out, y)) if reduction == "mean" else \
        (lambda out, y: F.cross_entropy(out, y, reduction="sum"))


def _batch(b, seed=0):
    g = torch.Generator().manual_seed(seed + b)
    return torch.randn(b, 8, generator=g), torch.randint(0, 4, (b,), generator=g)


def _step(dp, model, x, y, loss_fn):
    """One plain-loop step: (output, {name: p.grad})."""
    model.zero_grad(set_to_none=True)
    out = dp(x)
    loss = loss_fn(out, y) if x.shape[0] else out.sum() * 0.0
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def _reference(model, loss_fn, x, y, reduction, expected=None):
    """vmap(grad) per-example gradients of each example's own loss, clipped, summed, divided."""
    if x.shape[0] == 0:
        return {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    return dp_sgd_grads(model, loss_fn, x, y, max_grad_norm=C, loss_reduction=reduction,
                        expected_batch_size=expected)


def _compile(model, backend, reduction, expected=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpfx.FixedSeedWarning)
        return dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, seed=0,
                            backend=backend, loss_reduction=reduction,
                            expected_batch_size=expected, **kw)


def _check_sizes(backend, reduction, expected, sizes):
    torch.manual_seed(0)
    model = MLP()
    padded = _compile(model, backend, reduction, expected, batch_buckets=BUCKETS)
    unpadded = _compile(model, "eager", reduction, expected)
    loss_fn = _loss(reduction)
    compiles = None
    for b in sizes:
        x, y = _batch(b)
        out, got = _step(padded, model, x, y, loss_fn)
        assert out.shape == (b, 4)
        want_out, want = _step(unpadded, model, x, y, loss_fn)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
        assert_close(got, want)
        assert_close(got, _reference(model, loss_fn, x, y, reduction, expected))
        if b:
            norms = per_example_norms(per_example_grads(model, loss_fn, x, y))
            assert (norms > C).any(), "the bound must bite for the test to mean anything"
            if compiles is None:
                compiles = padded.compile_count
            assert padded.compile_count == compiles, f"batch size {b} compiled again"
    return padded


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_padded_steps_equal_the_unpadded_ones_through_inductor(reduction):
    _check_sizes("inductor", reduction, None, SIZES)


@pytest.mark.parametrize("reduction,expected", [("mean", None), ("sum", None), ("mean", 6)])
def test_padded_steps_equal_the_unpadded_ones_eager(reduction, expected):
    sizes = SIZES if reduction == "mean" and expected is None else (0, *SIZES, 2, 7)
    _check_sizes("eager", reduction, expected, sizes)


def test_non_finite_padded_rows_add_exactly_zero(monkeypatch):
    """Whatever the padded rows hold, a NaN or an inf in their forward adds nothing and is not
    reported as a non-finite example: the mask, not the values, makes them zero."""
    def poisoned(t, rows):     # NaN, then inf rows
        extra = torch.full((rows - t.shape[0], *t.shape[1:]), float("nan"), dtype=t.dtype)
        extra[1:] = float("inf")
        return torch.cat([t, extra])

    torch.manual_seed(0)
    model = MLP()
    padded = _compile(model, "eager", "sum", None, batch_buckets=BUCKETS, track_norms=True)
    unpadded = _compile(model, "eager", "sum", None)
    monkeypatch.setattr(dpfx.compiled_call, "_padded", poisoned)
    loss_fn = _loss("sum")
    for b in (1, 3, 5):
        x, y = _batch(b)
        with warnings.catch_warnings():
            warnings.simplefilter("error", NonFiniteExampleWarning)
            out, got = _step(padded, model, x, y, loss_fn)
        assert torch.isfinite(out).all() and out.shape[0] == b
        assert all(torch.isfinite(g).all() for g in got.values())
        assert_close(got, _step(unpadded, model, x, y, loss_fn)[1])
        assert_close(got, _reference(model, loss_fn, x, y, "sum"))
        assert padded.norm_stats.last[""].shape == (b,)
    stats = padded.norm_stats
    assert stats.non_finite == 0
    assert stats.examples == 1 + 3 + 5


def test_a_real_non_finite_example_is_still_counted(monkeypatch):
    """A real example with a NaN feature is dropped and counted once; the padded rows beside it
    (copies of row 0, here the NaN one) are not counted."""
    torch.manual_seed(0)
    model = MLP()
    padded = _compile(model, "eager", "sum", None, batch_buckets=BUCKETS, track_norms=True)
    x, y = _batch(3)
    x[0, 2] = float("nan")
    with pytest.warns(NonFiniteExampleWarning, match="1 example"):
        _, got = _step(padded, model, x, y, _loss("sum"))
    assert padded.norm_stats.non_finite == 1
    assert_close(got, _reference(model, _loss("sum"), x[1:], y[1:], "sum"))


def test_the_gate_and_norm_stats_count_real_examples():
    """noise='optimizer': the clipped sums and the examples counted in them, per step."""
    torch.manual_seed(0)
    model = MLP()
    padded = _compile(model, "eager", "mean", None, batch_buckets=BUCKETS, noise="optimizer",
                      track_norms=True)
    unpadded = _compile(model, "eager", "mean", None, noise="optimizer")
    seen = 0
    for b in (3, 5, 8):
        x, y = _batch(b)
        for dp in (padded, unpadded):
            dp.reset_clipped_sums()
            F.cross_entropy(dp(x), y).backward()
        assert padded.examples == unpadded.examples == b
        assert_close(padded.clipped_sums, unpadded.clipped_sums)
        seen += b
        assert padded.norm_stats.examples == seen
        clipped = float((padded.norm_stats.last[""] > C).float().mean())
        assert padded.norm_stats.clipped_fraction == pytest.approx(clipped)


def test_adaptive_clipping_counts_real_examples():
    """The bound C_t follows the unclipped fraction of the real examples: a padded row counted
    as clipped would move it differently from the unpadded run."""
    torch.manual_seed(0)
    model = MLP()
    kw = dict(clipping="adaptive", target_unclipped_quantile=0.5, clip_lr=0.5)
    padded = _compile(model, "eager", "mean", None, batch_buckets=BUCKETS, **kw)
    unpadded = _compile(model, "eager", "mean", None, **kw)
    for b in (3, 5, 1):
        x, y = _batch(b)
        g1 = _step(padded, model, x, y, _loss("mean"))[1]
        g2 = _step(unpadded, model, x, y, _loss("mean"))[1]
        assert_close(g1, g2)
        assert padded.adaptive_clip.bound == pytest.approx(unpadded.adaptive_clip.bound)
    assert padded.adaptive_clip.bound != pytest.approx(C)


def test_a_batch_past_the_last_bucket_is_refused_with_the_fix():
    model = MLP()
    dp = _compile(model, "eager", "sum", None, batch_buckets=BUCKETS)
    with pytest.raises(ValueError, match=r"batch size 9 exceeds .*batch_buckets=\(4, 8\).*Add "
                                         r"a bucket of at least 9"):
        dp(torch.randn(9, 8))
    assert all(p.grad is None for p in model.parameters())


def test_bucket_options_are_validated():
    for bad in ((), (0, 4), (8, 4), (4, 4), (4.0,), (True,), "64", 64):
        with pytest.raises(OptionError, match="batch_buckets"):
            DPConfig(max_grad_norm=1.0, noise_multiplier=1.0, batch_buckets=bad)
    config = DPConfig(max_grad_norm=1.0, noise_multiplier=1.0, batch_buckets=[2, 16])
    assert config.batch_buckets == (2, 16)
    assert [config.bucket_for(b) for b in (0, 1, 2, 3, 16)] == [0, 2, 2, 16, 16]
    assert DPConfig(max_grad_norm=1.0, noise_multiplier=1.0).bucket_for(5) == 5
    with pytest.raises(OptionError, match="batch_buckets is not supported with loss="):
        dpfx.compile(MLP(), max_grad_norm=1.0, noise_multiplier=1.0, loss=F.cross_entropy,
                     batch_buckets=(4,))


def _without_real_rows(monkeypatch, verify=True):
    """Plant the bug: the clip pass builds its masks and the mean's B without the real rows
    (the graph still reads real_examples, the backend still pads)."""
    original = dpfx.passes.insert_clip_and_noise

    def planted(emit, grads, config, device, norm_sink=None, bound=None, real=None):
        return original(emit, grads, config, device, norm_sink, bound, None)

    monkeypatch.setattr(dpfx.passes, "insert_clip_and_noise", planted)
    if not verify:
        monkeypatch.setattr(dpfx.passes, "verify_backward", lambda *a, **k: None)


def test_a_mask_without_the_real_rows_is_refused(monkeypatch):
    """Note [Padded rows are proven out]: the proof requires the padded mask, not trusts it."""
    _without_real_rows(monkeypatch)
    dp = _compile(MLP(), "eager", "sum", None, batch_buckets=BUCKETS)
    with pytest.raises(dpfx.PrivacyError, match=r"isfinite\(norm\) & \(arange\(B\) < "
                                                r"real_examples\)"):
        dp(torch.randn(3, 8))


def test_the_differential_check_catches_a_skipped_mask(monkeypatch):
    """With the proof switched off too, a graph built without the real rows takes a mean's B to
    be the padded size (the norms scaled by P, the sum divided by P): the comparison this file
    makes fails. (Padded rows' per-example gradients are zero
    in a plain loop, whose loss never reads them; the mask makes that hold whatever they
    are.)"""
    _without_real_rows(monkeypatch, verify=False)
    torch.manual_seed(0)
    model = MLP()
    dp = _compile(model, "eager", "mean", None, batch_buckets=BUCKETS)
    x, y = _batch(3)
    _, got = _step(dp, model, x, y, _loss("mean"))
    with pytest.raises(AssertionError):
        assert_close(got, _reference(model, _loss("mean"), x, y, "mean"))


def test_token_ids_pad_with_row_0():
    """Integer inputs (token ids) are padded with row 0's ids, which the embedding can read."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6), nn.Flatten(), nn.Linear(18, 4))
    padded = _compile(model, "eager", "sum", None, batch_buckets=BUCKETS)
    unpadded = _compile(model, "eager", "sum", None)
    ids = torch.randint(0, 10, (5, 3))
    y = torch.randint(0, 4, (5,))
    got = _step(padded, model, ids, y, _loss("sum"))[1]
    assert_close(got, _step(unpadded, model, ids, y, _loss("sum"))[1])


@pytest.mark.filterwarnings("ignore::dpfx.LossScaleWarning")  # the loss's scale changed: expected
@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
def test_sequence_inputs_through_both_strategies(strategy):
    """(B, T, d) inputs: the ghost norm's book-keeping product selects both of its operands by
    the padded mask (Note [Non-finite examples contribute zero]); a float target's mean loss."""
    torch.manual_seed(0)
    model = MLP()
    padded = _compile(model, "eager", "mean", None, batch_buckets=BUCKETS, strategy=strategy)
    unpadded = _compile(model, "eager", "mean", None, strategy=strategy)
    assert {pg.strategy for pg in _grads_after(padded, torch.randn(2, 5, 8))
            if pg.name.endswith("weight")} == {strategy}
    for b in (1, 3, 5):
        x, y = torch.randn(b, 5, 8), torch.randn(b, 5, 4)
        got = _step(padded, model, x, y, F.mse_loss)[1]
        assert_close(got, _step(unpadded, model, x, y, F.mse_loss)[1])
        assert_close(got, _reference(model, F.mse_loss, x, y, "mean"))


def _grads_after(dp, x):
    dp(x).sum().backward()
    dp._orig_mod.zero_grad(set_to_none=True)
    return dp._dpfx_backend.param_grads


def test_noise_of_a_padded_batch():
    """sigma > 0: a "sum" loss's release is the unpadded one, draw for draw (one seed, the same
    dpfx::add_noise_ on CPU); a "mean" loss's noise has std sigma * C / B with B the real
    examples, not the bucket (the sliced draw, divided by real_examples)."""
    torch.manual_seed(0)
    model = MLP(d_in=64, hidden=64)
    kw = dict(max_grad_norm=C, noise_multiplier=1.0, seed=3, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpfx.FixedSeedWarning)
        padded = dpfx.compile(model, loss_reduction="sum", batch_buckets=BUCKETS, **kw)
        unpadded = dpfx.compile(model, loss_reduction="sum", **kw)
        mean = dpfx.compile(model, batch_buckets=BUCKETS, **kw)
    x, y = torch.randn(3, 64), torch.randint(0, 4, (3,))
    assert_close(_step(padded, model, x, y, _loss("sum"))[1],
                 _step(unpadded, model, x, y, _loss("sum"))[1])
    got = _step(mean, model, x, y, _loss("mean"))[1]
    clean = _reference(model, _loss("mean"), x, y, "mean")
    noise = torch.cat([(got[k] - clean[k]).flatten() for k in got])
    assert noise.numel() > 4000
    assert noise.std().item() == pytest.approx(C / 3, rel=0.05)


def test_blocks_with_padded_batches():
    """A block called as one op (blocks=) clips with the root graph's padded masks: a tied
    causal GPT's step with its block compiled once equals the unpadded step without blocks."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=11, d=8, T=5)
    plain = copy.deepcopy(model)    # the reference's: blocks= installs its op in ``model``
    padded = _compile(model, "eager", "sum", None, batch_buckets=BUCKETS, blocks=[Block])
    unpadded = _compile(model, "eager", "sum", None)
    for b in (3, 5):
        ids, y = torch.randint(0, 11, (b, 5)), torch.randint(0, 11, (b,))
        got = _step(padded, model, ids, y, _loss("sum"))[1]
        assert_close(got, _step(unpadded, model, ids, y, _loss("sum"))[1])
        assert_close(got, _reference(plain, _loss("sum"), ids, y, "sum"))
    assert padded._blocks, "the block was not compiled as one op"
