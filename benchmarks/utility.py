"""Utility at a fixed budget: test accuracy of each clipping choice, and of user-level DP.

    python benchmarks/utility.py                         # writes benchmarks/latest/utility.md
    python benchmarks/utility.py --seeds 1 --out benchmarks/out/utility.md   # a quick look
    python benchmarks/utility.py --compare adam     # DP-Adam against DP-AdamBC: utility_adam.md
    python benchmarks/utility.py --compare mechanism   # correlated noise: utility_mechanism.md
    python benchmarks/utility.py --compare mechanism --tasks lm --backend eager   # ..._lm.md

Every run trains at epsilon 3, delta 1e-5: sigma is calibrated by ``dpfx.privacy.noise_multiplier``
(PLD) for the run's sample rate and steps, and the epsilon in the table is the accountant's after
the last step. Each row is the test accuracy over ``--seeds`` seeds (mean +- std, population std);
a seed fixes the train/test split, the initial model and the Poisson sampler (the noise comes
from the OS's CSPRNG, unseeded). The methods, all through ``dpfx.make_private``:

- **flat C, tuned**: flat clipping at each C of ``--grid``; the table shows the best C (by mean
  accuracy) and the grid's rows below. Tuning C on the test split spends privacy nobody counts
  here: the row is an upper bound for fixed C, as usual in the literature.
- **adaptive**: ``clipping="adaptive"``, C_0 = 1, target quantile 0.5, ``clip_lr`` 0.2,
  ``count_noise_multiplier`` = expected batch / 20 (Andrew et al. 2021's choice); same sigma
  (the count's noise comes out of the gradient's: sigma_grad > sigma).
- **automatic**: ``clipping="automatic"``, gamma 0.01, C = the best flat C.
- **example-level / user-level at the same users**: the examples are assigned to synthetic users
  of ``--k`` examples each (a seeded random partition); the user-level run samples users at the
  same q (expected batch / k users per step), takes up to k examples of each, clips each user's
  summed gradient to the best flat C and counts epsilon per user (``dpfx.per_user``,
  ``make_private(user_ids=, max_examples_per_user=)``, docs/users.md). Its guarantee is
  stronger: it bounds what the run reveals about all k examples of a user together, where the
  example-level row's epsilon is per example (a user's k examples could cost up to k times more
  under group privacy). The example-level row is the best flat C's.

``--compare adam`` trains the digits task at epsilon 2 and 8 (delta 1e-5, sigma calibrated as
above) with flat C = ``ADAM_C`` (the best flat C of the clipping table) and an Adam-family inner
optimizer instead of SGD: **DP-Adam** (``torch.optim.Adam``, eps 1e-8) and **DP-AdamBC**
(``dpfx.DPAdamBC``, gamma ``ADAMBC_GAMMA``, eps 0: Tang et al. 2024), both betas (0.9, 0.999), no
weight decay. DP-AdamBC's ``dp_noise_variance`` is set to (sigma C / D)^2 from
``DPAdamBC.gaussian_noise_variance``. Each method's learning rate is tuned over its own grid
(``ADAM_GRIDS``: DP-Adam ~ DP-SGD with step lr / sqrt(Phi), so its good rates are about
sqrt(Phi) times SGD's; DP-AdamBC's are near non-private Adam's), on the test split as above;
the table shows each method's best rate and every run below it, and for DP-AdamBC the fraction
of coordinates whose corrected second moment v_hat - Phi is below gamma after the last step
(mean over seeds): there the step is lr * m_hat / sqrt(gamma), set by the floor, not the data.

``--compare mechanism`` trains the digits task at epsilon 2 and 8 with flat C = ``ADAM_C`` and
SGD, each noise mechanism planned by ``make_private(target_epsilon=, epochs=, mechanism=)`` (the
plan calibrates sigma for the mechanism and its sampler, privacy/plan.py): **DP-SGD** (Gaussian,
Poisson sampling), **BandMF** (bands chosen by the plan for the least expected error, cyclic
Poisson over the bands) and **BLT** (4 buffers, cyclic Poisson over 1/q parts, accounted
without amplification). Each learning rate of ``MECH_LRS`` is run and the best kept (on the
test split, as above).

``--compare mechanism --tasks lm`` is the same comparison on a small language model through
``dpfx.hf.DPTrainer`` (``run_lm``): LoRA adapters (r 8 on ``c_attn``) of a character-level
GPT-2 (d 64, 2 layers, T 64) fine-tuned with SGD at learning rate ``LM_LR`` (one rate: the
language model's runs are the dear ones), ``--lm-epochs`` epochs of a Poisson (DP-SGD) or cyclic
Poisson (BandMF, BLT) batch of ``--lm-batch`` windows. The metric is the held-out loss (mean
cross-entropy per character, and its perplexity). The text and the public pre-training are
``examples/dp_lora_trainer.py``'s (no download): the model is pre-trained without privacy on
the descriptions of half of scikit-learn's bundled datasets (``LM_PRETRAIN`` AdamW steps, once
per process, shared by every run), and fine-tuned privately on 80% of the windows of the other
half; the other 20% are held out. A seed fixes the LoRA initialisation and the sampler.

Tasks (no download):

- **digits**: scikit-learn's bundled 8x8 digits, the CNN and stratified 80/20 split of
  ``examples/train_digits.py`` (its ``make_model``, ``load``), batch 256, SGD lr 4.0, 10 epochs.
- **docstrings**: which standard-library package a docstring comes from (``TEXT_PACKAGES``: the
  docstrings of the modules, classes and functions of this Python's own sources, read with
  ``ast``, duplicates and docstrings of fewer than 4 words dropped), a stratified 80/20 split.
  Words are hashed (crc32) into 4096 buckets, so no vocabulary is learned from the training
  data; the first 48 words of each docstring; model: an embedding of 64 and the mean over the
  words, then a linear head. Batch 256, SGD lr 8.0 (the best of 2, 8 and 16 at C = 1 on seed
  0, one run each), 10 epochs. Its classes are unbalanced (the largest is about 18%).
"""
from __future__ import annotations

