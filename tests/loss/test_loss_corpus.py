"""Loss idioms as real training code writes them, through the plain loop.

Each per-example loss below is written the way a library or a training script writes it (the
source it follows is named), trained through dpfx's loop (``loss.backward()`` on the tracked
outputs) and compared with a batch-of-one reference: each example's gradient of its own term,
clipped with a bound that bites on about half the examples, summed, divided. The per-example
term is the loss with every scalar applied after the batch reduction removed (Note [The
per-example term] in dpfx/loss/check.py): the batch size written any way (a mean, ``size(0)``,
``len(y)``, ``shape[0]``, a Python int, ``reduction="batchmean"``), a token count, a constant
factor on the whole loss. Means over an example's own positions stay means.

Each coupled loss (a batch statistic of the outputs or of the labels that reaches a term, ranks,
top-k, a softmax over the batch) is refused with the op and the user's line.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from support.loss_idioms import (CANARY_IDIOMS, CORPUS, COUPLED, IGNORE, K, BlockNet, Net, T, V,
                                 _apply,
                                 _assert_close, _batch, _bites, _clipped_sum, _dpfx_step,
                                 _neighbours, _per_example, _reference, _slice_to)
from support.sweep import reductions, with_reductions

@pytest.mark.parametrize("name", sorted(CORPUS))
def test_per_example_losses_match_reference(name):
    """Batch sizes 3 and 1 through one compiled model (mean), 4 (= T, sum), a bound that bites;
    an empty batch releases zeros. By default one of the two reductions (tests/support/sweep.py)."""
    which, loss, term = CORPUS[name]
    wanted = reductions(sorted(CORPUS), name)       # tests/support/sweep.py
    for batches, reduction in (((3, 1), "mean"), ((4,), "sum")):
        if reduction not in wanted:
            continue
        torch.manual_seed(0)
        model = Net()
        data = [_batch(b, seed=b) for b in batches]
        grads = [_per_example(model, which, term, ids, d) for ids, d in data]
        bound = _bites([g for per_batch in grads for g in per_batch])
        dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0,
                          loss_reduction=reduction, backend="eager")
        for batch, (ids, d), g in zip(batches, data, grads):
            got = _dpfx_step(dp, model, which, loss, ids, d)
            _assert_close(f"{name} B={batch} {reduction}", model, got,
                          _reference(g, bound, batch if reduction == "mean" else 1))
    if "sum" not in wanted:
        return          # an empty batch needs D under "mean": the sum run takes it
    ids, d = _batch(0)
    try:
        _apply(which, loss, model(ids), d)
    except (ZeroDivisionError, RuntimeError):
        return          # the idiom itself fails on an empty batch (1.0 / len(y), view(0, -1))
    got = _dpfx_step(dp, model, which, loss, ids, d)
    assert all(float(g.abs().max()) == 0 for g in got)


def test_per_example_losses_through_inductor():
    """Every idiom through Inductor on one model: with a bound no example reaches (the scale of
    each example's gradient) and with one every example exceeds (its direction)."""
    torch.manual_seed(0)
    model = Net()
    for bound in (1e6, 1e-4):
        dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0)
        for name in sorted(CORPUS):
            which, loss, term = CORPUS[name]
            for batch in (3, 1):
                ids, d = _batch(batch, seed=batch)
                grads = _per_example(model, which, term, ids, d)
                got = _dpfx_step(dp, model, which, loss, ids, d)
                _assert_close(f"{name} B={batch} C={bound}", model, got,
                              _reference(grads, bound, batch))


