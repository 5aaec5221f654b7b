"""DP preference optimization (DPO) of a small model through TRL (dpfx.trl.DPDPOTrainer).

    make dpo-example          # or: .venv/bin/python examples/dp_dpo.py

Preference tuning at toy scale, with nothing downloaded: the character-level tokenizer of
dp_sft.py, generated preference pairs (a prompt "name a cat:" and two made-up names, the chosen
one spelled from the first half of the alphabet: each pair one user's private feedback), LoRA
adapters on a GPT-2 from a tiny config, trained with DP-SGD through TRL's DPOTrainer: the
sigmoid (DPO) loss, the reference the base model (the adapters switched off), each pair's
gradient (chosen and rejected together) clipped as one. One preference pair is the unit of
privacy. It prints the held-out DPO loss, reward margin and reward accuracy before and after
(the margin and accuracy rise as the policy learns the preference), and the epsilon spent.
"""
import os
import random
import sys
import tempfile
import time

import torch

from dp_sft import char_tokenizer, tiny_gpt2

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def preference(rng):
    """A prompt and two made-up answers: the user preferred the one spelled from the first half
    of the alphabet."""
    def spelled(letters):
        return "".join(rng.choice(letters) for _ in range(rng.randint(3, 6)))

    return {"prompt": f"name a {rng.choice(['cat', 'dog', 'bird', 'fish', 'star'])}:",
            "chosen": f" {spelled('abcdefghijklm')}", "rejected": f" {spelled('nopqrstuvwxyz')}"}


def main():
    import datasets
    from peft import LoraConfig
    from trl import DPOConfig

    import dpfx.trl

    rng = random.Random(0)
    torch.manual_seed(0)
    train = datasets.Dataset.from_list([preference(rng) for _ in range(2000)])
    held_out = datasets.Dataset.from_list([preference(rng) for _ in range(128)])
    tokenizer = char_tokenizer()
    out = tempfile.mkdtemp(prefix="dp_dpo_")
    args = DPOConfig(output_dir=out, per_device_train_batch_size=64,
                     per_device_eval_batch_size=64, max_steps=int(os.environ.get("STEPS", 80)),
                     learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0,
                     loss_type="sigmoid", beta=0.1, max_length=24, logging_steps=20,
                     save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                     gradient_checkpointing=False, disable_tqdm=not sys.stdout.isatty())
    trainer = dpfx.trl.DPDPOTrainer(
        model=tiny_gpt2(tokenizer), args=args, train_dataset=train, eval_dataset=held_out,
        processing_class=tokenizer, peft_config=LoraConfig(
            r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
            lora_dropout=0.0),
        target_epsilon=8.0, target_delta=1e-5, max_grad_norm=1.0)
    print(f"{len(trainer.train_dataset)} private preference pairs, q = "
          f"{trainer.sample_rate:.3f}, sigma = {trainer.noise_multiplier:.2f} for epsilon 8 "
          f"over {args.max_steps} steps")

    def report(when):
        m = trainer.evaluate()
        print(f"held-out {when}: DPO loss {m['eval_loss']:.4f}, reward margin "
              f"{m['eval_rewards/margins']:+.4f}, reward accuracy "
              f"{m['eval_rewards/accuracies']:.2f}", flush=True)
        return m

    before = report("before")
    start = time.time()
    trainer.train()
    print(f"{time.time() - start:.0f} s of DP training")
    after = report("after ")
    print(f"epsilon = {trainer.get_epsilon():.2f} at delta = 1e-5, one preference pair the unit")
    if not (after["eval_rewards/margins"] > before["eval_rewards/margins"]
            and after["eval_loss"] < before["eval_loss"]):
        sys.exit("the held-out DPO loss did not fall, or the reward margin did not rise")


if __name__ == "__main__":
    main()
