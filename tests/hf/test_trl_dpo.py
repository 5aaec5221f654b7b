"""DP preference optimization through TRL's DPOTrainer (dpfx/trl/dpo.py): the pair is the unit.

The tokenizer and the tiny GPT-2 are test_trl_sft.py's (nothing downloaded). The trainer's
optimizer steps at sigma 0, through the default Inductor backend, are compared with a reference
that takes each pair alone: its chosen and its rejected sequence each run through the policy
as a batch of one without padding, the reference log-probs computed the same way under no_grad
(a frozen copy of the initial policy, or the PEFT model with its adapter disabled), the pair's
loss written here from the papers' formulas, differentiated, clipped with a bound that bites,
summed and divided by the expected number of pairs.
"""
import copy
import json

import pytest
import torch
import torch.nn.functional as F

from support.reference import CLIP_EPS

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
dpfx_trl = pytest.importorskip("dpfx.trl")
import dpfx.hf  # noqa: E402
from test_trl_sft import WORDS, Recording, StopAt, gpt2, tokenizer  # noqa: E402

BETA = 0.5


def pairs(n=16):
    """Prompt, chosen and rejected completions of different lengths."""
    return datasets.Dataset.from_list([
        {"prompt": f"say {w}:", "chosen": f" {w}", "rejected": f" {w[::-1]}{'!' * (i % 3)}"}
        for i, w in enumerate(WORDS[:n])])


def dpo_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                logging_steps=1, disable_tqdm=True, seed=0, gradient_checkpointing=False,
                bf16=False, max_length=32, beta=BETA, optim="sgd", learning_rate=1.0,
                lr_scheduler_type="constant", weight_decay=0.0, warmup_steps=0)
    return trl.DPOConfig(**{**base, **kw})


