"""DPTrainer's clip functions (dpfx/hf/trainer.py, ``clipping=``): automatic and adaptive clipping
through Trainer's step, adaptive clipping's bound across a checkpoint, and what is refused
before the model is touched.

At sigma 0 one optimizer step (two physical batches of a logical batch) is compared with a
batch-of-one loop: each example's gradient of its own token sum (the causal LM loss's
per-example term), scaled by the clip function, summed, divided by the expected batch size; the
adaptive bound after the step is Andrew et al.'s update of that loop's own count. The eager
backend: Inductor runs the same clip functions in tests/passes/test_clipping.py and
tests/passes/test_adaptive_clipping.py."""
import contextlib
import copy
import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import dpfx
from dpfx.config import DPConfig
from support.reference import CLIP_EPS

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
hf = pytest.importorskip("dpfx.hf")

VOCAB, T, D = 37, 8, 4       # D: the expected logical batch, 2 x 2 accumulation steps
ETA, GAMMA = 0.5, 0.5


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def lm_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids.clone()}
            for ids in torch.randint(1, VOCAB, (n, T), generator=g)]


def args(out, **kw):
    return transformers.TrainingArguments(**{
        **dict(output_dir=str(out), report_to=[], use_cpu=True, save_strategy="no",
               logging_steps=1, disable_tqdm=True, seed=0, per_device_train_batch_size=2,
               gradient_accumulation_steps=2, optim="sgd", learning_rate=1.0,
               lr_scheduler_type="constant", weight_decay=0.0, warmup_steps=0), **kw})


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


def token_sum_grads(model, batch):
    """Each example's gradient of its own shifted token sum, one example at a time."""
    params = list(model.parameters())
    out = []
    for i in range(batch["input_ids"].shape[0]):
        ids, labels = batch["input_ids"][i:i + 1], batch["labels"][i:i + 1]
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                               reduction="sum")
        g = torch.autograd.grad(loss, params, allow_unused=True)
        out.append([torch.zeros_like(p) if x is None else x for x, p in zip(g, params)])
    return out


def norm(g):
    return float(torch.sqrt(sum(x.pow(2).sum() for x in g)))


def median_norm(model, data):
    return sorted(norm(g) for g in token_sum_grads(model, {
        k: torch.stack([row[k] for row in data]) for k in data[0]}))[len(data) // 2]


def one_step(tmp_path, clipping, bound, **options):
    """One sigma-0 step of DPTrainer: (the sampled batch, the update, the reference model,
    the trainer)."""
    torch.manual_seed(0)
    model = gpt2().train()
    reference = copy.deepcopy(model)
    trainer = _Recording(
        model=model, args=args(tmp_path, max_steps=1), train_dataset=lm_data(16, seed=1),
        max_grad_norm=bound, noise_multiplier=0.0, clipping=clipping,
        sampler_generator=torch.Generator().manual_seed(3), dp_kwargs={"backend": "eager"},
        **options)
    before = [p.detach().clone() for p in model.parameters()]
    with quiet():
        trainer.train()
    (batch,) = trainer.batches
    assert batch["input_ids"].shape[0] >= 3, "the batch should span two physical batches"
    update = [b - p.detach() for b, p in zip(before, model.parameters())]
    return batch, update, reference, trainer


def test_automatic_clipping_step_is_the_reference(tmp_path):
    """sigma 0: the update is sum_i g_i C / (||g_i|| + gamma) / D (Bu et al. 2022)."""
    bound, gamma = 0.5, 0.1
    batch, update, reference, trainer = one_step(tmp_path, "automatic", bound,
                                                 clipping_gamma=gamma)
    assert trainer.model.dp_config.clipping == "automatic"
    assert trainer.model.dp_config.clipping_gamma == gamma
    grads = token_sum_grads(reference, batch)
    want = [sum(g[j] * bound / (norm(g) + gamma) for g in grads) / D
            for j in range(len(update))]
    for got, w in zip(update, want):
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-6)


