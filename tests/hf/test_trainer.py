"""DP fine-tuning through Hugging Face's Trainer (dpfx/hf/), and a plain Trainer over a dpfx model.

Models are built from tiny configs (random init, nothing downloaded) and trained through the
default Inductor backend with the self-check on, except the bookkeeping test of resuming (eager:
it checks counts, not gradients). The DP Trainer's optimizer step at sigma 0 is compared with a
batch-of-one loop: each example's gradient of its own token sum (the per-example term of the
causal LM loss), clipped with a bound that bites, summed, divided by the expected batch size.
"""
import contextlib
import copy
import json
import math
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from support.reference import CLIP_EPS

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
hf = pytest.importorskip("dpfx.hf")

VOCAB, T = 37, 8


def gpt2(**extra):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **extra))


def lm_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (T,), generator=g)
        labels = ids.clone()
        labels[-2:] = -100 if torch.rand((), generator=g) < 0.5 else labels[-2:]
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                logging_steps=1, disable_tqdm=True, seed=0)
    return transformers.TrainingArguments(**{**base, **kw})


@contextlib.contextmanager
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpfx.LossScaleWarning)
        yield


# -- a plain Trainer over a dpfx-compiled model ---------------------------------------------------
def test_plain_trainer_trains_a_dpfx_model(tmp_path):
    """Default TrainingArguments (its clip_grad_norm_ included): the dataset's columns reach
    the model (the wrapped model's signature), num_items_in_batch is accepted, each optimizer
    step is one release, and dpfx says once that nothing is accounted."""
    torch.manual_seed(0)
    model = gpt2()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = transformers.Trainer(model=dp, args=args(tmp_path, per_device_train_batch_size=4,
                                                       max_steps=3),
                                   train_dataset=lm_data(12))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert trainer.state.global_step == 3
    assert dp.releases == 3
    told = [w for w in caught if issubclass(w.category, hf.UnaccountedTrainingWarning)]
    assert len(told) == 1 and "nothing counts epsilon" in str(told[0].message)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


PLAIN_LOOP = """
import sys, torch, transformers, dpfx
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_layer=1, n_head=2, n_embd=16, vocab_size=37, n_positions=16))
dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.5, backend="eager")
ids = torch.randint(0, 37, (3, 8))
dp(input_ids=ids, labels=ids).loss.backward()
assert dp.releases == 1
print(sorted(m for m in ("dpfx.hf", "transformers.trainer", "peft") if m in sys.modules))
"""


def test_a_plain_loop_does_not_import_the_trainer():
    """The plain-Trainer warning looks for a Trainer among the callers only where
    transformers' trainer module was imported: a plain loop over an HF model does not import it
    (nor peft, which it imports) at its first backward."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", PLAIN_LOOP], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_torch_compile_over_a_dpfx_module_is_a_no_op():
    """torch.compile(dp_model) (what TrainingArguments(torch_compile=True) does) runs dpfx's
    module as it is: the same gradients, not a crash inside dynamo."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0)
    outer = torch.compile(dp)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    got = []
    for module in (dp, outer):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(module(x), y).backward()
        got.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*got):
        torch.testing.assert_close(a, b)
    assert dp.releases == 2


# -- the DP Trainer ----------------------------------------------------------------------------------
class _Recording(hf.DPTrainer):
    """Keeps each logical batch the trainer stepped on."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        from dpfx.loss.track import untrack
        self.batches = getattr(self, "batches", []) + [
            {k: v.clone() for k, v in untrack(inputs).items()}]
        return super().training_step(model, inputs, num_items_in_batch)


def _token_sum_grads(model, batch):
    """Each example's gradient of its own shifted token sum (the per-example term)."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(batch["input_ids"].shape[0]):
        ids, labels = batch["input_ids"][i:i + 1], batch["labels"][i:i + 1]
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum")
        g = torch.autograd.grad(loss, params, allow_unused=True)
        out.append([torch.zeros_like(p) if x is None else x for x, p in zip(g, params)])
    return out


def _norm(g):
    return float(torch.sqrt(sum(x.pow(2).sum() for x in g)))


SLOW = pytest.mark.slow


