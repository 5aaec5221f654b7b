"""Snippets of docs/ run as written: user-level batches from ``group_by_user`` (users.md), the
plots of a run (inspection.md) and DPTrainer's first example (trainer.md), on small models and
data. The trainer's runs through Inductor (the default); the plots' through the eager backend,
since they read what the run recorded."""
import os
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx

DOCS = os.path.join(os.path.dirname(__file__), os.pardir, "docs")


def block(page: str, containing: str) -> str:
    """The one ```python block of docs/``page`` that contains ``containing``."""
    path = os.path.join(DOCS, page)
    found = [b for b in re.findall(r"```python\n(.*?)```", open(path).read(), flags=re.S)
             if containing in b]
    assert len(found) == 1, f"{page}: {len(found)} python blocks contain {containing!r}"
    return compile(found[0], path, "exec")


def test_users_group_by_user_builds_the_user_loader():
    torch.manual_seed(0)
    train_set = torch.utils.data.TensorDataset(torch.randn(600, 5), torch.randint(0, 3, (600,)))
    author_of_each_example = [f"u{i % 150}" for i in range(600)]      # 150 users of 4 examples
    scope = {"dpfx": dpfx, "train_set": train_set,
             "author_of_each_example": author_of_each_example}
    exec(block("users.md", "group_by_user("), scope)
    users, loader = scope["users"], scope["loader"]
    assert len(users) == 150 and users[1].tolist() == [1, 151, 301, 451]
    x, y, mask = scope["x"], scope["y"], scope["mask"]      # the loop's last batch
    assert x.shape[1:] == (8, 5) and y.shape[1:] == mask.shape[1:] == (8,)
    assert mask.sum(1).tolist() == [4.0] * x.shape[0]       # 4 real examples, 4 padding slots
    assert loader.batch_sampler.sample_rate == pytest.approx(64 / 150)


def test_inspection_plots_of_a_run(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    train_set = torch.utils.data.TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
    private = dpfx.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), train_set,
                                batch_size=16, max_grad_norm=0.1, noise_multiplier=1.0,
                                track_norms=True, backend="eager")
    monkeypatch.chdir(tmp_path)
    scope = {"dpfx": dpfx, "F": F, "private": private}
    exec(block("inspection.md", "RunHistory("), scope)
    steps = private.accountant.steps
    assert steps == private.steps_per_epoch == 4 and (tmp_path / "run.png").is_file()
    assert [list(xs) for xs, _ in scope["drawn"].values()] == [list(range(1, steps + 1))] * 2


def test_trainer_first_example(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    import dpfx.hf  # noqa: F401

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=23, n_positions=8, bos_token_id=0,
        eos_token_id=0))
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(1, 23, (256, 8))]

    def quiet_args(**kw):     # the page's TrainingArguments, offline and without a bar
        return transformers.TrainingArguments(**kw, use_cpu=True, report_to=[],
                                              disable_tqdm=True)

    monkeypatch.chdir(tmp_path)
    scope = {"model": model, "TrainingArguments": quiet_args, "train": rows, "test": rows[:8],
             "collator": transformers.default_data_collator}
    exec(block("trainer.md", "LoraConfig"), scope)
    trainer, metrics = scope["trainer"], scope["metrics"]
    # q = 32 * 8 / 256 = 1: one step an epoch, 3 epochs
    assert trainer.accountant.steps == 3
    assert metrics["epsilon"] == pytest.approx(trainer.get_epsilon()) and metrics["epsilon"] > 0
