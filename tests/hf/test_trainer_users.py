"""User-level DP through ``DPTrainer`` (``user_column=``, ``max_examples_per_user=``; Note
[DPTrainer at the user level] in dpfx/hf/users.py).

A tiny GPT-2 (random init from a config) trains on examples that each name their user. At sigma
0 the parameter change of one optimizer step is compared with a loop over the users the trainer
sampled: each user's gradient is the sum of its real examples' batch-of-one gradients of their
own token sums (the per-user term of the causal LM loss), clipped as one, summed over users and
divided by D, the expected number of users per step. Epsilon is dp_accounting's own at the
user-level q, and a canary user of k copies of one example moves the release by C / D, where
clipping each copy would move it by k C / D.
"""
import collections
import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import dpfx
from support.reference import CLIP_EPS

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
hf = pytest.importorskip("dpfx.hf")

VOCAB, T, K = 37, 8, 3
COUNTS = [1, 2, 4, 3, 5, 1, 2, 3]          # examples per user: fewer, as many and more than k


# A dropout whose draws stay in the graph while its mask keeps every element (Note [A dropout
# that keeps every element] in tests/loop/test_users.py)
KEEPS_ALL = 1e-30


def gpt2(dropout=0.0):
    """A tiny GPT-2; ``dropout=None`` keeps GPT2Config's default dropouts (0.1)."""
    drop = {} if dropout is None else dict(resid_pdrop=dropout, embd_pdrop=dropout,
                                           attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
        eos_token_id=0, **drop))


def user_data(counts=COUNTS, seed=0):
    """Examples {input_ids, labels, user_id}, users' examples shuffled among the others'."""
    g = torch.Generator().manual_seed(seed)
    owners = [f"u{u}" for u, c in enumerate(counts) for _ in range(c)]
    owners = [owners[i] for i in torch.randperm(len(owners), generator=g).tolist()]
    rows = []
    for owner in owners:
        ids = torch.randint(1, VOCAB, (T,), generator=g)
        labels = ids.clone()
        if torch.rand((), generator=g) < 0.5:
            labels[-2:] = -100
        rows.append({"input_ids": ids, "labels": labels, "user_id": owner})
    return rows


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                logging_steps=1, disable_tqdm=True, seed=0, optim="sgd", learning_rate=1.0,
                lr_scheduler_type="constant", weight_decay=0.0, warmup_steps=0)
    return transformers.TrainingArguments(**{**base, **kw})


@contextlib.contextmanager
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpfx.LossScaleWarning)
        yield