@pytest.mark.parametrize("variant", ["full", "lora", pytest.param("ia3", marks=SLOW),
                                     pytest.param("checkpointing", marks=SLOW),
                                     pytest.param("bf16", marks=SLOW)])
def test_dp_trainer_step_is_the_clipped_reference(tmp_path, variant):
    """sigma 0, SGD at lr 1: the parameter change of one optimizer step is the DP-SGD gradient
    of the batch the trainer sampled, run as physical batches of 2 (gradient accumulation 2).
    Variants: LoRA and IA3 adapters on a frozen base, activation checkpointing, and bfloat16
    autocast (against the float32 reference, to bfloat16's precision)."""
    torch.manual_seed(0)
    model = gpt2()
    extra, tol = {}, dict(rtol=1e-4, atol=1e-6)
    if variant in ("lora", "ia3"):
        peft = pytest.importorskip("peft")
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                 fan_in_fan_out=True, lora_dropout=0.0) if variant == "lora" \
            else peft.IA3Config(target_modules=["c_attn", "mlp.c_proj"],
                                feedforward_modules=["mlp.c_proj"], fan_in_fan_out=True)
        model = peft.get_peft_model(model, config)
    if variant == "checkpointing":
        extra = {"gradient_checkpointing": True}
    if variant == "bf16":
        extra = {"bf16": True}
    model.train()
    data = lm_data(16, seed=1)
    norms = sorted(_norm(g) for g in _token_sum_grads(model, {
        k: torch.stack([row[k] for row in data]) for k in data[0]}))
    bound = norms[len(norms) // 2]                  # clipping bites on about half
    reference = copy.deepcopy(model)
    trainer = _Recording(
        model=model, args=args(tmp_path, per_device_train_batch_size=2,
                               gradient_accumulation_steps=2, max_steps=1, optim="sgd",
                               learning_rate=1.0, lr_scheduler_type="constant",
                               weight_decay=0.0, warmup_steps=0, **extra),
        train_dataset=data, max_grad_norm=bound, noise_multiplier=0.0,
        sampler_generator=torch.Generator().manual_seed(3))
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    with quiet():
        trainer.train()
    (batch,) = trainer.batches
    n = batch["input_ids"].shape[0]
    assert n >= 3, "the seeded sampler should give a batch spanning two physical batches"
    grads = _token_sum_grads(reference, batch)
    clipped = sum(min(1.0, bound / (_norm(g) + CLIP_EPS)) < 1.0 for g in grads)
    assert 0 < clipped < n
    want = [sum(g[j] * min(1.0, bound / (_norm(g) + CLIP_EPS)) for g in grads) / 4
            for j in range(len(params))]            # expected batch size q N = 4
    for p, b, w in zip(params, before, want):
        if variant == "bf16":       # bfloat16 rounds each entry: compare each tensor's error
            assert float((b - p.detach() - w).norm() / w.norm()) < 3e-2
        else:
            torch.testing.assert_close(b - p.detach(), w, **tol)
    if variant in ("lora", "ia3"):
        frozen = [p for n_, p in model.named_parameters() if f"{variant}_" not in n_]
        assert frozen and all(not p.requires_grad for p in frozen)


def test_dp_trainer_epsilon_and_resume(tmp_path):
    """Epsilon is the accountant's for the steps taken (logged at every logging step, equal to
    dpfx.privacy.epsilon); a run stopped after a checkpoint and resumed from it ends with the
    uninterrupted run's epsilon and step count, and each checkpoint holds the ledger."""
    def run(out, stop_at=None, resume=None):
        torch.manual_seed(0)
        trainer = hf.DPTrainer(
            model=gpt2(), args=args(out, per_device_train_batch_size=2, max_steps=6,
                                    save_strategy="steps", save_steps=3),
            train_dataset=lm_data(20), eval_dataset=lm_data(6, seed=9), target_epsilon=4.0,
            target_delta=1e-5, dp_kwargs={"backend": "eager"})
        if stop_at is not None:
            trainer.add_callback(_StopAt(stop_at))
        with quiet():
            trainer.train(resume_from_checkpoint=resume)
        return trainer

    # The uninterrupted run's epsilon is the accountant's for its 6 steps at the calibrated
    # sigma: the resumed run must end there, having logged it at every step.
    stopped = run(tmp_path / "cut", stop_at=3)
    assert stopped.accountant.steps == 3
    with open(tmp_path / "cut" / "checkpoint-3" / hf.ACCOUNTANT_FILE) as f:
        assert json.load(f)["steps"] == 3
    resumed = run(tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoint-3"))
    assert resumed.accountant.steps == 6
    want = dpfx.privacy.epsilon(noise_multiplier=resumed.noise_multiplier,
                                sample_rate=resumed.sample_rate, steps=6, delta=1e-5)
    assert resumed.noise_multiplier == stopped.noise_multiplier
    assert resumed.get_epsilon() == pytest.approx(want)
    assert resumed.get_epsilon() == pytest.approx(4.0, rel=0.02)   # calibrated for 6 steps
    logged = [e for e in resumed.state.log_history if "loss" in e]
    assert len(logged) == 6 and all("epsilon" in e for e in logged)
    assert logged[-1]["epsilon"] == pytest.approx(want)
    # evaluation is Trainer's own: the model's labels= loss, no release, nothing accounted
    releases = resumed.model.releases
    assert math.isfinite(resumed.evaluate()["eval_loss"])
    assert resumed.accountant.steps == 6 and resumed.model.releases == releases

    # stopped two steps after its last checkpoint: those two releases happened, and the
    # privacy ledger makes the resumed run count them on top of the six it then takes, with
    # the noise of the last three raised so that all eight stay within the target
    # (Note [A resumed run keeps its budget] in dpfx/hf/resume.py)
    run(tmp_path / "late", stop_at=5)
    again = run(tmp_path / "late", resume=str(tmp_path / "late" / "checkpoint-3"))
    assert again.accountant.steps == 8
    assert again.noise_multiplier > stopped.noise_multiplier
    assert [phase[2] for phase in again.accountant.history] == [5, 3]
    assert again.get_epsilon() <= 4.0


def test_dp_trainer_reports_epsilon_at_the_end_of_a_short_run(tmp_path):
    """With Trainer's default logging_steps (500) a 2-step run logs no loss, and the metrics
    ``train()`` returns and logs at its end still hold epsilon: the accountant's for the steps
    taken. Eager backend: it checks what is logged, not gradients."""
    torch.manual_seed(0)
    defaults = transformers.TrainingArguments(output_dir=str(tmp_path))
    trainer = hf.DPTrainer(
        model=gpt2(), args=args(tmp_path, per_device_train_batch_size=2, max_steps=2,
                                logging_steps=defaults.logging_steps),
        train_dataset=lm_data(20), noise_multiplier=1.0, target_delta=1e-5,
        dp_kwargs={"backend": "eager"})
    with quiet():
        metrics = trainer.train().metrics
    want = dpfx.privacy.epsilon(noise_multiplier=1.0, sample_rate=trainer.sample_rate, steps=2,
                                delta=1e-5)
    assert trainer.accountant.steps == 2 and want > 0
    assert not [e for e in trainer.state.log_history if "loss" in e]
    assert metrics["epsilon"] == pytest.approx(want) and "train_loss" in metrics
    assert trainer.state.log_history[-1]["epsilon"] == pytest.approx(want)


class _StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def test_dp_trainer_refuses_what_it_cannot_account(tmp_path):
    model = gpt2()
    with pytest.raises(ValueError, match="exactly one of noise_multiplier or target_epsilon"):
        hf.DPTrainer(model=model, args=args(tmp_path), train_dataset=lm_data(8))
    with pytest.raises(ValueError, match="exceeds the 8 training examples"):
        hf.DPTrainer(model=model, args=args(tmp_path, per_device_train_batch_size=4,
                                            gradient_accumulation_steps=4),
                     train_dataset=lm_data(8), noise_multiplier=1.0)
    with pytest.raises(ValueError, match="not the dpfx.compile'd module"):
        hf.DPTrainer(model=dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0),
                     args=args(tmp_path), train_dataset=lm_data(8), noise_multiplier=1.0)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("head", ["seq2seq", "sequence-classification", "lora-seq2seq",
                                  "question-answering"])
def test_dp_trainer_heads(tmp_path, head):
    """Other heads' labels= losses (question answering's start and end positions) train through
    the DP Trainer, through Inductor; epsilon is the accountant's."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if head.endswith("seq2seq"):
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
        data = [{"input_ids": torch.randint(1, VOCAB, (T,), generator=g),
                 "labels": torch.randint(1, VOCAB, (4,), generator=g)} for _ in range(12)]
        if head.startswith("lora"):
            peft = pytest.importorskip("peft")
            model = peft.get_peft_model(model, peft.LoraConfig(
                r=2, target_modules=["q", "v"], lora_dropout=0.0, task_type="SEQ_2_SEQ_LM"))
    elif head == "question-answering":     # SQuAD-style fine-tuning
        model = transformers.BertForQuestionAnswering(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        data = [{"input_ids": torch.randint(1, VOCAB, (T,), generator=g),
                 "start_positions": torch.randint(0, T, (), generator=g),
                 "end_positions": torch.randint(0, T, (), generator=g)} for _ in range(12)]
    else:
        model = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
            n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=16, num_labels=3,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0))
        data = [{"input_ids": torch.randint(1, VOCAB, (T,), generator=g),
                 "labels": torch.randint(0, 3, (), generator=g)} for _ in range(12)]
    trainable = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    trainer = hf.DPTrainer(model=model, args=args(tmp_path, per_device_train_batch_size=2,
                                                  max_steps=2),
                           train_dataset=data, noise_multiplier=1.0, max_grad_norm=1.0)
    with quiet():
        trainer.train()
    assert trainer.accountant.steps == 2
    assert trainer.get_epsilon() == pytest.approx(dpfx.privacy.epsilon(
        noise_multiplier=1.0, sample_rate=trainer.sample_rate, steps=2,
        delta=trainer.delta))
    assert any(not torch.equal(b, p) for b, p in zip(before, trainable))


# -- the loss idioms Trainer brings --------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0,
                               backend="eager")


def test_trainer_loss_idioms():
    """``loss *= k`` on the loss (Trainer's device scale) is a scale of the whole loss;
    ``tr_loss += loss.detach()`` accumulates a detached value for logging."""
    model, dp = _mlp()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    F.cross_entropy(dp(x), y).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    tr_loss = torch.zeros(())
    loss = F.cross_entropy(dp(x), y)
    loss *= 1
    loss.backward()
    tr_loss += loss.detach()
    assert float(tr_loss) == pytest.approx(float(F.cross_entropy(model(x), y)), rel=1e-5)
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w)


def test_trainer_loss_idioms_that_would_leak_are_refused():
    model, dp = _mlp()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    buf = torch.zeros(())
    out = dp(x)
    buf += out.detach().abs().mean()        # a statistic of the whole batch, kept in a buffer
    loss = (F.cross_entropy(out, y, reduction="none") * buf).mean()
    with pytest.raises(dpfx.PrivacyError, match="written in place"):
        loss.backward()
    for before in (lambda loss: loss * 3, lambda loss: loss.view(1)):
        loss = F.cross_entropy(dp(x), y)
        earlier = before(loss)
        with pytest.raises(dpfx.PrivacyError, match="an earlier op already read"):
            loss *= 1 / len(y)
    assert all(p.grad is None for p in model.parameters())


def test_hf_causal_loss_on_the_loaders_labels():
    """transformers' ForCausalLMLoss pads the labels (F.pad) before shifting them; on labels
    dpfx's loader follows, the check replays the pad with the batch kept symbolic: the same
    gradient as on plain labels."""
    from transformers.loss.loss_utils import ForCausalLMLoss
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=0.0)
    ids = torch.randint(1, VOCAB, (4, T))
    labels = ids.clone()
    labels[:2, -3:] = -100
    got = []
    for batch in ({"ids": ids, "labels": labels}, dpfx.track_batch({"ids": ids,
                                                                   "labels": labels})):
        model.zero_grad(set_to_none=True)
        with quiet():
            ForCausalLMLoss(dp(batch["ids"]), batch["labels"], VOCAB).backward()
        got.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*got):
        torch.testing.assert_close(a, b)
