"""The loss captured with the model: ``dpfx.compile(model, loss=fn)``, ``dp.loss(x, *targets)``
(Note [The loss inside the graph] in dpfx/loss/captured.py).

The plain loop's loss corpus (tests/loss/test_loss_corpus.py: losses as libraries and scripts write
them) is run again in the captured form: each per-example loss against the same batch-of-one
reference, each coupled one refused with the op and the user's line at the first call, and the
auditor's canary. Then what only the captured form has: the release (a positive multiple of the
loss, nothing else), dynamo's guards re-proving a loss that changes, the batch sizes that
collide, Inductor cold and warm, and Hugging Face models with their token losses.
"""
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from support import loss_idioms as corpus
from support.reference import CLIP_EPS, assert_close
from support.sweep import every_other, examples, reductions, with_reductions

KEYS = ["tokens", "labels", "multi", "target", "teacher", "weight"]
# CTC's kernel has an output size that depends on the data, and F.gaussian_nll_loss branches on
# the data (`if torch.any(var < 0)`, its check of a variance tensor): dynamo cannot capture them
# with a symbolic batch. The plain loop trains both (it replays CTC through a per-example op,
# the Gaussian NLL without the check its real call made); the captured form refuses them, by
# name (test_captured_loss_branching_on_data_is_named).
DATA_BRANCHES = {"ctc", "gaussian_nll_module", "gaussian_nll_full_sum"}
CAPTURED = sorted(set(corpus.CORPUS) - DATA_BRANCHES)
COUPLED = sorted(set(corpus.COUPLED) - {"gaussian_nll_batch_variance"})


def _fn(which, f):
    def loss(outs, *targets):
        return corpus._apply(which, f, outs, dict(zip(KEYS, targets)))
    return loss


def _step(dp, model, ids, d):
    model.zero_grad(set_to_none=True)
    dp.loss(ids, *[d[k] for k in KEYS]).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]


def _compile(model, which, f, **kwargs):
    kwargs.setdefault("noise_multiplier", 0.0)
    return dpfx.compile(model, loss=_fn(which, f), **kwargs)


@pytest.mark.parametrize("name", every_other(CAPTURED))
def test_captured_losses_match_reference(name):
    """Batch sizes 3 and 1 through one compiled model (mean), 4 (= T, sum), a bound that bites,
    the FX backend; an empty batch releases zeros. By default every other idiom, under one of the
    two reductions (tests/support/sweep.py)."""
    which, loss, term = corpus.CORPUS[name]
    wanted = reductions(every_other(CAPTURED), name)    # tests/support/sweep.py
    for batches, reduction in (((3, 1), "mean"), ((4,), "sum")):
        if reduction not in wanted:
            continue
        torch.manual_seed(0)
        model = corpus.Net()
        data = [corpus._batch(b, seed=b) for b in batches]
        grads = [corpus._per_example(model, which, term, ids, d) for ids, d in data]
        bound = corpus._bites([g for per_batch in grads for g in per_batch])
        dp = _compile(model, which, loss, max_grad_norm=bound, loss_reduction=reduction,
                      backend="eager")
        for batch, (ids, d), g in zip(batches, data, grads):
            got = _step(dp, model, ids, d)
            corpus._assert_close(f"{name} B={batch} {reduction}", model, got,
                                 corpus._reference(g, bound, batch if reduction == "mean" else 1))
    if "sum" not in wanted:
        return          # an empty batch needs D under "mean": the sum run takes it
    ids, d = corpus._batch(0)
    if not _runs_empty(which, loss, model, ids, d):
        return
    got = _step(dp, model, ids, d)
    assert all(float(g.abs().max()) == 0 for g in got)


def _runs_empty(which, loss, model, ids, d) -> bool:
    """Whether the idiom itself runs on an empty batch (``1.0 / len(y)`` does not)."""
    try:
        corpus._apply(which, loss, model(ids), d)
    except (ZeroDivisionError, RuntimeError):
        return False
    return True


# Through Inductor by default: the plain loss, several heads' terms, Python ints in the token
# loss, a batch-mean KL. The rest, slow: HF's shifted token loss and the token mean run through
# Inductor by default in test_hf_token_loss_exact_through_inductor, and a positive factor on the
# loss (times_reciprocal, half_the_loss) is the scale every mean already takes out at run time.
INDUCTOR = ["plain_cross_entropy", "bert_pretraining", "token_python_ints",
            "distillation_batchmean"]


@pytest.mark.parametrize("name", INDUCTOR + [pytest.param(n, marks=pytest.mark.slow)
                                             for n in CAPTURED if n not in INDUCTOR])