class _Recording(hf.DPTrainer):
    """Keeps each logical batch the trainer stepped on."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        from dpfx.loss.track import untrack
        self.batches = getattr(self, "batches", []) + [
            {k: v.clone() for k, v in untrack(inputs).items()}]
        return super().training_step(model, inputs, num_items_in_batch)


def _example_grad(model, ids, labels):
    params = [p for p in model.parameters() if p.requires_grad]
    logits = model(input_ids=ids[None]).logits[0]
    loss = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
    return [g if g is not None else torch.zeros_like(p) for g, p in
            zip(torch.autograd.grad(loss, params, allow_unused=True), params)]


def _user_grads(model, batch):
    """Each user's summed gradient over its real slots (a padding slot's labels are all
    -100: it adds nothing, checked by the caller)."""
    out = []
    for u in range(batch["input_ids"].shape[0]):
        gs = [_example_grad(model, batch["input_ids"][u, j], batch["labels"][u, j])
              for j in range(K) if (batch["labels"][u, j] != -100).any()]
        out.append([sum(x) for x in zip(*gs)])
    return out


def _norm(g):
    return float(torch.sqrt(sum(x.pow(2).sum() for x in g)))


def _check_padding(batch, data):
    """Every row one user's; padding slots copy the row's first example and carry no label."""
    by_ids = {tuple(r["input_ids"].tolist()): r["user_id"] for r in data}
    seen = set()
    for u in range(batch["input_ids"].shape[0]):
        owners = {by_ids[tuple(x.tolist())] for x in batch["input_ids"][u]}
        assert len(owners) == 1 and not owners & seen
        seen |= owners
        pad = [j for j in range(K) if (batch["labels"][u, j] == -100).all()]
        assert all(torch.equal(batch["input_ids"][u, j], batch["input_ids"][u, 0]) for j in pad)
        count = collections.Counter(r["user_id"] for r in data)[owners.pop()]
        assert K - len(pad) == min(count, K)


def _trainer(tmp_path, data, model, bound, physical=2, accumulation=2, **kw):
    settings = dict(max_grad_norm=bound, noise_multiplier=0.0, user_column="user_id",
                    max_examples_per_user=K, sampler_generator=torch.Generator().manual_seed(5),
                    dp_kwargs={"backend": "eager"})
    settings.update(kw)
    return _Recording(model=model, args=args(tmp_path, per_device_train_batch_size=physical,
                                             gradient_accumulation_steps=accumulation,
                                             max_steps=1),
                      train_dataset=data, **settings)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_user_level_step_is_the_clipped_per_user_reference(tmp_path, backend):
    """sigma 0, SGD at lr 1, 2 users per physical batch, accumulation 2 (4 users expected of
    8: q = 1/2, D = 4): the step is the sum over the sampled users of each user's clipped
    summed gradient, over D; clipping bites on some users only. Through Inductor the model
    keeps its dropouts, at p = KEEPS_ALL: their masks are drawn over the k*U rows."""
    torch.manual_seed(0)
    model, data = gpt2(KEEPS_ALL if backend == "inductor" else 0.0), user_data()
    reference = copy.deepcopy(model)
    everyone = _user_grads(reference, _all_users(data))
    bound = sorted(_norm(g) for g in everyone)[len(everyone) // 2]
    trainer = _trainer(tmp_path, data, model, bound, dp_kwargs={"backend": backend})
    assert trainer.privacy_unit == "user" and trainer.sample_rate == pytest.approx(0.5)
    before = [p.detach().clone() for p in model.parameters()]
    with quiet():
        trainer.train()
    (batch,) = trainer.batches
    users = batch["input_ids"].shape[0]
    assert batch["input_ids"].shape == (users, K, T) and users >= 3
    _check_padding(batch, data)
    grads = _user_grads(reference, batch)
    factors = [min(1.0, bound / (_norm(g) + CLIP_EPS)) for g in grads]
    assert 0 < sum(f < 1.0 for f in factors) < users
    want = [sum(g[j] * f for g, f in zip(grads, factors)) / 4 for j in range(len(before))]
    for p, b, w in zip(model.parameters(), before, want):
        torch.testing.assert_close(b - p.detach(), w, rtol=2e-4, atol=1e-6)
    assert trainer.accountant.history == [(0.0, pytest.approx(0.5), 1)]


def test_the_documented_snippet_trains_on_a_default_gpt2_config(tmp_path):
    """docs/users.md's DPTrainer snippet on GPT2Config's default dropouts (0.1), through
    Inductor: sigma 0, SGD at lr 1, every user sampled (q = 1, D = 4), sum of the users'
    clipped gradients over D: the step moves the weights by at most U C / D."""
    torch.manual_seed(0)
    model, data = gpt2(None), user_data([1, 2, 4, 3])
    assert model.config.resid_pdrop == model.config.attn_pdrop == 0.1
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    trainer = hf.DPTrainer(
        model=model, args=args(tmp_path, per_device_train_batch_size=4, max_steps=1),
        train_dataset=data, user_column="user_id", max_examples_per_user=K, max_grad_norm=0.1,
        noise_multiplier=0.0)
    with quiet():
        trainer.train()
    step = before - torch.cat([p.detach().flatten() for p in model.parameters()])
    assert 0 < float(step.norm()) <= 0.1 * (1 + 1e-5)
    assert trainer.privacy_unit == "user"


def _all_users(data):
    """Every user's first k examples as one (users, k, T) batch, labels of padding -100."""
    rows = collections.defaultdict(list)
    for r in data:
        rows[r["user_id"]].append(r)
    ids, labels = [], []
    for rs in rows.values():
        rs = rs[:K]
        ids.append(torch.stack([r["input_ids"] for r in rs] + [rs[0]["input_ids"]] * (K - len(rs))))
        labels.append(torch.stack([r["labels"] for r in rs] +
                                  [torch.full((T,), -100)] * (K - len(rs))))
    return {"input_ids": torch.stack(ids), "labels": torch.stack(labels)}