import argparse
import ast
import datetime
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import dpfx  # noqa: E402
from dpfx import privacy  # noqa: E402
import train_digits  # noqa: E402  (the example's model and split)

EPSILON, DELTA = 3.0, 1e-5
ADAM_EPSILONS, ADAM_C, ADAMBC_GAMMA = (2.0, 8.0), 0.3, 1e-8
ADAM_GRIDS = {"adam": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1), "adambc": (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)}
ADAM_NAMES = {"adam": "DP-Adam", "adambc": "DP-AdamBC"}
MECH_NAMES = {"gaussian": "DP-SGD", "bandmf": "BandMF", "blt": "BLT"}
MECH_LRS = (1.0, 2.0, 4.0)
LM_LR, LM_C, LM_PRETRAIN, LM_TRAIN, LM_HELD_OUT = 0.5, 1.0, 150, 600, 200
TEXT_PACKAGES = ("asyncio", "email", "unittest", "multiprocessing", "xml", "importlib",
                 "logging", "http")
BUCKETS, WORDS = 4096, 48


# -- tasks ------------------------------------------------------------------------------------
def digits(seed: int):
    train, test = train_digits.load(seed)
    return train, test, train_digits.make_model("cnn")


class MeanOfWords(nn.Module):
    """Hashed word ids (0 pads) -> embedding -> mean over the docstring's words -> classes."""

    def __init__(self, classes: int, dim: int = 64):
        super().__init__()
        self.embed = nn.Embedding(BUCKETS, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids):
        mask = (ids != 0).unsqueeze(-1).to(self.embed.weight.dtype)
        words = (self.embed(ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.head(words)


def _stdlib_docstrings():
    """(package index, docstring) of the modules, classes and functions of ``TEXT_PACKAGES`` in
    this Python's own sources, in a fixed order."""
    stdlib = os.path.dirname(os.__file__)
    for label, package in enumerate(TEXT_PACKAGES):
        for folder, dirs, files in os.walk(os.path.join(stdlib, package)):
            dirs[:] = sorted(d for d in dirs if not d.startswith("test") and d != "__pycache__")
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                for node in ast.walk(tree):
                    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                         ast.AsyncFunctionDef)):
                        doc = ast.get_docstring(node)
                        if doc:
                            yield label, doc


def _docstrings() -> tuple[list[str], list[int]]:
    seen, texts, labels = set(), [], []
    for label, doc in _stdlib_docstrings():
        words = re.findall(r"[a-z]+", doc.lower())
        key = " ".join(words)
        if len(words) >= 4 and key not in seen:
            seen.add(key)
            texts.append(words)
            labels.append(label)
    return texts, labels