def test_adaptive_clipping_step_and_bound_are_the_reference(tmp_path):
    """sigma 0: the update is the flat clip at C_0 over D, and the bound then moves to
    C_0 exp(-eta (b - gamma)), b = sum_i (1[||g_i|| <= C_0] - 1/2) / D + 1/2, the count taken
    over both physical batches of the logical batch."""
    torch.manual_seed(0)
    c0 = 0.97 * median_norm(gpt2(), lm_data(16, seed=1))     # bites, and ties no norm
    batch, update, reference, trainer = one_step(tmp_path, "adaptive", c0,
                                                 target_unclipped_quantile=GAMMA, clip_lr=ETA)
    grads = token_sum_grads(reference, batch)
    norms = [norm(g) for g in grads]
    assert 0 < sum(n > c0 for n in norms) < len(norms)
    want = [sum(g[j] * min(1.0, c0 / (n + CLIP_EPS)) for g, n in zip(grads, norms)) / D
            for j in range(len(update))]
    for got, w in zip(update, want):
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-6)
    centered = sum((1.0 if n <= c0 else 0.0) - 0.5 for n in norms)
    clip = trainer.model.adaptive_clip
    assert clip.steps == 1
    assert clip.bound == pytest.approx(c0 * math.exp(-ETA * (centered / D + 0.5 - GAMMA)),
                                       rel=1e-6)


class _BoundAtEachStep(transformers.TrainerCallback):
    """C_t as each optimizer step begins (after a resumed run loaded its checkpoint)."""

    def __init__(self, trainer, stop_at=None):
        self.trainer, self.stop_at, self.bounds = trainer, stop_at, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.bounds.append(self.trainer.model.adaptive_clip.bound)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True
        return control


def test_adaptive_bound_is_saved_and_resumed(tmp_path):
    """With noise: a run stopped at its checkpoint after 1 step saved C_1 (optimizer.pt's
    DPOptimizer state, and dp_accountant.json); a fresh DPTrainer resumed from it starts its
    second step at C_1, not at C_0, and ends with 2 updates of the bound."""
    def run(resume=None, stop_at=None):
        torch.manual_seed(0)
        trainer = hf.DPTrainer(
            model=gpt2(), args=args(tmp_path, max_steps=2, save_strategy="steps",
                                    save_steps=1, per_device_train_batch_size=4,
                                    gradient_accumulation_steps=1),
            train_dataset=lm_data(16, seed=1), max_grad_norm=1.0, noise_multiplier=1.0,
            clipping="adaptive", count_noise_multiplier=2.0, clip_lr=ETA,
            dp_kwargs={"backend": "eager"})
        seen = _BoundAtEachStep(trainer, stop_at)
        trainer.add_callback(seen)
        with quiet():
            trainer.train(resume_from_checkpoint=resume)
        return trainer, seen.bounds

    stopped, bounds = run(stop_at=1)
    saved = stopped.model.adaptive_clip.bound
    assert stopped.model.adaptive_clip.steps == 1 and bounds == [1.0] and saved != 1.0
    folder = tmp_path / "checkpoint-1"
    with open(folder / hf.ACCOUNTANT_FILE) as f:
        assert json.load(f)["adaptive_clip"]["bound"] == saved
    state = torch.load(folder / "optimizer.pt", weights_only=False)
    assert state["adaptive_clip"]["bound"] == saved and state["adaptive_clip"]["steps"] == 1

    resumed, bounds = run(resume=str(folder))
    assert bounds == [saved]                    # the second step clips to the checkpoint's C_1
    assert resumed.model.adaptive_clip.steps == 2
    assert resumed.accountant.steps == 2


def test_refused_before_the_model_is_touched(tmp_path):
    """A count noise at or below sigma / 2 is refused as dpfx.compile refuses it, before
    DPTrainer turns on activation checkpointing (the first change it makes to the model);
    clipping options given in dp_kwargs are refused with where they go."""
    model = gpt2()
    with pytest.raises(dpfx.OptionError, match="must exceed noise_multiplier / 2"):
        hf.DPTrainer(model=model, args=args(tmp_path, activation_checkpointing=True),
                     train_dataset=lm_data(16, seed=1), noise_multiplier=1.0,
                     clipping="adaptive", count_noise_multiplier=0.4)
    assert not model.is_activation_checkpointing
    with pytest.raises(ValueError, match="pass clipping to DPTrainer itself"):
        hf.DPTrainer(model=model, args=args(tmp_path), train_dataset=lm_data(16, seed=1),
                     noise_multiplier=1.0, dp_kwargs={"clipping": "automatic"})
    # several processes: the count goes with the clipped sums (tests/loop/test_adaptive_ranks.py);
    # blocks: tests/test_blocks.py
    DPConfig(1.0, 1.0, clip=dpfx.Clipping("adaptive", count_noise_multiplier=2.0))
    DPConfig(1.0, 1.0, clip=dpfx.Clipping("automatic"))       # accepted