class RecordingDPO(dpfx_trl.DPDPOTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        from dpfx.loss.track import untrack
        self.batches = getattr(self, "batches", []) + [
            {k: v.clone() for k, v in untrack(inputs).items()}]
        return super().training_step(model, inputs, num_items_in_batch)


def sequence_logp(model, ids, completion):
    """One sequence alone: the summed log-probability of its completion tokens."""
    logits = model(input_ids=ids[None]).logits[0, :-1]
    token = -F.cross_entropy(logits.float(), ids[1:], reduction="none")
    return (token * completion[1:]).sum()


def pair_loss(loss_type, c, r, lc, lr):
    if loss_type == "sigmoid":          # Rafailov et al. 2023, eq. 7
        return -F.logsigmoid(BETA * (c - r))
    assert loss_type == "ipo"           # Azar et al. 2023, eq. 17, per token
    return (c / lc - r / lr - 1 / (2 * BETA)) ** 2


def pair_grads(policy, reference, batch, loss_type):
    """Each pair's gradient of its own loss: its two sequences through the policy one at a time,
    the reference's log-probs as constants."""
    params = [p for p in policy.parameters() if p.requires_grad]
    out = []
    for i in range(batch["input_ids"].shape[0]):
        logps, refs, lengths = [], [], []
        for row in range(2):                    # chosen, rejected
            keep = batch["attention_mask"][i, row].bool()
            ids, completion = batch["input_ids"][i, row][keep], \
                batch["completion_mask"][i, row][keep]
            logps.append(sequence_logp(policy, ids, completion))
            with torch.no_grad():
                refs.append(reference(ids, completion))
            lengths.append(completion.sum().clamp(min=1))
        loss = pair_loss(loss_type, logps[0] - refs[0], logps[1] - refs[1], *lengths)
        g = torch.autograd.grad(loss, params, allow_unused=True)
        out.append([torch.zeros_like(p) if x is None else x for x, p in zip(g, params)])
    return out


def _norm(g):
    return float(torch.sqrt(sum(x.pow(2).sum() for x in g)))


VARIANTS = {
    # full fine-tuning, the reference log-probs precomputed by TRL on the dataset
    "sigmoid-precomputed": dict(loss_type="sigmoid", precompute_ref_log_probs=True),
    # LoRA, the reference the base model (the adapter disabled at each step)
    "ipo-lora": dict(loss_type="ipo"),
    # full fine-tuning against a frozen reference model given as ref_model
    "sigmoid-ref-model": dict(loss_type="sigmoid"),
    # DPOConfig's default activation checkpointing: the checkpointed blocks' forward recomputed
    # in the backward graph, its attention run under a saved RNG state
    "sigmoid-precomputed-checkpointed": dict(loss_type="sigmoid", precompute_ref_log_probs=True,
                                             gradient_checkpointing=True),
    "ipo-lora-checkpointed": dict(loss_type="ipo", gradient_checkpointing=True),
}


def plain_copy(model):
    """A copy of ``model`` that runs its blocks without activation checkpointing."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False):
            module.gradient_checkpointing = False
    return model


def make_dpo(tmp_path, variant, model, **dp):
    extra = {}
    if variant.startswith("ipo-lora"):
        peft = pytest.importorskip("peft")
        extra["peft_config"] = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                               fan_in_fan_out=True, lora_dropout=0.0)
    if variant == "sigmoid-ref-model":
        extra["ref_model"] = copy.deepcopy(model)
    return RecordingDPO(
        model=model, args=dpo_args(tmp_path, per_device_train_batch_size=2, max_steps=3,
                                   **VARIANTS[variant]),
        train_dataset=pairs(), processing_class=tokenizer(), noise_multiplier=0.0,
        sampler_generator=torch.Generator().manual_seed(4), **extra, **dp)


def reference_of(variant, policy):
    """The reference's log-prob of one sequence: a frozen copy of the initial policy, or the
    PEFT policy with its adapter disabled."""
    if variant.startswith("ipo-lora"):
        def logp(ids, completion):
            with policy.disable_adapter():
                return sequence_logp(policy, ids, completion)
        return logp
    frozen = plain_copy(policy)
    return lambda ids, completion: sequence_logp(frozen, ids, completion)


@pytest.mark.parametrize("variant", ["sigmoid-precomputed", "ipo-lora",
                                     pytest.param("sigmoid-ref-model", marks=pytest.mark.slow),
                                     "sigmoid-precomputed-checkpointed", "ipo-lora-checkpointed"])
def test_dp_dpo_steps_are_the_clipped_pair_reference(tmp_path, variant):
    """sigma 0, SGD at lr 1: every optimizer step's parameter change is the DP-SGD gradient of
    the pairs the trainer sampled, each pair's gradient (chosen and rejected together) clipped as
    one, over logical batches of 0, 1 and 3 pairs (physical batches of at most 2). The
    checkpointed variants train with DPOConfig's default activation checkpointing; the
    reference runs a copy of the policy without it."""
    torch.manual_seed(0)
    model = gpt2()
    loss_type = VARIANTS[variant]["loss_type"]
    probe = make_dpo(tmp_path, variant, copy.deepcopy(model), max_grad_norm=1.0)
    policy = plain_copy(probe.model._orig_mod.module)
    everything = probe.data_collator(list(probe.train_dataset))
    norms = sorted(_norm(g) for g in pair_grads(policy, reference_of(variant, policy),
                                                everything, loss_type))
    bound = norms[len(norms) // 2]         # clipping bites on about half the pairs

    trainer = make_dpo(tmp_path, variant, model, max_grad_norm=bound)
    assert trainer.privacy_unit == "pair"
    users = trainer.model._orig_mod.module
    trainable = [n for n, p in users.named_parameters() if p.requires_grad]
    if variant.startswith("ipo-lora"):
        assert trainable and all("lora_" in n for n in trainable)
    checkpointed = [m for m in users.modules() if getattr(m, "gradient_checkpointing", False)]
    assert bool(checkpointed) == variant.endswith("checkpointed")
    params = [p for p in users.parameters() if p.requires_grad]
    policy = plain_copy(users)
    reference = reference_of(variant, policy)
    steps = Recording(params)
    trainer.add_callback(steps)
    trainer.train()

    sizes = [b["input_ids"].shape[0] for b in trainer.batches]
    assert sorted(sizes) == [0, 1, 3], sizes
    assert all(b["input_ids"].shape[1] == 2 for b in trainer.batches)     # (pairs, 2, T)
    denom = trainer._compile_settings["expected_batch_size"]
    after = steps.before[1:] + [[p.detach().clone() for p in params]]
    clipped = 0
    for batch, before, end in zip(trainer.batches, steps.before, after):
        with torch.no_grad():
            for r, b in zip((p for p in policy.parameters() if p.requires_grad), before):
                r.copy_(b)
        if batch["input_ids"].shape[0] == 0:
            assert all(torch.equal(b, e) for b, e in zip(before, end))
            continue
        grads = pair_grads(policy, reference, batch, loss_type)
        clipped += sum(_norm(g) > bound for g in grads)
        want = [sum(g[j] * min(1.0, bound / (_norm(g) + CLIP_EPS)) for g in grads) / denom
                for j in range(len(params))]
        for b, e, w in zip(before, end, want):
            torch.testing.assert_close(b - e, w, rtol=1e-4, atol=1e-6)
    assert clipped > 0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_canary_pair_moves_the_release_by_at_most_C(tmp_path, checkpointing):
    """One step at sigma 0 through Inductor on pairs D and on D with a canary pair added (its
    chosen and rejected completions far from anything the model predicts): the clipped sums
    differ by the canary pair's clipped gradient, of norm C, chosen and rejected together, and
    the gradient the optimizer releases by C over the expected number of pairs; with and
    without activation checkpointing."""
    from dpfx.loss.track import track_batch

    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    bound = 0.01
    trainer = dpfx_trl.DPDPOTrainer(
        model=gpt2(), args=dpo_args(tmp_path, per_device_train_batch_size=2, learning_rate=0.0,
                                    gradient_checkpointing=checkpointing),
        train_dataset=pairs(), processing_class=tokenizer(), max_grad_norm=bound,
        noise_multiplier=0.0, peft_config=peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
            lora_dropout=0.0))
    canary = trainer._prepare_dataset(datasets.Dataset.from_list([
        {"prompt": "the secret is", "chosen": " zqxj zqxj zqxj", "rejected": " no"}]),
        trainer.processing_class, trainer.args, "canary")[0]
    rows = list(trainer.train_dataset)[:2]
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1      # set by train(); one step here
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    sums, released = [], []
    for batch in (rows, rows + [canary]):
        trainer.model.reset_clipped_sums()
        trainer.training_step(trainer.model, track_batch(trainer.data_collator(batch)))
        sums.append({k: v.clone() for k, v in trainer.model.clipped_sums.items()})
        trainer.optimizer.step()        # the release (learning rate 0: the model stays)
        released.append([p.grad.clone() for p in params])
        trainer.optimizer.zero_grad()
    assert trainer.model.releases == 3 and sums[0]      # backwards: 2, then 2 + 1
    moved = float(torch.sqrt(sum((sums[1][k] - sums[0][k]).pow(2).sum() for k in sums[0])))
    assert bound * 0.99 < moved <= bound * (1 + 1e-4)
    per_pair = bound / trainer._compile_settings["expected_batch_size"]
    update = float(torch.sqrt(sum((b - a).pow(2).sum() for a, b in zip(*released))))
    assert per_pair * 0.99 < update <= per_pair * (1 + 1e-4)


def test_dp_dpo_epsilon_is_per_pair(tmp_path):
    """Epsilon is dp_accounting's for the Poisson-sampled Gaussian at the pair-level q (pairs
    per step / pairs) over the steps taken, and the checkpoint's record names the pair as the
    unit. Eager backend: it checks counts."""
    dp_accounting = pytest.importorskip("dp_accounting")
    torch.manual_seed(0)
    trainer = dpfx_trl.DPDPOTrainer(
        model=gpt2(), args=dpo_args(tmp_path, per_device_train_batch_size=2, max_steps=3,
                                    learning_rate=1e-3, save_strategy="steps", save_steps=3,
                                    precompute_ref_log_probs=True),
        train_dataset=pairs(), processing_class=tokenizer(), noise_multiplier=1.3,
        target_delta=1e-5, dp_kwargs={"backend": "eager"})
    trainer.train()
    assert trainer.sample_rate == 2 / 16 and trainer.accountant.steps == 3
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        2 / 16, dp_accounting.GaussianDpEvent(1.3)), 3))
    want = accountant.get_epsilon(1e-5)
    assert trainer.get_epsilon() == pytest.approx(want, rel=1e-3)
    with open(tmp_path / "checkpoint-3" / dpfx.hf.ACCOUNTANT_FILE) as f:
        record = json.load(f)
    assert record["privacy_unit"] == "pair" and record["steps"] == 3
    assert record["epsilon"] == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("option, match", [
    (dict(loss_type="aot"), "sorts the batch"),
    (dict(loss_type="aot_unpaired"), "sorts the batch"),
    (dict(use_weighting=True), "use_weighting"),
    (dict(f_divergence_type="js_divergence"), "f_divergence_type"),
    (dict(loss_type="discopop"), "not supported"),
    ({"user_column": "prompt", "max_examples_per_user": 2}, "the preference pair is the unit"),
])
def test_dp_dpo_refuses_what_it_cannot_train_privately(tmp_path, option, match):
    """Losses that read across the batch's pairs, and what DP DPO does not compute, are refused
    before the model is touched."""
    model = gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dp = {k: option.pop(k) for k in ("user_column", "max_examples_per_user") if k in option}
    with pytest.raises(ValueError, match=match):
        dpfx_trl.DPDPOTrainer(model=model, args=dpo_args(tmp_path, **option),
                              train_dataset=pairs(), processing_class=tokenizer(),
                              noise_multiplier=1.0, **dp)
    assert "forward" not in vars(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_trls_stacked_layout_under_dpfx_is_refused():
    """Why the pair is laid out as one row: run on TRL's own layout, (2B, T) rows with pair i
    in rows i and B + i, the DPO loss reads two of dpfx's examples per term, and dpfx's loss
    check refuses it rather than clip each sequence alone."""
    from dpfx.trl.dpo import sequence_logps

    torch.manual_seed(0)
    model = gpt2()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    ids = torch.randint(5, 30, (4, 10))          # 2 pairs: chosen rows 0-1, rejected rows 2-3
    completion = torch.zeros_like(ids)
    completion[:, 5:] = 1
    logps = sequence_logps(dp(input_ids=ids).logits, ids, completion)
    chosen, rejected = logps.chunk(2, dim=0)
    loss = -F.logsigmoid(BETA * (chosen - rejected)).mean()
    with pytest.raises(dpfx.PrivacyError, match="Nothing was released"):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())