def _hashed(words: list[str]) -> list[int]:
    ids = [1 + zlib.crc32(w.encode()) % (BUCKETS - 1) for w in words[:WORDS]]
    return ids + [0] * (WORDS - len(ids))


def docstrings(seed: int):
    from sklearn.model_selection import train_test_split

    texts, labels = _docstrings()
    x = torch.tensor([_hashed(w) for w in texts])
    y = torch.tensor(labels)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed,
                                                        stratify=y)
    return TensorDataset(x_train, y_train), (x_test, y_test), MeanOfWords(len(TEXT_PACKAGES))


TASKS = {"digits": dict(data=digits, lr=4.0), "docstrings": dict(data=docstrings, lr=8.0),
         "lm": dict(data=None, lr=LM_LR)}


# -- the language model (--compare mechanism --tasks lm) ------------------------------------------
_LM = {}


def _lm_setup():
    """(pre-trained state, train windows, held-out ids, vocabulary size), made once a process."""
    if _LM:
        return _LM["state"], _LM["train"], _LM["held_out"], _LM["vocab"]
    from transformers import GPT2Config, GPT2LMHeadModel

    import dp_lora_trainer as lora
    torch.manual_seed(0)
    public = [d for pair in lora.texts() for d in pair]
    private = list(dict.fromkeys(doc for _, doc in _stdlib_docstrings()))
    chars = sorted(set("".join(public)))
    stoi = {c: i + 1 for i, c in enumerate(chars)}          # 0: a character public text lacks
    vocab = len(chars) + 1
    pub, priv = lora.windows(public, stoi), lora.windows(private, stoi)
    order = torch.randperm(len(priv), generator=torch.Generator().manual_seed(0))
    priv = [priv[i] for i in order[:LM_TRAIN + LM_HELD_OUT]]
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=lora.T, n_embd=64,
                                       n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.stack([r["input_ids"] for r in pub])
    for _ in range(LM_PRETRAIN):                             # public, not private
        batch = ids[torch.randint(0, len(ids), (32,))]
        logits = model(input_ids=batch).logits
        F.cross_entropy(logits[:, :-1].reshape(-1, vocab), batch[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    _LM.update(state={k: v.clone() for k, v in model.state_dict().items()},
               train=priv[:LM_TRAIN],
               held_out=torch.stack([r["input_ids"] for r in priv[LM_TRAIN:]]), vocab=vocab)
    return _lm_setup()


def _held_out_loss(model, ids, vocab) -> float:
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    model.train()
    return float(loss)


def run_lm(seed: int, *, args, epsilon: float, mechanism: str, lr: float) -> dict:
    """One DP LoRA fine-tuning through DPTrainer; its held-out loss (as ``accuracy``: higher is
    better, so the negated loss) and epsilon."""
    import tempfile

    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    import dpfx.hf
    state, train, held_out, vocab = _lm_setup()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=held_out.shape[1],
                                       n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                                       eos_token_id=0))
    model.load_state_dict(state)
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"],
                                             fan_in_fan_out=True, lora_dropout=0.0))
    before = _held_out_loss(model, held_out, vocab)
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.lm_batch,
            num_train_epochs=args.lm_epochs, learning_rate=lr, lr_scheduler_type="constant",
            optim="sgd", save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
            logging_strategy="no", seed=seed)
        trainer = dpfx.hf.DPTrainer(
            model=model, args=targs, train_dataset=train, target_epsilon=epsilon,
            target_delta=DELTA, max_grad_norm=LM_C, mechanism=mechanism, ledger=False,
            sampler_generator=torch.Generator().manual_seed(seed),
            dp_kwargs=dict(backend=args.backend))
        trainer.train()
    loss = _held_out_loss(model, held_out, vocab)
    return dict(accuracy=-loss, loss=loss, before=before, epsilon=trainer.get_epsilon(),
                sigma=trainer.noise_multiplier, q=trainer.sample_rate,
                steps=trainer.accountant.steps, n=len(train), test=len(held_out))


# -- one run ----------------------------------------------------------------------------------
def _optimizer(method: str, params, lr: float) -> torch.optim.Optimizer:
    if method == "adam":
        return torch.optim.Adam(params, lr=lr)
    if method == "adambc":
        return dpfx.DPAdamBC(params, lr=lr, gamma=ADAMBC_GAMMA)
    return torch.optim.SGD(params, lr=lr)