def test_epsilon_is_per_user(tmp_path):
    """Three steps at sigma 1: the logged epsilon is dp_accounting's for the Poisson-sampled
    Gaussian at the user-level q = 4 / 8 users, not the example-level 4 / 21."""
    dp_accounting = pytest.importorskip("dp_accounting")
    torch.manual_seed(0)
    trainer = hf.DPTrainer(
        model=gpt2(), args=args(tmp_path, per_device_train_batch_size=4, max_steps=3),
        train_dataset=user_data(), user_column="user_id", max_examples_per_user=K,
        noise_multiplier=1.0, target_delta=1e-5, dp_kwargs={"backend": "eager"})
    with quiet():
        trainer.train()
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        4 / len(COUNTS), dp_accounting.GaussianDpEvent(1.0)), 3)
    want = accountant.get_epsilon(1e-5)
    assert trainer.get_epsilon() == pytest.approx(want, rel=1e-6)
    assert [e["epsilon"] for e in trainer.state.log_history if "loss" in e][-1] == \
        pytest.approx(want, rel=1e-6)
    assert trainer.accountant.history == [(1.0, pytest.approx(0.5), 3)]


def test_a_canary_user_moves_the_release_by_at_most_C_over_D(tmp_path):
    """A canary user of k copies of one example, each copy's gradient above C, in a batch of
    every user (q = 1): the step less the other users' clipped sum over D is the canary's
    clipped gradient over D, of norm C / D; clipped per example it would be k C / D."""
    torch.manual_seed(0)
    data = user_data([1, 2, 4])
    canary = {"input_ids": torch.randint(1, VOCAB, (T,)), "user_id": "canary"}
    canary["labels"] = canary["input_ids"].clone()
    data += [dict(canary) for _ in range(K)]
    model = gpt2()
    reference = copy.deepcopy(model)
    one = _norm(_example_grad(reference, canary["input_ids"], canary["labels"]))
    bound = one / 2                                  # every copy would be clipped alone
    trainer = _trainer(tmp_path, data, model, bound, physical=4, accumulation=1)
    assert trainer.sample_rate == 1.0                # 4 users of 4: D = 4
    before = [p.detach().clone() for p in model.parameters()]
    with quiet():
        trainer.train()
    (batch,) = trainer.batches
    assert batch["input_ids"].shape[0] == 4
    grads = _user_grads(reference, batch)
    rows = [u for u in range(4) if torch.equal(batch["input_ids"][u, 0], canary["input_ids"])]
    assert len(rows) == 1
    rest = [g for u, g in enumerate(grads) if u != rows[0]]
    others = [sum(g[j] * min(1.0, bound / (_norm(g) + CLIP_EPS)) for g in rest) / 4
              for j in range(len(before))]
    moved = [b - p.detach() - o for p, b, o in zip(model.parameters(), before, others)]
    assert _norm(moved) == pytest.approx(bound / 4, rel=1e-3)
    assert _norm(moved) < K * bound / 4 / 2


# -- refused before the model changes --------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(user_column="author", max_examples_per_user=K), "no such column"),
    (dict(user_column="user_id"), "needs max_examples_per_user"),
    (dict(max_examples_per_user=K), "exactly one of user_column"),
    (dict(user_column="user_id", user_ids=["a"] * 21, max_examples_per_user=K),
     "exactly one of user_column"),
    (dict(user_column="user_id", max_examples_per_user=0), "must be an int >= 1"),
    (dict(user_ids=["a"] * 5, max_examples_per_user=K), "one id per example"),
    (dict(dp_kwargs={"user_ids": ["a"] * 21}), "to DPTrainer itself"),
    (dict(user_column="user_id", max_examples_per_user=K, classifier=True),
     "GPT2ForSequenceClassification is none of them"),
    (dict(user_column="user_id", max_examples_per_user=K, per_device_train_batch_size=9),
     "exceeds the 8 training users"),
])
def test_bad_user_options_are_refused_and_leave_the_model_untouched(tmp_path, kwargs, match):
    kwargs = dict(kwargs)
    model = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=16, pad_token_id=0)) \
        if kwargs.pop("classifier", False) else gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = kwargs.pop("per_device_train_batch_size", 2)
    with pytest.raises(ValueError, match=match):
        hf.DPTrainer(model=model, args=args(tmp_path, per_device_train_batch_size=batch),
                     train_dataset=user_data(), noise_multiplier=1.0, **kwargs)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
