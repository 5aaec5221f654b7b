"""DP supervised fine-tuning through TRL's SFTTrainer (dpfx/trl/sft.py).

A character-level tokenizer with a chat template is built here (nothing downloaded) and a GPT-2
from a tiny config. The trainer's optimizer steps at sigma 0, through the default Inductor
backend, are compared with a batch-of-one reference: each example's loss is TRL's own
completion-only token loss of that example alone (its fused LM head, ``-log_probs.sum() /
tokens``), times its token count (the per-example term: the batch's token count is divided
out), differentiated, clipped with a bound that bites, summed and divided by the expected batch
size. Epsilon is checked against dp_accounting.
"""
import copy
import json
import os

import pytest
import torch

from support.reference import CLIP_EPS

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
dpfx_trl = pytest.importorskip("dpfx.trl")
import dpfx.hf  # noqa: E402

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

CHARS = "abcdefghijklmnopqrstuvwxyz ?.!"
SPECIALS = ["<pad>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
            "{{ m['content'] }}<|end|>{% endgeneration %}{% else %}<|user|>{{ m['content'] }}"
            "<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = ["cat", "dog", "sun", "tree", "sky", "car", "boat", "fish", "moon", "rain", "bird",
         "road", "hill", "lake", "star", "leaf"]


def tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    out = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<|end|>",
        additional_special_tokens=SPECIALS[2:])
    out.chat_template = TEMPLATE
    return out


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=len(SPECIALS) + len(CHARS), n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=4,
        eos_token_id=4))


def chats(n=16):
    """Conversations (trained with assistant_only_loss) of different lengths."""
    return datasets.Dataset.from_list([{"messages": [
        {"role": "user", "content": f"what is {w}"},
        {"role": "assistant", "content": f"{w} is {'a ' * (i % 3)}word."}]}
        for i, w in enumerate(WORDS[:n])])


def prompt_completions(n=16):
    """Prompt-completion text (completion-only loss, TRL's default for this format)."""
    return datasets.Dataset.from_list([{"prompt": f"say {w}:", "completion": f" {w} {w[::-1]}"}
                                       for w in WORDS[:n]])


def sft_args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                logging_steps=1, disable_tqdm=True, seed=0, gradient_checkpointing=False,
                bf16=False, max_length=64, optim="sgd", learning_rate=1.0,
                lr_scheduler_type="constant", weight_decay=0.0, warmup_steps=0)
    return trl.SFTConfig(**{**base, **kw})


class Recording(transformers.TrainerCallback):
    """Each step's parameters before it; the trainer's logical batches (below)."""

    def __init__(self, params):
        self.params, self.before = params, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.before.append([p.detach().clone() for p in self.params])


class RecordingSFT(dpfx_trl.DPSFTTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        from dpfx.loss.track import untrack
        self.batches = getattr(self, "batches", []) + [
            {k: v.clone() for k, v in untrack(inputs).items()}]
        return super().training_step(model, inputs, num_items_in_batch)


def trl_token_sum_grads(reference, batch):
    """Each example's gradient of TRL's completion-only loss of that example alone, times its
    token count: TRL's fused LM head on a batch of one."""
    from trl.trainer.utils import add_fused_lm_head

    base = reference.get_base_model() if hasattr(reference, "get_base_model") else reference
    if "forward" not in vars(base):
        add_fused_lm_head(base)
    params = [p for p in reference.parameters() if p.requires_grad]
    out = []
    for i in range(batch["input_ids"].shape[0]):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        keep = one["attention_mask"][0].bool()
        one = {k: v[:, keep] for k, v in one.items()}          # the example without padding
        res = reference(**one, fused_lm_head=True)
        tokens = int(res.label_mask.sum())
        g = torch.autograd.grad(res.loss * tokens, params, allow_unused=True)
        out.append([torch.zeros_like(p) if x is None else x for x, p in zip(g, params)])
    return out


def _norm(g):
    return float(torch.sqrt(sum(x.pow(2).sum() for x in g)))


def _clipped_mean(grads, bound, denom):
    return [sum(g[j] * min(1.0, bound / (_norm(g) + CLIP_EPS)) for g in grads) / denom
            for j in range(len(grads[0]))]


def padded(rows):
    """Prepared examples as one right-padded batch, as TRL's collator pads them."""
    width = max(len(r["input_ids"]) for r in rows)
    batch = {"input_ids": torch.zeros(len(rows), width, dtype=torch.long),
             "labels": torch.full((len(rows), width), -100),
             "attention_mask": torch.zeros(len(rows), width, dtype=torch.long)}
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["input_ids"][i, :n] = torch.tensor(r["input_ids"])
        batch["labels"][i, :n] = torch.tensor(r["labels"])
        batch["attention_mask"][i, :n] = 1
    return batch


def make_sft(tmp_path, variant, model, **dp):
    extra, config = {}, {}
    if variant == "chat":
        data, config = chats(), dict(assistant_only_loss=True)
    else:
        peft = pytest.importorskip("peft")
        data = prompt_completions()
        extra["peft_config"] = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                               fan_in_fan_out=True, lora_dropout=0.0)
    return RecordingSFT(
        model=model, args=sft_args(tmp_path, per_device_train_batch_size=2, max_steps=3,
                                   **config),
        train_dataset=data, processing_class=tokenizer(), noise_multiplier=0.0,
        sampler_generator=torch.Generator().manual_seed(4), **extra, **dp)