def run(task: str, seed: int, *, clipping: str, c: float, args, users: int | None = None,
        epsilon: float = EPSILON, method: str = "sgd", lr: float | None = None,
        mechanism: str | None = None) -> dict:
    """One training run; returns its test accuracy and epsilon."""
    torch.manual_seed(seed)
    train, (x_test, y_test), model = TASKS[task]["data"](seed)
    n = len(train)
    generator = torch.Generator().manual_seed(seed)
    user_ids = None
    units, batch = n, args.batch_size
    if users:
        # synthetic users: a seeded random partition of the examples into groups of k
        user_ids = torch.empty(n, dtype=torch.long)
        user_ids[torch.randperm(n, generator=torch.Generator().manual_seed(1000 + seed))] = \
            torch.arange(n) // users
        units, batch = math.ceil(n / users), args.batch_size // users
    q = batch / units
    steps = args.epochs * max(1, round(1 / q))
    if mechanism is None:
        budget = dict(noise_multiplier=privacy.noise_multiplier(
            target_epsilon=epsilon, target_delta=DELTA, sample_rate=q, steps=steps))
    else:       # the plan calibrates sigma for the mechanism and its sampler
        budget = dict(target_epsilon=epsilon, target_delta=DELTA, epochs=args.epochs,
                      mechanism=mechanism)
    extra = {}
    if clipping == "adaptive":
        extra = dict(target_unclipped_quantile=0.5, clip_lr=0.2, count_noise_multiplier=batch / 20)
    elif clipping == "automatic":
        extra = dict(clipping_gamma=0.01)
    inner = _optimizer(method, model.parameters(), lr or TASKS[task]["lr"])
    private = dpfx.make_private(
        dpfx.per_user(model) if users else model, inner, train, batch_size=batch,
        max_grad_norm=c, clipping=clipping, backend=args.backend, generator=generator,
        user_ids=user_ids, max_examples_per_user=users, **budget, **extra)
    sigma = private.noise_multiplier
    steps = args.epochs * private.steps_per_epoch
    if method == "adambc":      # the noise's per-coordinate variance in p.grad, every step
        inner.dp_noise_variance = dpfx.DPAdamBC.gaussian_noise_variance(
            sigma, c, private.model.dp_config.expected_batch_size)
    for _ in range(args.epochs):
        for batch_data in private.loader:
            private.optimizer.zero_grad(set_to_none=True)
            if users:
                x, y, mask = batch_data
                per_example = F.cross_entropy(private.model(x).flatten(0, 1), y.flatten(),
                                              reduction="none")
                loss = (per_example.view_as(mask) * mask).sum(1).mean()
            else:
                x, y = batch_data
                loss = F.cross_entropy(private.model(x), y)
            loss.backward()
            private.optimizer.step()
    model.eval()
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    out = dict(accuracy=acc, epsilon=private.accountant.get_epsilon(DELTA), sigma=sigma, q=q,
               steps=steps, n=n, test=len(y_test))
    if clipping == "adaptive":
        out["final_bound"] = private.model.adaptive_clip.bound
    if method == "adambc":
        out["floored"] = _floored(inner)
    return out


def _floored(opt) -> float:
    """DP-AdamBC after its last step: the fraction of coordinates whose corrected second moment
    v_hat - Phi_bar is below the floor gamma (their step is lr * m_hat / sqrt(gamma))."""
    below = total = 0
    for group in opt.param_groups:
        for p in group["params"]:
            s = opt.state[p]
            corrected = (s["exp_avg_sq"] - s["noise_variance_sum"]) \
                / (1 - group["betas"][1] ** s["step"].item())
            below += int((corrected < group["gamma"]).sum())
            total += corrected.numel()
    return below / total