def test_captured_losses_through_inductor(name):
    """Through Inductor with the self-check on, B = 3, 1, 0 and 4 (= T) with one graph pair
    for the loss and one for the empty batch (Note [An empty batch and the captured loss]):
    with a bound no example reaches (each gradient's scale) and one every example exceeds (its
    direction). The eight by default cover a token count, a size, a size as a float, a Python
    number, a per-term scale and batchmean; the rest are slow."""
    which, loss, term = corpus.CORPUS[name]
    torch.manual_seed(0)
    model = corpus.Net()
    for bound in (1e6, 1e-4):
        dp = _compile(model, which, loss, max_grad_norm=bound, loss_reduction="sum")
        for batch in (3, 1, 0, 4):
            ids, d = corpus._batch(batch, seed=batch)
            if batch == 0 and not _runs_empty(which, loss, model, ids, d):
                continue
            got = _step(dp, model, ids, d)
            if batch == 0:
                assert all(float(g.abs().max()) == 0 for g in got)
                continue
            grads = corpus._per_example(model, which, term, ids, d)
            corpus._assert_close(f"{name} B={batch} C={bound}", model, got,
                                 corpus._reference(grads, bound, 1))
        assert dp.compile_count in (2, 4), dp.compile_count


@pytest.mark.parametrize("name", COUPLED)
def test_coupled_losses_are_refused_at_the_first_call(name):
    """Refused while compiling, with the op (or dpfx's own refusal of the op) and the line,
    before anything is written."""
    which, loss, op = corpus.COUPLED[name]
    message = _refused_at_the_first_call(which, loss, dpfx.PrivacyError)
    assert "loss_idioms.py" in message, message
    if op is not None and name != "in_batch_negatives":     # torch.roll: dpfx's own refusal
        assert f"op {op}" in message, message


def _refused_at_the_first_call(which, loss, error) -> str:
    """The message of ``error``, raised by the first call of the captured loss, which wrote
    nothing."""
    torch.manual_seed(0)
    model = corpus.Net()
    dp = _compile(model, which, loss, max_grad_norm=1.0, backend="eager")
    ids, d = corpus._batch(5)
    with pytest.raises(error) as info:
        dp.loss(ids, *[d[k] for k in KEYS])
    assert all(p.grad is None for p in model.parameters())
    return str(info.value)


@pytest.mark.parametrize("name", ["gaussian_nll_module", "gaussian_nll_batch_variance"])
def test_captured_loss_branching_on_data_is_named(name):
    """A captured loss whose torch code branches on the data (F.gaussian_nll_loss's check of its
    variance) is refused at the first call as a branch on the data, with the user's line and the
    plain loop as the way out, before anything is written; the plain loop trains the
    per-example one (tests/loss/test_loss_corpus.py)."""
    which, loss = (corpus.CORPUS[name][:2] if name in corpus.CORPUS
                   else corpus.COUPLED[name][:2])
    message = _refused_at_the_first_call(which, loss, dpfx.CaptureError)
    assert "branches on a value computed from the data" in message, message
    assert "loss_idioms.py:" in message and "loss.backward()" in message, message


@pytest.mark.parametrize("name,reduction", with_reductions(
    [n for n in corpus.CANARY_IDIOMS if n not in DATA_BRANCHES]))
def test_one_added_example_moves_the_release_by_at_most_C_over_D(name, reduction):
    """The auditor's canary of tests/loss/test_loss_corpus.py, in the captured form. By default
    each idiom under one reduction (tests/support/sweep.py)."""
    which, loss, term = corpus.CORPUS[name]
    torch.manual_seed(0)
    model = corpus.Net()
    ids, d = corpus._neighbours()
    grads = corpus._per_example(model, which, term, ids, d)
    norm = float(torch.sqrt(sum(x.pow(2).sum() for x in grads[0])))
    bound, expected = norm * 1.5, 6
    dp = _compile(model, which, loss, max_grad_norm=bound, loss_reduction=reduction,
                  expected_batch_size=expected if reduction == "mean" else None,
                  backend="eager")
    base = _step(dp, model, ids[:8], corpus._slice_to(d, 8))
    added = _step(dp, model, ids, d)
    moved = float(torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(added, base))))
    limit = bound / (expected if reduction == "mean" else 1)
    assert moved <= limit * (1 + 1e-4), (moved, limit)