@pytest.mark.filterwarnings("ignore::dpfx.BatchSizeWarning")     # chosen sizes, not sampled
def test_per_example_losses_through_blocks():
    """Every idiom through per-block graphs (the two residual layers are one compiled block,
    the embedding and heads the model graph around them), through Inductor with the self-check:
    each block's norm rows and clipped sums under the loss's per-example scale, at batch sizes
    3, 1, 4 (= T) and 0, with a bound no example reaches and one every example exceeds; then
    the auditor's canary: one added example moves the release by at most C. The reference runs
    on a copy of the model that dpfx never touched."""
    torch.manual_seed(0)
    ref = BlockNet()
    grads = {(name, batch): _per_example(ref, CORPUS[name][0], CORPUS[name][2],
                                         *_batch(batch, seed=batch))
             for name in CORPUS for batch in (3, 1, 4)}
    for bound in (1e6, 1e-4):
        model = copy.deepcopy(ref)
        dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0, blocks="auto",
                          expected_batch_size=3)
        for name in sorted(CORPUS):
            which, loss, _ = CORPUS[name]
            for batch in (3, 1, 4):
                ids, d = _batch(batch, seed=batch)
                got = _dpfx_step(dp, model, which, loss, ids, d)
                _assert_close(f"{name} B={batch} C={bound}", model, got,
                              _reference(grads[name, batch], bound, 3))
            ids, d = _batch(0)
            try:
                _apply(which, loss, ref(ids), d)
            except (ZeroDivisionError, RuntimeError):
                continue        # the idiom itself fails on an empty batch
            got = _dpfx_step(dp, model, which, loss, ids, d)
            assert all(float(g.abs().max()) == 0 for g in got), name
        assert len(dp._blocks) == 2 and len({type(b.forward) for b in model.layers}) == 1
    ids, d = _neighbours()
    names = ["sum_over_len", "token_python_ints", "bert_pretraining"]
    norms = []
    for name in names:
        which, _, term = CORPUS[name]
        g = _per_example(ref, which, term, ids, d)[0]
        norms.append(float(torch.sqrt(sum(x.pow(2).sum() for x in g))))
    bound = max(norms) * 1.5
    model = copy.deepcopy(ref)
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0, loss_reduction="sum",
                      blocks="auto")
    for name in names:
        which, loss, _ = CORPUS[name]
        base = _dpfx_step(dp, model, which, loss, ids[:8], _slice_to(d, 8))
        added = _dpfx_step(dp, model, which, loss, ids, d)
        moved = float(torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(added, base))))
        assert moved <= bound * (1 + 1e-4), (name, moved, bound)


@pytest.mark.parametrize("name", ["hf_causal_lm", "masked_token_mean", "bert_pretraining"])
def test_a_batch_with_every_token_ignored(name):
    """A token mean over a batch whose tokens are all ignored divides by a count of 0 (the loss
    is NaN): its term is empty and left out, the others keep their scale (BERT's next-sentence
    term, clipped as on any other step), and nothing raises. Through Inductor, bound biting."""
    which, loss, term = CORPUS[name]
    torch.manual_seed(0)
    model = Net()
    ids, d = _batch(3)
    d["tokens"][:] = IGNORE
    grads = _per_example(model, which, term, ids, d)
    bound = _bites(grads)
    dp = dpfx.compile(model, max_grad_norm=max(bound, 1e-3), noise_multiplier=0.0)
    got = _dpfx_step(dp, model, which, loss, ids, d)
    _assert_close(name, model, got, _reference(grads, max(bound, 1e-3), 3))


@pytest.mark.parametrize("name", sorted(COUPLED))
def test_coupled_losses_are_refused(name):
    """Refused at backward with the op and the line, before anything is written."""
    which, loss, op = COUPLED[name]
    torch.manual_seed(0)
    model = Net()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    ids, d = _batch(5)
    with pytest.raises(dpfx.PrivacyError) as info:
        _apply(which, loss, dp(ids), d).backward()
    message = str(info.value)
    assert "loss_idioms.py:" in message, message
    if op is not None:
        assert f"op {op}" in message, message
    assert all(p.grad is None for p in model.parameters())


def _selected_rows_mean(tok, d):
    """Token losses of the rows a boolean mask selects, averaged (``loss[mask].mean()``)."""
    per = F.cross_entropy(tok.reshape(-1, V), d["tokens"].reshape(-1).clamp(min=0),
                          reduction="none")
    return per[(d["tokens"] != IGNORE).reshape(-1)].mean()


def _masked_select_mean(tok, d):
    per = F.cross_entropy(tok.transpose(1, 2), d["tokens"].clamp(min=0), reduction="none")
    return per.masked_select(d["tokens"] != IGNORE).mean()


@pytest.mark.parametrize("loss", [_selected_rows_mean, _masked_select_mean])
def test_rows_selected_by_a_mask_are_refused_with_the_masked_form(loss):
    """Rows selected by a boolean mask have a data-dependent count, which the replay cannot
    prove per example: refused before anything is written, naming the masked form that trains
    (``masked_token_mean`` above: the same loss, proven and exact)."""
    torch.manual_seed(0)
    model = Net()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    ids, d = _batch(5)
    with pytest.raises(dpfx.PrivacyError) as info:
        loss(dp(ids)[0], d).backward()
    message = str(info.value)
    assert "test_loss_corpus.py:" in message and "(loss * mask).sum() / mask.sum()" in message, \
        message
    assert all(p.grad is None for p in model.parameters())


# -- the auditor's test ----------------------------------------------------------------------



