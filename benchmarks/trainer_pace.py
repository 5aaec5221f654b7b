"""DPTrainer's pace step by step: HF GPT-2 small (124M, from its config, random weights) with LoRA
(r = 8 on c_attn), T = 128, 8 examples a logical step, through ``dpfx.hf.DPTrainer`` as a new
user writes it. Each optimizer step's wall time is printed with its logical batch and the
physical batches it ran as (Note [Near-equal physical batches] in dpfx/loop/data.py), then
the median of the steps after the first and the largest step over that median.

    python benchmarks/trainer_pace.py [--steps 6] [--per-device 8] [--examples 400]

Nothing is downloaded: the tokens are random. The first step includes dpfx's compile.
"""
import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--per-device", type=int, default=8)
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    import dpfx.hf
    from dpfx.loop import data

    torch.manual_seed(0)
    model = get_peft_model(GPT2LMHeadModel(GPT2Config()),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"],
                                      fan_in_fan_out=True, lora_dropout=0.0))
    ids = torch.randint(0, 50257, (args.examples, args.seq))
    train = [{"input_ids": row, "labels": row.clone()} for row in ids]

    physical = []
    split = data.split_batch

    def recorded(batch, cap):
        pieces = split(batch, cap)
        physical.append([len(next(iter(p.values()))) if isinstance(p, dict) else len(p)
                         for p in pieces])
        return pieces

    data.split_batch = dpfx.hf.trainer.split_batch = recorded
    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()
            physical.clear()

        def on_step_end(self, *_, **__):
            times.append((time.perf_counter() - self.start, [list(p) for p in physical]))

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.per_device,
            gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=1e-3,
            logging_steps=1000, save_strategy="no", report_to=[], use_cpu=True,
            disable_tqdm=True)
        trainer = dpfx.hf.DPTrainer(model=model, args=targs, train_dataset=train,
                                    noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=1.0,
                                    callbacks=[Clock()])
        trainer.train()
    for i, (t, pieces) in enumerate(times):
        logical = sum(sum(p) for p in pieces)
        print(f"step {i + 1}: {t:7.2f} s  logical batch {logical:3d}  physical {pieces}")
    rest = [t for t, _ in times[1:]]
    median = statistics.median(rest)
    print(f"steps after the first: median {median:.2f} s, largest {max(rest):.2f} s "
          f"({max(rest) / median:.2f}x the median)")


if __name__ == "__main__":
    main()