@settings(max_examples=examples(12), deadline=None, derandomize=True)
@given(batch=st.integers(0, 7), width=st.integers(1, 5), classes=st.integers(2, 5),
       reduction=st.sampled_from(["mean", "sum"]), kind=st.sampled_from(["ce", "mse_len"]))
def test_captured_losses_against_torch_func(batch, width, classes, reduction, kind):
    """Shapes, batch sizes 0 to 7 (1 and ones equal to other dims among them), both
    reductions, a bound that bites on the full batch: the captured loss against torch.func's
    per-example gradients (tests/support/reference.py, which shares no code with dpfx)."""
    from support.reference import dp_sgd_grads, per_example_grads

    torch.manual_seed(batch * 31 + width)
    model = nn.Sequential(nn.Linear(width, 6), nn.Tanh(), nn.Linear(6, classes))
    x = torch.randn(batch, width)
    if kind == "ce":
        y = torch.randint(0, classes, (batch,))

        def loss(out, y):                          # a token-free mean cross-entropy
            return F.cross_entropy(out, y, reduction="mean")

        def per_example(out, y):
            return F.cross_entropy(out, y)
    else:
        y = torch.randn(batch, classes)

        def loss(out, y):                          # a sum over len(y): the batch as a size
            return (out - y).pow(2).sum() / len(y)

        def per_example(out, y):
            return (out - y).pow(2).sum()
    bound, expected = 0.05, 4
    if batch:       # a bound that clips about half the examples: a wrong scale then shows
        g = per_example_grads(model, per_example, x, y)
        bound = float(torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values())).median())
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0, backend="eager",
                      loss_reduction=reduction, expected_batch_size=expected, loss=loss)
    model.zero_grad(set_to_none=True)
    if batch == 0 and kind == "mse_len":
        return                                     # 1 / len(y) fails on an empty batch in eager
    dp.loss(x, y).backward()
    want = dp_sgd_grads(model, per_example, x, y, max_grad_norm=bound, loss_reduction=reduction,
                        expected_batch_size=expected)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[k], rtol=1e-4, atol=1e-7)


def test_the_auditor_catches_a_batch_size_kept_in_each_term():
    """The canary's positive control in the captured form: with a bound that g/8 escapes and g
    does not, keeping the 1/B of ``sum / len(y)`` in each term would move the release by more
    than C (tests/loss/test_loss_corpus.py computes that); the captured loss moves it by at most C
    and releases exactly the clipped sum of the per-example terms."""
    which, loss, term = corpus.CORPUS["sum_over_len"]
    torch.manual_seed(0)
    model = corpus.Net()
    ids, d = corpus._neighbours()
    grads = corpus._per_example(model, which, term, ids, d)
    norm = float(torch.sqrt(sum(x.pow(2).sum() for x in grads[0])))
    bound = norm / 8 * 1.01
    dp = _compile(model, which, loss, max_grad_norm=bound, loss_reduction="sum",
                  backend="eager")
    base = _step(dp, model, ids[:8], corpus._slice_to(d, 8))
    added = _step(dp, model, ids, d)
    assert float(torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(added, base)))) <= \
        bound * (1 + 1e-4)
    for g, w in zip(added, corpus._clipped_sum(grads, bound, 1.0)):
        torch.testing.assert_close(g, w, rtol=2e-4, atol=1e-6)


# -- the release -------------------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(n=5):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_a_positive_multiple_releases_the_same_and_the_value_is_the_users():
    """``loss / accum`` and Trainer's ``loss *= k`` release what ``loss`` releases (the scalar
    is removed like every scalar after the batch reduction); the value is fn's; the plain loop
    on the same module releases the same."""
    model = _mlp()
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, backend="eager",
                      loss=F.cross_entropy)
    x, y = _data()
    loss = dp.loss(x, y)
    torch.testing.assert_close(loss.detach(), F.cross_entropy(model(x), y).detach())
    loss.backward()
    want = _grads(model)
    for scaled in (lambda l: l / 4, lambda l: 2.5 * l, lambda l: l.mul_(3)):
        model.zero_grad(set_to_none=True)
        scaled(dp.loss(x, y)).backward()
        for g, w in zip(_grads(model), want):
            torch.testing.assert_close(g, w)
    # the keyword forms: Tensor.backward hands its defaults on as keywords (the fast path),
    # an explicit positive gradient is a positive multiple, and so is autograd.backward's
    for backward in (lambda l: l.backward(retain_graph=None, create_graph=False),
                     lambda l: l.backward(gradient=torch.tensor(2.0)),
                     lambda l: l.backward(torch.tensor(0.5)),
                     lambda l: torch.autograd.backward(l)):
        model.zero_grad(set_to_none=True)
        backward(dp.loss(x, y))
        for g, w in zip(_grads(model), want):
            torch.testing.assert_close(g, w)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(dp(x), y).backward()
    for g, w in zip(_grads(model), want):
        torch.testing.assert_close(g, w)
    model.zero_grad(set_to_none=True)
    grads = torch.autograd.grad(dp.loss(x, y), list(model.parameters()))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w)


