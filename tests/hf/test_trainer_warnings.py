"""No warning of dpfx's on DPTrainer's own default paths, and a loss-scale warning that stays
names the line that causes it (dpfx/loss/arranged.py, Note [A scale dpfx arranged])."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from dpfx.loss import verdicts as loss_verdicts

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
hf = pytest.importorskip("dpfx.hf")

from test_trainer import args, gpt2, lm_data  # noqa: E402


def dpfx_warnings() -> list[type]:
    """Every warning category dpfx defines."""
    found, todo = [], [Warning]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.split(".")[0] == "dpfx":
            found.append(cls)
    assert dpfx.LossScaleWarning in found and dpfx.FixedSeedWarning in found
    return found


def forget_verdicts():
    """A loss structure warns once per process: start from none proven."""
    loss_verdicts.forget()


def test_causal_lm_lora_recipe_with_accumulation_runs_without_warnings(tmp_path):
    """The recipe of examples/dp_lora_trainer.py at toy size, through the default backend:
    a causal LM's token mean (labels with ignored positions) over physical batches of
    gradient accumulation, LoRA adapters on a frozen base."""
    forget_verdicts()
    torch.manual_seed(0)
    model = peft.get_peft_model(gpt2(), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0))
    trainer = hf.DPTrainer(
        model=model, args=args(tmp_path, per_device_train_batch_size=2,
                               gradient_accumulation_steps=3, max_steps=4),
        train_dataset=lm_data(24), target_epsilon=8.0, target_delta=1e-5,
        sampler_generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        for category in dpfx_warnings():
            warnings.simplefilter("error", category)
        trainer.train()
    assert trainer.accountant.steps == 4
    assert trainer.model.releases > 4       # logical batches ran as several physical ones


class _TokenModel(nn.Module):
    def __init__(self, vocab=11):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def test_a_token_mean_warns_at_its_own_line():
    """A token mean the user writes is still warned about, at the cross_entropy call that
    divides by the token count, not at the last line of the loss."""
    forget_verdicts()
    torch.manual_seed(0)
    dp = dpfx.compile(_TokenModel(), max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    ids = torch.randint(0, 11, (4, 5))
    labels = ids.clone()
    labels[:, -2:] = -100
    logits = dp(ids)
    loss = F.cross_entropy(logits.view(-1, 11), labels.view(-1), ignore_index=-100)  # the line
    accumulated = loss / 2
    with pytest.warns(dpfx.LossScaleWarning) as record:
        accumulated.backward()
    (message,) = [str(w.message) for w in record if w.category is dpfx.LossScaleWarning]
    assert "test_trainer_warnings.py" in message and "F.cross_entropy(" in message, message
    assert "accumulated" not in message


def test_a_labels_loss_outside_the_trainer_still_warns():
    """Outside DPTrainer the labels= token mean is the user's call: warned about, at the
    model's loss line."""
    forget_verdicts()
    torch.manual_seed(0)
    model = gpt2()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    batch = {k: torch.stack([row[k] for row in lm_data(4)]) for k in ("input_ids", "labels")}
    batch["labels"][:, -2:] = -100
    with pytest.warns(dpfx.LossScaleWarning, match="loss_utils.py"):
        dp(**batch).loss.backward()