@pytest.mark.parametrize("variant", ["chat", "lora-completion"])
def test_dp_sft_steps_are_the_clipped_reference(tmp_path, variant):
    """sigma 0, SGD at lr 1: every optimizer step's parameter change is the DP-SGD gradient of
    the batch the trainer sampled, over logical batches of 0, 1 and more examples (physical
    batches of at most 2, q = 2/16). "chat": a conversational set with assistant_only_loss,
    full fine-tuning; "lora-completion": prompt-completion text, completion-only loss, LoRA
    through SFTTrainer's peft_config."""
    torch.manual_seed(0)
    model = gpt2()
    # a bound that bites on about half the examples at the start
    probe = make_sft(tmp_path, variant, copy.deepcopy(model), max_grad_norm=1.0)
    rows = list(probe.train_dataset)
    assert all(-100 in r["labels"] and any(x != -100 for x in r["labels"]) for r in rows)
    norms = sorted(_norm(g) for g in trl_token_sum_grads(
        copy.deepcopy(probe.model._orig_mod), padded(rows)))
    bound = norms[len(norms) // 2]

    trainer = make_sft(tmp_path, variant, model, max_grad_norm=bound)
    users = trainer.model._orig_mod
    assert isinstance(trainer.model, dpfx.DPModule)
    trainable = [n for n, p in users.named_parameters() if p.requires_grad]
    if variant != "chat":
        assert trainable and all("lora_" in n for n in trainable)
    params = [p for p in users.parameters() if p.requires_grad]
    reference = copy.deepcopy(users)
    steps = Recording(params)
    trainer.add_callback(steps)
    trainer.train()

    sizes = [b["input_ids"].shape[0] for b in trainer.batches]
    assert sorted(sizes) == [0, 1, 3], sizes    # 3: physical batches of 2 and 1
    denom = trainer._compile_settings["expected_batch_size"]
    after = steps.before[1:] + [[p.detach().clone() for p in params]]
    clipped = 0
    for batch, before, end in zip(trainer.batches, steps.before, after):
        with torch.no_grad():
            for r, b in zip((p for p in reference.parameters() if p.requires_grad), before):
                r.copy_(b)
        if batch["input_ids"].shape[0] == 0:
            for b, e in zip(before, end):
                torch.testing.assert_close(b, e, rtol=0, atol=0)
            continue
        grads = trl_token_sum_grads(reference, batch)
        clipped += sum(_norm(g) > bound for g in grads)
        want = _clipped_mean(grads, bound, denom)
        for b, e, w in zip(before, end, want):
            torch.testing.assert_close(b - e, w, rtol=1e-4, atol=1e-6)
    assert clipped > 0
    assert trainer.model.releases >= len(sizes) - sizes.count(0)


def test_a_canary_example_moves_the_release_by_at_most_C(tmp_path):
    """One step at sigma 0 through Inductor on a batch D and on D with a canary conversation
    added: the clipped sums (the release times the expected batch size) differ by the canary's
    clipped gradient, of norm C, however large its own gradient."""
    from dpfx.loss.track import track_batch

    torch.manual_seed(0)
    bound = 0.05
    trainer = dpfx_trl.DPSFTTrainer(
        model=gpt2(), args=sft_args(tmp_path, per_device_train_batch_size=2,
                                    assistant_only_loss=True, learning_rate=0.0),
        train_dataset=chats(), processing_class=tokenizer(), max_grad_norm=bound,
        noise_multiplier=0.0)
    canary = trainer._prepare_dataset(datasets.Dataset.from_list([{"messages": [
        {"role": "user", "content": "the secret is"},
        {"role": "assistant", "content": "zqxj zqxj zqxj zqxj zqxj"}]}]),
        trainer.processing_class, trainer.args, False, None, "canary")[0]
    rows = list(trainer.train_dataset)[:2]
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1      # set by train(); one step here
    sums = []
    for batch in (rows, rows + [canary]):
        trainer.model.reset_clipped_sums()
        trainer.training_step(trainer.model, track_batch(trainer.data_collator(batch)))
        sums.append({k: v.clone() for k, v in trainer.model.clipped_sums.items()})
        trainer.optimizer.step()        # the release (learning rate 0: the model stays)
        trainer.optimizer.zero_grad()
    assert trainer.model.releases == 3 and sums[0]      # backwards: 2, then 2 + 1
    moved = float(torch.sqrt(sum((sums[1][k] - sums[0][k]).pow(2).sum() for k in sums[0])))
    assert bound * 0.99 < moved <= bound * (1 + 1e-4)


def test_dp_sft_epsilon_and_resume(tmp_path):
    """target_epsilon over the planned steps: the epsilon logged after a run stopped at its
    checkpoint and resumed is dp_accounting's for the trainer's q, sigma and every step taken;
    each checkpoint has the accountant and TRL's model card. Eager backend: it checks counts."""
    dp_accounting = pytest.importorskip("dp_accounting")

    def run(stop_at=None, resume=None):
        torch.manual_seed(0)
        trainer = dpfx_trl.DPSFTTrainer(
            model=gpt2(), args=sft_args(tmp_path, per_device_train_batch_size=2, max_steps=4,
                                        save_strategy="steps", save_steps=2,
                                        learning_rate=1e-3),
            train_dataset=prompt_completions(), processing_class=tokenizer(),
            target_epsilon=3.0, target_delta=1e-5, dp_kwargs={"backend": "eager"})
        if stop_at is not None:
            trainer.add_callback(StopAt(stop_at))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    stopped = run(stop_at=2)
    checkpoint = tmp_path / "checkpoint-2"
    with open(checkpoint / dpfx.hf.ACCOUNTANT_FILE) as f:
        assert json.load(f)["steps"] == 2
    assert (tmp_path / "README.md").is_file()          # TRL's model card, of the user's model
    resumed = run(resume=str(checkpoint))
    assert resumed.accountant.steps == 4
    assert resumed.noise_multiplier == stopped.noise_multiplier
    q, sigma = resumed.sample_rate, resumed.noise_multiplier
    assert q == 2 / 16
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(sigma)), 4))
    want = accountant.get_epsilon(1e-5)
    assert resumed.get_epsilon() == pytest.approx(want, rel=1e-3)
    assert want == pytest.approx(3.0, rel=0.02)
    logged = [e for e in resumed.state.log_history if "loss" in e]
    assert logged[-1]["epsilon"] == pytest.approx(want, rel=1e-3)


class StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


@pytest.mark.parametrize("option, match", [
    (dict(packing=True), "packing=False"),
    (dict(padding_free=True), "padding_free=False"),
    (dict(loss_type="dft"), "loss_type='dft'"),
    (dict(max_length=None), "set max_length"),
])
def test_dp_sft_refuses_what_it_cannot_train_privately(tmp_path, option, match):
    """Packing (several examples in one row) and the losses that are not a per-example token
    sum are refused before the model is touched."""
    model = gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        dpfx_trl.DPSFTTrainer(model=model, args=sft_args(tmp_path, **option),
                              train_dataset=prompt_completions(),
                              processing_class=tokenizer(), noise_multiplier=1.0)
    assert "forward" not in vars(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())


def test_trls_default_config_trains_with_lora(tmp_path):
    """SFTConfig's defaults (activation checkpointing, bfloat16 autocast) with LoRA: the hook
    TRL adds for PEFT under checkpointing (requires_grad_ on the embeddings' output, which
    dynamo cannot capture) is taken off, and the adapters train. Eager backend: the capture is
    dynamo's either way."""
    peft = pytest.importorskip("peft")
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1,
                         report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                         max_length=64, learning_rate=1e-2)
    assert args.gradient_checkpointing and args.bf16
    trainer = dpfx_trl.DPSFTTrainer(
        model=gpt2(), args=args, train_dataset=prompt_completions(),
        processing_class=tokenizer(), noise_multiplier=1.0, dp_kwargs={"backend": "eager"},
        peft_config=peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                    lora_dropout=0.0))
    adapters = [p for p in trainer.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in adapters]
    trainer.train()
    assert trainer.accountant.steps == 1
    assert any(not torch.equal(b, p) for b, p in zip(before, adapters))