def test_other_uses_of_the_loss_release_nothing():
    """A negative tensor multiple, a sum with another tensor, a second backward: refused, and
    the refused backward writes nothing (a negative number trains: tests/loss/
    test_loss_sign.py)."""
    model = _mlp()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager",
                      loss=F.cross_entropy)
    x, y = _data()
    with pytest.raises(dpfx.PrivacyError, match="gradient=-2.0"):
        dp.loss(x, y).backward(gradient=torch.tensor(-2.0))
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(dpfx.PrivacyError, match="did not check"):
        (dp.loss(x, y) + model(x).sum()).backward()
    # the graph saves the loss's gradient for its backward (a donated buffer): torch refuses
    # retain_graph=True, and dpfx's release hook refuses a second backward before torch does
    model.zero_grad(set_to_none=True)
    loss = dp.loss(x, y)
    loss.backward()
    with pytest.raises(dpfx.PrivacyError, match="second backward"):
        loss.backward()


def test_a_loss_reading_a_parameter_is_refused():
    """A regularizer on the weights inside the loss would reach p.grad unclipped."""
    model = _mlp()

    def loss(out, y):
        return F.cross_entropy(out, y) + 1e-3 * model[0].weight.pow(2).sum()

    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager", loss=loss)
    with pytest.raises(dpfx.PrivacyError, match="parameter"):
        dp.loss(*_data())
    assert all(p.grad is None for p in model.parameters())


def test_a_loss_that_changes_is_proven_again():
    """dynamo guards on what the loss reads: a switch to a coupled loss after two steps captures
    again, and the new graph is refused."""
    model = _mlp()
    state = {"center": False}

    def loss(out, y):
        if state["center"]:
            out = out - out.mean(0)
        return F.cross_entropy(out, y)

    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager", loss=loss)
    x, y = _data()
    for _ in range(2):
        dp.loss(x, y).backward()
        model.zero_grad(set_to_none=True)
    state["center"] = True
    with pytest.raises(dpfx.PrivacyError, match="mean"):
        dp.loss(x, y)


def test_batch_sizes_compile_once_and_match_through_inductor_cold_and_warm(tmp_path,
                                                                          monkeypatch):
    """B = 5, 1, 3 (the classes' count), 6 (the input width): one forward and one backward
    graph, self-check on, exact against torch.func; B = 0 adds the model's own pair (Note [An
    empty batch and the captured loss]); then a new process's view: dynamo reset, a new
    module, Inductor's FX graph cache warm, the same gradients."""
    from torch.func import functional_call, grad, vmap

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    bound, expected = 0.05, 4

    def reference(model, x, y):
        params = {k: v.detach() for k, v in model.named_parameters()}

        def one(p, xi, yi):
            return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

        g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
        f = (bound / (norms + CLIP_EPS)).clamp(max=1.0)
        return [(g[k] * f.view(-1, *[1] * (g[k].dim() - 1))).sum(0) / expected
                for k, _ in model.named_parameters()]

    for run in ("cold", "warm"):
        torch._dynamo.reset()
        model = _mlp()
        dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0,
                          expected_batch_size=expected, loss=F.cross_entropy)
        empty_seen = False
        for batch in (5, 1, 3, 6, 0, 2):
            empty_seen = empty_seen or not batch
            x, y = _data(batch)
            model.zero_grad(set_to_none=True)
            dp.loss(x, y).backward()
            want = reference(model, x, y) if batch else [torch.zeros_like(p)
                                                         for p in model.parameters()]
            for p, w in zip(model.parameters(), want):
                torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-7,
                                           msg=lambda m: f"{run} B={batch}: {m}")
            assert dp.compile_count == (4 if empty_seen else 2), (run, batch, dp.compile_count)