@pytest.mark.parametrize("name,reduction", with_reductions(CANARY_IDIOMS))
def test_one_added_example_moves_the_release_by_at_most_C_over_D(name, reduction):
    """sigma 0: the release with and without the canary differs by at most C/D, whichever way
    the loss writes the batch size. The bound is set so that the eight equal examples are not
    clipped: a batch-size factor kept inside their terms would move all eight. By default each
    idiom under one reduction (tests/support/sweep.py)."""
    which, loss, term = CORPUS[name]
    torch.manual_seed(0)
    model = Net()
    ids, d = _neighbours()
    grads = _per_example(model, which, term, ids, d)
    norm = float(torch.sqrt(sum(x.pow(2).sum() for x in grads[0])))
    bound, expected = norm * 1.5, 6
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0, loss_reduction=reduction,
                      expected_batch_size=expected if reduction == "mean" else None,
                      backend="eager")
    base = _dpfx_step(dp, model, which, loss, ids[:8], _slice_to(d, 8))
    added = _dpfx_step(dp, model, which, loss, ids, d)
    moved = float(torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(added, base))))
    limit = bound / (expected if reduction == "mean" else 1)
    assert moved <= limit * (1 + 1e-4), (moved, limit)



def test_the_auditor_catches_a_batch_size_kept_in_each_term():
    """The positive control of the test above: with the 1/B of ``sum / len(y)`` kept in each
    example's term (what dpfx did before it removed scalars applied after the batch reduction),
    the same neighbours move the release by more than C; dpfx's release moves by at most C."""
    which, loss, term = CORPUS["sum_over_len"]
    torch.manual_seed(0)
    model = Net()
    ids, d = _neighbours()
    grads = _per_example(model, which, term, ids, d)
    norm = float(torch.sqrt(sum(x.pow(2).sum() for x in grads[0])))
    bound = norm / 8 * 1.01           # g/8 escapes clipping, g is clipped
    kept = [_clipped_sum(grads[:n], bound, 1.0 / n) for n in (8, 9)]
    assert float(torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(*kept)))) > bound
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0, loss_reduction="sum",
                      backend="eager")
    base = _dpfx_step(dp, model, which, loss, ids[:8], _slice_to(d, 8))
    added = _dpfx_step(dp, model, which, loss, ids, d)
    assert float(torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(added, base)))) <= \
        bound * (1 + 1e-4)
    want = _clipped_sum(grads, bound, 1.0)
    for g, w in zip(added, want):
        torch.testing.assert_close(g, w, rtol=2e-4, atol=1e-6)



# -- the batch's own tensors (dpfx's loader) -------------------------------------------------
LABEL_STATISTICS = {   # computed from the batch's labels before they meet an output
    "class_balanced_weights": lambda cls, y, x: F.cross_entropy(
        cls, y, weight=1.0 / torch.bincount(y, minlength=K).clamp(min=1).float()),
    "class_balanced_gather": lambda cls, y, x: (F.cross_entropy(cls, y, reduction="none") * (
        1.0 / torch.bincount(y, minlength=K).clamp(min=1).float())[y]).mean(),
    "centered_targets": lambda cls, y, x: F.mse_loss(cls[:, 0], y.float() - y.float().mean()),
    "targets_scaled_by_batch_max": lambda cls, y, x: F.mse_loss(cls[:, 0], y.float() / y.max()),
    "labels_shuffled": lambda cls, y, x: F.cross_entropy(cls, y[torch.randperm(len(y))]),
}


def _loader_batch(n=6):
    from dpfx.loop.data import PoissonLoader

    ids, d = _batch(n, seed=5)
    loader = PoissonLoader(torch.utils.data.TensorDataset(ids, d["labels"]),
                           batch_sampler=[list(range(n))])
    return next(iter(loader))


@pytest.mark.parametrize("name", sorted(LABEL_STATISTICS))
def test_batch_statistics_of_the_labels_are_refused(name):
    torch.manual_seed(0)
    model = Net()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    ids, y = _loader_batch()
    with pytest.raises(dpfx.PrivacyError, match="couples examples") as info:
        LABEL_STATISTICS[name](dp(ids)[1], y, ids).backward()
    assert "test_loss_corpus.py:" in str(info.value)
    assert all(p.grad is None for p in model.parameters())


