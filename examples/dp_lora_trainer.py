"""DP LoRA fine-tuning of a small GPT-2 through Hugging Face's Trainer (dpfx.hf.DPTrainer).

    make lora-example          # or: .venv/bin/python examples/dp_lora_trainer.py

The usual recipe of DP fine-tuning, at toy scale and with nothing downloaded: a character-level
GPT-2 is first trained without privacy on "public" text (the descriptions of half of
scikit-learn's bundled datasets), then LoRA adapters are fine-tuned with DP-SGD on the "private"
text (the other half), through transformers' Trainer with Poisson sampling, gradient
accumulation as a virtual batch, and epsilon logged with the loss. It prints the private
held-out perplexity before and after, and the epsilon spent.

The public pre-training shows its progress as lines (``Progress``: the step, the time taken and
the time left, at the first step, every 10 seconds and at the last), which a log file or a CI
console shows as well as a terminal. The DP phase has Trainer's progress bar on a terminal;
elsewhere the same lines, with the epsilon spent, and Trainer's logs every 5 steps.
"""
import math
import os
import pathlib
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import dpfx.hf
from transformers import TrainerCallback

T = 64               # characters a training example: the unit of privacy


class Progress:
    """Prints ``label: step i/n, t s, about r s left`` at the first step, every ``every``
    seconds after it and at the last, flushed at once; ``extra()`` adds to the line. The time
    left is at the pace of the steps after the first (which may compile)."""

    def __init__(self, label: str, total: int, every: float = 10.0, extra=lambda: ""):
        self.label, self.total, self.every, self.extra = label, total, every, extra
        self.start = self.last = time.time()
        self.first = None           # when the first step ended

    def __call__(self, done: int) -> None:
        now = time.time()
        if done == 1:
            self.first = now
        elif done < self.total and now - self.last < self.every:
            return
        self.last, taken = now, now - self.start
        left = "" if done == 1 or self.first is None else \
            f", about {(now - self.first) / (done - 1) * (self.total - done):.0f} s left"
        print(f"{self.label}: step {done}/{self.total}, {taken:.0f} s{left}{self.extra()}",
              flush=True)


class ProgressLines(TrainerCallback):
    """``Progress`` over Trainer's optimizer steps, with the epsilon spent so far."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        print("DP fine-tuning: the first step compiles the private forward and backward ...",
              flush=True)
        self.progress = Progress("DP fine-tuning", state.max_steps,
                                 extra=lambda: f", epsilon {self.trainer.get_epsilon():.2f}")

    def on_step_end(self, args, state, control, **kwargs):
        self.progress(state.global_step)


def texts():
    import sklearn.datasets

    folder = pathlib.Path(sklearn.datasets.__file__).parent / "descr"
    docs = sorted(folder.glob("*.rst"))
    return ([p.read_text() for p in docs[0::2]], [p.read_text() for p in docs[1::2]])


def windows(docs, stoi, stride=T):
    """Non-overlapping windows: the privacy unit is one window of T characters (overlapping
    windows would put a character in two examples, and double what one secret can move)."""
    rows = []
    for doc in docs:
        ids = torch.tensor([stoi.get(c, 0) for c in doc])
        for start in range(0, len(ids) - T, stride):
            chunk = ids[start:start + T]
            rows.append({"input_ids": chunk, "labels": chunk.clone()})
    return rows


def perplexity(model, rows):
    model.eval()
    with torch.no_grad():
        ids = torch.stack([r["input_ids"] for r in rows])
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                               ids[:, 1:].reshape(-1))
    model.train()
    return math.exp(float(loss))


def main():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    torch.manual_seed(0)
    public, private = texts()
    chars = sorted(set("".join(public + private)))
    stoi = {c: i + 1 for i, c in enumerate(chars)}          # 0: unknown
    pub, priv = windows(public, stoi), windows(private, stoi)
    split = len(priv) * 4 // 5
    train, held_out = priv[:split], priv[split:]
    print(f"public text: {len(pub)} windows; private: {len(train)} train, {len(held_out)} "
          f"held out; {len(chars) + 1} symbols, {T} characters each")

    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(chars) + 1, n_positions=T, n_embd=64,
                                       n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))
    start = time.time()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.stack([r["input_ids"] for r in pub])
    progress = Progress("public pre-training", 400)
    for step in range(400):                                  # public pre-training, not private
        batch = ids[torch.randint(0, len(ids), (32,))]
        logits = model(input_ids=batch).logits
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                        batch[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        progress(step + 1)
    print(f"pre-trained on public text in {time.time() - start:.0f} s; private held-out "
          f"perplexity {perplexity(model, held_out):.2f}")

    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"],
                                             fan_in_fan_out=True, lora_dropout=0.0))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=32, gradient_accumulation_steps=2,
            num_train_epochs=3, learning_rate=2e-2, lr_scheduler_type="constant",
            logging_steps=5, save_strategy="no", report_to=[], use_cpu=True,
            disable_tqdm=not sys.stdout.isatty() and "DPFX_PROGRESS" not in os.environ)
        trainer = dpfx.hf.DPTrainer(model=model, args=args, train_dataset=train,
                                    target_epsilon=8.0, target_delta=1e-5, max_grad_norm=1.0)
        if args.disable_tqdm:           # no bar: lines a log file shows too
            trainer.add_callback(ProgressLines(trainer))
        print(f"DP fine-tuning of the LoRA adapters: sigma {trainer.noise_multiplier:.3f}, "
              f"q {trainer.sample_rate:.3f}, {trainer.planned_steps()} steps")
        start = time.time()
        trainer.train()
    print(f"DP fine-tuned in {time.time() - start:.0f} s; private held-out perplexity "
          f"{perplexity(model, held_out):.2f}; epsilon {trainer.get_epsilon():.2f} at delta "
          f"{trainer.delta:g} ({trainer.accountant.steps} steps)")


if __name__ == "__main__":
    main()