def repeat(task, args, label, **kw) -> dict:
    if task == "lm":
        kw.pop("clipping"), kw.pop("c")
        runs = [run_lm(seed, args=args, **kw) for seed in range(args.seeds)]
    else:
        runs = [run(task, seed, args=args, **kw) for seed in range(args.seeds)]
    accs = [r["accuracy"] for r in runs]
    row = dict(task=task, label=label, accs=accs, mean=statistics.fmean(accs),
               std=statistics.pstdev(accs), epsilon=max(r["epsilon"] for r in runs),
               sigma=runs[0]["sigma"], q=runs[0]["q"], steps=runs[0]["steps"],
               n=runs[0]["n"], test=runs[0]["test"])
    if "final_bound" in runs[0]:
        row["bounds"] = [r["final_bound"] for r in runs]
    if "floored" in runs[0]:
        row["floored"] = statistics.fmean(r["floored"] for r in runs)
    if "before" in runs[0]:
        row["before"] = runs[0]["before"]
    print(f"  {task} {label}: {row['mean']:.4f} +- {row['std']:.4f} (eps {row['epsilon']:.3f})",
          flush=True)
    return row


def task_rows(task: str, args) -> dict:
    grid = [repeat(task, args, f"flat C={c:g}", clipping="flat", c=c) for c in args.grid]
    best_i = max(range(len(grid)), key=lambda i: grid[i]["mean"])
    best_c = args.grid[best_i]
    adaptive = repeat(task, args, "adaptive, C_0=1, quantile 0.5", clipping="adaptive", c=1.0)
    automatic = repeat(task, args, f"automatic, gamma 0.01, C={best_c:g}", clipping="automatic",
                       c=best_c)
    user = repeat(task, args, f"user-level, k={args.k}, C={best_c:g}", clipping="flat", c=best_c,
                  users=args.k)
    return dict(grid=grid, best=grid[best_i], best_c=best_c, adaptive=adaptive,
                automatic=automatic, user=user)


def adam_rows(task: str, args) -> dict:
    """{epsilon: {method: {"grid": rows, "best": row, "lr": best lr}}} for --compare adam."""
    out = {}
    for eps in ADAM_EPSILONS:
        out[eps] = {}
        for method, grid in ADAM_GRIDS.items():
            rows = [repeat(task, args, f"eps {eps:g}, {ADAM_NAMES[method]} lr={lr:g}",
                           clipping="flat", c=ADAM_C, epsilon=eps, method=method, lr=lr)
                    for lr in grid]
            best = max(range(len(rows)), key=lambda i: rows[i]["mean"])
            out[eps][method] = dict(grid=rows, best=rows[best], lr=grid[best])
    return out


def mechanism_rows(task: str, args) -> dict:
    """{epsilon: {mechanism: {"grid": rows, "best": row, "lr": best lr}}} for --compare
    mechanism."""
    out = {}
    for eps in ADAM_EPSILONS:
        out[eps] = {}
        for mech, name in MECH_NAMES.items():
            lrs = (LM_LR,) if task == "lm" else MECH_LRS
            rows = [repeat(task, args, f"eps {eps:g}, {name} lr={lr:g}", clipping="flat",
                           c=ADAM_C, epsilon=eps, lr=lr, mechanism=mech) for lr in lrs]
            best = max(range(len(rows)), key=lambda i: rows[i]["mean"])
            out[eps][mech] = dict(grid=rows, best=rows[best], lr=lrs[best])
    return out


# -- the report -------------------------------------------------------------------------------
def _machine() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _cell(row) -> str:
    if row.get("task") == "lm":     # "accuracy" is the negated held-out loss
        return f"{-row['mean']:.3f} ± {row['std']:.3f} (ppl {math.exp(-row['mean']):.2f})"
    return f"{row['mean']:.3f} ± {row['std']:.3f}"