def test_the_decomposition_reaches_a_table_cached_before_dpfx_was_imported():
    """Inductor caches its table with the random decompositions (what it traces with when
    ``fallback_random`` is off, as on a GPU) at its first use. A process that compiled something
    before importing dpfx must still trace ``dpfx::loss_gradient`` away, or Inductor refuses the op
    it finds both decomposed and in the graph (seen on an H100)."""
    import subprocess
    import sys
    code = (
        "import torch\n"
        "from torch._inductor import config, decomposition\n"
        "decomposition.fast_random_decomps()\n"
        "import dpfx\n"
        "op = torch.ops.dpfx.loss_gradient.default\n"
        "for random in (False, True):\n"
        "    with config.patch(fallback_random=random):\n"
        "        assert op in decomposition.select_decomp_table(), random\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_noise_is_added_once_per_step():
    """sigma > 0: the released gradient of an empty batch is the noise alone, std sigma*C/D."""
    model = nn.Linear(200, 50)
    dp = dpfx.compile(model, max_grad_norm=2.0, noise_multiplier=1.5, expected_batch_size=10,
                      backend="eager", loss=lambda out, y: F.mse_loss(out, y))
    x, y = torch.zeros(0, 200), torch.zeros(0, 50)
    dp.loss(x, y).backward()
    std = float(model.weight.grad.std())
    assert abs(std - 1.5 * 2.0 / 10) < 0.02, std


def test_make_private_with_a_captured_loss():
    """dpfx's Poisson loader yields tracked batches; its labels train as targets, one accounted
    step per optimizer step, and a target computed from the whole batch's labels is refused."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g))
    model = _mlp()
    dp, opt, loader, accountant = dpfx.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=8,
        max_grad_norm=1.0, noise_multiplier=1.0, backend="eager", loss=F.cross_entropy,
        generator=torch.Generator().manual_seed(1))
    steps = 0
    for x, y in loader:
        opt.zero_grad()
        dp.loss(x, y).backward()
        opt.step()
        steps += 1
    assert steps == 6 and dp.releases == 6
    assert accountant.get_epsilon(1e-5) > 0
    x, y = next(iter(loader))
    with pytest.raises(dpfx.PrivacyError):
        dp.loss(x, y.float() - y.float().mean())


# -- Hugging Face models, their outputs and token losses -------------------------------------
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["gpt2-shifted", "llama"])
def test_hf_token_loss_exact_through_inductor(name):
    """A Hugging Face causal LM returns a ModelOutput; the loss reads its logits. Exact against
    the batch-of-one reference at B = 3 and 1 through Inductor, the self-check on."""
    from support import token_losses

    make, loss, term = token_losses.CASES[name]
    torch.manual_seed(0)
    model = make()
    model.train()
    ids, mask, labels = token_losses.token_batch(3)
    want, bound = token_losses.reference(model, term, ids, mask, labels)
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0,
                      loss=lambda out, y: loss(out.logits, y))
    for batch in (3, 1):
        one = (ids[:batch], mask[:batch], labels[:batch])
        if batch != 3:
            want, _ = token_losses.reference(model, term, *one, bound=bound)
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dp.loss(dict(input_ids=one[0], attention_mask=one[1], use_cache=False),
                    one[2]).backward()
        got = {k: torch.zeros_like(p) if p.grad is None else p.grad
               for k, p in model.named_parameters() if p.requires_grad}
        assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss,named", [
    (3, "got int 3"),
    ("cross_entropy", "got str 'cross_entropy'"),
    (torch.tensor(1.0), "got Tensor"),
    ([F.cross_entropy], "got list"),
    (nn.CrossEntropyLoss, r"got the class CrossEntropyLoss: pass an instance "
                          r"\(loss=CrossEntropyLoss\(\)\)"),
])
def test_a_loss_that_is_not_a_function_is_refused_at_compile(loss, named):
    """``loss=`` that is not a function (or an nn.Module loss instance) is refused by
    dpfx.compile, naming the argument and what it got, before the model is wrapped; not at the
    first ``dp.loss(...)`` as a capture error about the model."""
    model = nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = (dict(model._forward_hooks), dict(model._forward_pre_hooks))
    with pytest.raises(dpfx.OptionError, match=r"dpfx\.compile\(loss=\.\.\.\) takes a loss "
                                               r"function.*" + named):
        dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, loss=loss)
    with pytest.raises(TypeError):      # an OptionError is a TypeError
        dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, loss=loss)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert (dict(model._forward_hooks), dict(model._forward_pre_hooks)) == hooks
    assert all(p.grad is None and not p._post_accumulate_grad_hooks for p in model.parameters())
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager",
                      loss=nn.CrossEntropyLoss())        # an instance is a loss function
    dp.loss(torch.randn(4, 3), torch.tensor([0, 1, 1, 0])).backward()
    assert all(p.grad is not None for p in model.parameters())