def test_inputs_computed_from_the_batch_are_refused():
    """An input standardized by the batch's statistics, or mixed with another example, couples
    examples before the graph: refused at the forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(T, 4))
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    ids, y = _loader_batch()
    x = ids.float()
    for bad in (lambda: (x - x.mean(0)) / x.std(0), lambda: 0.5 * x + 0.5 * x.flip(0)):
        with pytest.raises(dpfx.PrivacyError, match="a model input couples examples"):
            dp(bad())
    out = dp((x - 5.0) / 3.0)            # per-example arithmetic with constants: fine
    F.cross_entropy(out, y).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_per_example_label_processing_through_the_loader_matches_reference():
    """Labels moved, cast, masked and one-hot encoded per example, through dpfx's loader and
    Inductor: the same gradient as the batch-of-one reference."""
    torch.manual_seed(0)
    model = Net()
    ids, y = _loader_batch()

    def loss(cls, y):
        y = y.to(cls.device).long()
        soft = F.one_hot(y, K).float() * 0.9 + 0.1 / K
        keep = (y != 2).float()
        return (torch.sum(-soft * F.log_softmax(cls, -1), -1) * keep).sum() / len(y)

    def term(outs, d):
        return loss(outs[1], d["labels"]) * 1

    raw = {"labels": y.as_subclass(torch.Tensor)}
    plain_ids = ids.as_subclass(torch.Tensor)
    grads = _per_example(model, "all", term, plain_ids, raw)
    bound = _bites(grads)
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0)
    model.zero_grad(set_to_none=True)
    loss(dp(ids)[1], y).backward()
    got = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
    _assert_close("loader labels", model, got, _reference(grads, bound, len(y)))


def test_grad_scaler_is_refused_not_silently_undone():
    """GradScaler.scale(loss) would be removed like any scalar on the loss, and unscale_ would
    then divide the release by the scale: refused with the fix, nothing written."""
    torch.manual_seed(0)
    model = Net()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    ids, d = _batch(3)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(dpfx.PrivacyError, match="GradScaler"):
        scaler.scale(F.cross_entropy(dp(ids)[1], d["labels"])).backward()
    assert all(p.grad is None for p in model.parameters())


def test_terms_on_their_own_scales():
    """A token mean plus a mean over examples: each term's batch-dependent scale removed on its
    own, through the loss's checked program (Note [Terms on their own scales]); a loss that
    then asks for torch.autograd.grad is refused, not computed another way."""
    which, loss, term = CORPUS["bert_pretraining"]
    torch.manual_seed(0)
    model = Net()
    dp = dpfx.compile(model, max_grad_norm=1e6, noise_multiplier=0.0)
    for batch in (3, 1):
        ids, d = _batch(batch, seed=batch)
        got = _dpfx_step(dp, model, which, loss, ids, d)
        _assert_close(f"B={batch}", model, got,
                      _reference(_per_example(model, which, term, ids, d), 1e6, batch))
    ids, d = _batch(3)
    with pytest.raises(dpfx.PrivacyError, match="loss.backward"):
        torch.autograd.grad(_apply(which, loss, dp(ids), d), list(model.parameters()))


# the Python-number normalizer's first step is warned about, the second refused
@pytest.mark.filterwarnings("ignore::dpfx.LossScaleWarning")
def test_term_weights_follow_a_schedule_but_not_the_batch_size():
    """A weight annealed over steps (a VAE's KL warm-up) trains; a weight that is the batch size
    as a Python number (one term divided by len(y), the other not) is refused once the batch
    size changes, parameters untouched."""
    torch.manual_seed(0)
    model = Net()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    for step, batch in enumerate((4, 3, 5)):
        ids, d = _batch(batch, seed=step)
        beta = min(1.0, 0.1 * (step + 1))
        outs = dp(ids)
        (F.cross_entropy(outs[1], d["labels"]) + beta * outs[2].pow(2).mean()).backward()
    for step, batch in enumerate((4, 3)):
        ids, d = _batch(batch, seed=step)
        outs = dp(ids)
        loss = F.cross_entropy(outs[1], d["labels"], reduction="sum") / len(d["labels"]) + \
            outs[2].pow(2).sum()
        model.zero_grad(set_to_none=True)
        if step == 0:
            loss.backward()
            continue
        with pytest.raises(dpfx.PrivacyError, match="changed with the batch size"):
            loss.backward()
        assert all(p.grad is None for p in model.parameters())


def test_the_auditors_test_through_inductor():
    """The canary test of a few idioms on the default backend: one Inductor module, the bound
    set by the eight equal examples' own norm."""
    torch.manual_seed(0)
    model = Net()
    ids, d = _neighbours()
    names = ["sum_over_len", "token_python_ints", "bert_pretraining"]
    norms = []
    for name in names:
        which, _, term = CORPUS[name]
        g = _per_example(model, which, term, ids, d)[0]
        norms.append(float(torch.sqrt(sum(x.pow(2).sum() for x in g))))
    bound = max(norms) * 1.5
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0, loss_reduction="sum")
    for name in names:
        which, loss, _ = CORPUS[name]
        base = _dpfx_step(dp, model, which, loss, ids[:8], _slice_to(d, 8))
        added = _dpfx_step(dp, model, which, loss, ids, d)
        moved = float(torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(added, base))))
        assert moved <= bound * (1 + 1e-4), (name, moved, bound)