def report(results: dict, args, minutes: float, commit: str) -> str:
    lines = [
        "# Utility at epsilon 3",
        "",
        f"`python benchmarks/utility.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`"
        f" ({minutes:.1f} min); {datetime.date.today().isoformat()}, commit {commit}, "
        f"{_machine()}, threads {torch.get_num_threads()}, torch {torch.__version__}, "
        f"backend {args.backend}. Method and tasks: the script's docstring.",
        "",
        f"Test accuracy, mean ± std over {args.seeds} seeds; epsilon at delta {DELTA:g} "
        f"(PLD), the largest over the seeds; {args.epochs} epochs, expected batch "
        f"{args.batch_size} examples.",
        "",
        "| task | flat C, tuned (best C) | adaptive (C_0 = 1, q 0.5) | automatic (gamma 0.01) "
        f"| example-level, best C | user-level, k = {args.k}, best C | epsilon (example / user) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for task, r in results.items():
        lines.append(f"| {task} | {_cell(r['best'])} (C = {r['best_c']:g}) | {_cell(r['adaptive'])} "
                     f"| {_cell(r['automatic'])} | {_cell(r['best'])} | {_cell(r['user'])} "
                     f"| {r['best']['epsilon']:.3f} / {r['user']['epsilon']:.3f} |")
    lines += ["", "Every run, by task (sigma calibrated for the row's q and steps):", "",
              "| task | run | q | steps | sigma | accuracy per seed | mean ± std | epsilon |",
              "|---|---|---:|---:|---:|---|---:|---:|"]
    for task, r in results.items():
        rows = r["grid"] + [r["adaptive"], r["automatic"], r["user"]]
        for row in rows:
            accs = ", ".join(f"{a:.3f}" for a in row["accs"])
            lines.append(f"| {task} (train {row['n']}, test {row['test']}) | {row['label']} "
                         f"| {row['q']:.4f} | {row['steps']} | {row['sigma']:.3f} | {accs} "
                         f"| {_cell(row)} | {row['epsilon']:.3f} |")
    lines.append("")
    for task, r in results.items():
        bounds = ", ".join(f"{b:.3f}" for b in r["adaptive"]["bounds"])
        lines.append(f"- {task}: adaptive clipping's last bound C_t, per seed: {bounds}.")
    return "\n".join(lines) + "\n"


def report_adam(results: dict, args, minutes: float, commit: str) -> str:
    lines = [
        "# DP-Adam against DP-AdamBC",
        "",
        f"`python benchmarks/utility.py {' '.join(sys.argv[1:])}` ({minutes:.1f} min); "
        f"{datetime.date.today().isoformat()}, commit {commit}, {_machine()}, threads "
        f"{torch.get_num_threads()}, torch {torch.__version__}, backend {args.backend}. Method: "
        f"the script's docstring (``--compare adam``).",
        "",
        f"Test accuracy, mean ± std over {args.seeds} seeds, each method at its best learning "
        f"rate of its grid; flat C = {ADAM_C:g}, {args.epochs} epochs, expected batch "
        f"{args.batch_size}, DP-AdamBC gamma {ADAMBC_GAMMA:g}; epsilon at delta {DELTA:g} (PLD).",
        "",
    ]
    for task, by_eps in results.items():
        lines += [f"| {task}: epsilon | DP-Adam (best lr) | DP-AdamBC (best lr) | sigma | steps "
                  f"| Phi = (sigma C / D)^2 | DP-AdamBC: coordinates floored at the end |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for eps, r in by_eps.items():
            adam, bc = r["adam"], r["adambc"]
            phi = dpfx.DPAdamBC.gaussian_noise_variance(adam["best"]["sigma"], ADAM_C,
                                                        args.batch_size)
            lines.append(f"| {adam['best']['epsilon']:.3f} | {_cell(adam['best'])} "
                         f"(lr {adam['lr']:g}) | {_cell(bc['best'])} (lr {bc['lr']:g}) "
                         f"| {adam['best']['sigma']:.3f} | {adam['best']['steps']} | {phi:.2e} "
                         f"| {bc['best']['floored']:.1%} |")
        lines += ["", "Every run:", "",
                  "| task | run | accuracy per seed | mean ± std | epsilon | floored |",
                  "|---|---|---|---:|---:|---:|"]
        for eps, r in by_eps.items():
            for method in ADAM_GRIDS:
                for row in r[method]["grid"]:
                    accs = ", ".join(f"{a:.3f}" for a in row["accs"])
                    floored = f"{row['floored']:.1%}" if "floored" in row else ""
                    lines.append(f"| {task} | {row['label']} | {accs} | {_cell(row)} "
                                 f"| {row['epsilon']:.3f} | {floored} |")
        lines.append("")
    return "\n".join(lines)


def report_mechanism(results: dict, args, minutes: float, commit: str) -> str:
    lines = [
        "# Correlated noise against DP-SGD",
        "",
        f"`python benchmarks/utility.py {' '.join(sys.argv[1:])}` ({minutes:.1f} min); "
        f"{datetime.date.today().isoformat()}, commit {commit}, {_machine()}, threads "
        f"{torch.get_num_threads()}, torch {torch.__version__}, backend {args.backend}. Method: "
        f"the script's docstring (``--compare mechanism``).",
        "",
        f"load average {args.load_before} before the runs, {args.load_after} after "
        f"(1 / 5 / 15 min; other processes shared the machine).",
        "",
    ]
    if [t for t in results if t != "lm"]:
        lines += [
            f"Test accuracy, mean ± std over {args.seeds} seeds, each mechanism at its best "
            f"learning rate of {MECH_LRS}; SGD, flat C = {ADAM_C:g}, {args.epochs} epochs, "
            f"expected batch {args.batch_size}; epsilon at delta {DELTA:g} (PLD) after the run; "
            f"sigma as planned.", ""]
    if "lm" in results:
        before = next(iter(results["lm"].values()))["gaussian"]["best"]["before"]
        lines += [
            f"lm: held-out loss (nats per character; perplexity), mean ± std over {args.seeds} "
            f"seeds, lower is better; DPTrainer, LoRA, SGD at lr {LM_LR:g}, C = {LM_C:g}, "
            f"{args.lm_epochs} epochs, expected batch {args.lm_batch} of {LM_TRAIN} windows; "
            f"{LM_HELD_OUT} held out; before fine-tuning {before:.3f} (ppl "
            f"{math.exp(before):.2f}). Epsilon at delta {DELTA:g} after the run.", ""]
    for task, by_eps in results.items():
        lines += [f"| {task}: target epsilon | "
                  + " | ".join(f"{n} (lr, sigma, steps)" for n in MECH_NAMES.values()) + " |",
                  "|---:|" + "---:|" * len(MECH_NAMES)]
        for eps, r in by_eps.items():
            cells = [f"{_cell(r[m]['best'])} ({r[m]['lr']:g}, {r[m]['best']['sigma']:.3f}, "
                     f"{r[m]['best']['steps']})" for m in MECH_NAMES]
            lines.append(f"| {eps:g} | " + " | ".join(cells) + " |")
        lines += ["", "Every run:", "",
                  "| task | run | accuracy per seed | mean ± std | epsilon |",
                  "|---|---|---|---:|---:|"]
        for eps, r in by_eps.items():
            for mech in MECH_NAMES:
                for row in r[mech]["grid"]:
                    sign = -1 if task == "lm" else 1
                    accs = ", ".join(f"{sign * a:.3f}" for a in row["accs"])
                    lines.append(f"| {task} | {row['label']} | {accs} | {_cell(row)} "
                                 f"| {row['epsilon']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", choices=["clipping", "adam", "mechanism"], default="clipping",
                    help="clipping: the clipping choices and user-level DP at epsilon 3 (both "
                         "tasks by default); adam: DP-Adam against DP-AdamBC; mechanism: "
                         "correlated noise against DP-SGD (digits by default; lm: the "
                         "language model, written to utility_mechanism_lm.md)")
    ap.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=None)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lm-epochs", type=int, default=4, help="epochs of the lm task")
    ap.add_argument("--lm-batch", type=int, default=32, help="expected batch of the lm task")
    ap.add_argument("--grid", type=float, nargs="+", default=[0.1, 0.3, 1.0, 3.0])
    ap.add_argument("--k", type=int, default=4, help="examples per synthetic user")
    ap.add_argument("--backend", choices=["inductor", "eager"], default="inductor")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="default benchmarks/latest/utility.md, "
                    "utility_adam.md or utility_mechanism.md by --compare")
    args = ap.parse_args()
    rows, write, name = {"clipping": (task_rows, report, "utility.md"),
                         "adam": (adam_rows, report_adam, "utility_adam.md"),
                         "mechanism": (mechanism_rows, report_mechanism,
                                       "utility_mechanism.md")}[args.compare]
    args.tasks = args.tasks or ([t for t in TASKS if t != "lm"] if args.compare == "clipping"
                                else ["digits"])
    if "lm" in args.tasks and args.compare != "mechanism":
        raise SystemExit("--tasks lm is a task of --compare mechanism")
    if args.tasks == ["lm"]:
        name = name.replace(".md", "_lm.md")
    args.out = args.out or os.path.join(ROOT, "benchmarks", "latest", name)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)
    start, commit = time.perf_counter(), _commit()
    args.load_before = " / ".join(f"{a:.2f}" for a in os.getloadavg())
    results = {}
    for task in args.tasks:
        print(f"{task}:", flush=True)
        results[task] = rows(task, args)
    args.load_after = " / ".join(f"{a:.2f}" for a in os.getloadavg())
    text = write(results, args, (time.perf_counter() - start) / 60, commit)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
