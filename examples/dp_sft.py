"""DP supervised fine-tuning of a small chat model through TRL (dpfx.trl.DPSFTTrainer).

    make sft-example          # or: .venv/bin/python examples/dp_sft.py

Instruction tuning at toy scale, with nothing downloaded: a character-level tokenizer with a
chat template is built here, the instructions are generated ("reverse", "repeat", "first
letter" on random words: each conversation is one user's private request and the assistant's
answer), and a GPT-2 from a tiny config learns to answer them with DP-SGD through TRL's
SFTTrainer: chat template applied by TRL, the loss on the assistant's tokens only
(``assistant_only_loss``), Poisson sampling, epsilon logged with the loss. One conversation is
the unit of privacy. It prints the held-out loss on the assistant's tokens before and after,
a few answers, and the epsilon spent.
"""
import os
import random
import sys
import tempfile
import time

import torch

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

CHARS = "abcdefghijklmnopqrstuvwxyz :?."
SPECIALS = ["<pad>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]
# {% generation %} marks the assistant's tokens, which assistant_only_loss trains on
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
    "{{ m['content'] }}<|end|>{% endgeneration %}{% else %}<|user|>{{ m['content'] }}<|end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def char_tokenizer():
    """A character-level fast tokenizer with a chat template, built locally."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                  eos_token="<|end|>", additional_special_tokens=SPECIALS[2:])
    out.chat_template = CHAT_TEMPLATE
    return out


def tiny_gpt2(tokenizer, n_positions=64):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tokenizer), n_positions=n_positions, n_embd=64, n_layer=2, n_head=4,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id))


def random_word(rng):
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))


def instruction(rng):
    """One generated conversation: an instruction on a random word and its answer."""
    word = random_word(rng)
    task, answer = rng.choice([("reverse", word[::-1]), ("repeat", f"{word} {word}"),
                               ("first letter of", word[0])])
    return {"messages": [{"role": "user", "content": f"{task} {word}"},
                         {"role": "assistant", "content": answer}]}


def assistant_loss(model, rows):
    """The mean loss on the assistant's tokens of prepared (tokenized, labelled) rows."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            ids, labels = torch.tensor([r["input_ids"]]), torch.tensor([r["labels"]])
            logits = model(input_ids=ids).logits[0, :-1]
            keep = labels[0, 1:] != -100
            total += float(torch.nn.functional.cross_entropy(
                logits[keep], labels[0, 1:][keep], reduction="sum"))
            count += int(keep.sum())
    model.train()
    return total / count


def answer(model, tokenizer, question):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=14, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    model.train()
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main():
    import datasets
    from trl import SFTConfig

    import dpfx.trl

    rng = random.Random(0)
    torch.manual_seed(0)
    train = datasets.Dataset.from_list([instruction(rng) for _ in range(3000)])
    held_out = datasets.Dataset.from_list([instruction(rng) for _ in range(200)])
    tokenizer = char_tokenizer()
    model = tiny_gpt2(tokenizer)
    out = tempfile.mkdtemp(prefix="dp_sft_")
    args = SFTConfig(output_dir=out, per_device_train_batch_size=64,
                     max_steps=int(os.environ.get("STEPS", 150)), learning_rate=6e-3,
                     lr_scheduler_type="constant", warmup_steps=0,
                     assistant_only_loss=True, max_length=40, logging_steps=20,
                     save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                     gradient_checkpointing=False, disable_tqdm=not sys.stdout.isatty())
    trainer = dpfx.trl.DPSFTTrainer(
        model=model, args=args, train_dataset=train, eval_dataset=held_out,
        processing_class=tokenizer, target_epsilon=8.0, target_delta=1e-5, max_grad_norm=1.0)
    rows = list(trainer.eval_dataset)
    print(f"{len(trainer.train_dataset)} private conversations, q = {trainer.sample_rate:.3f}, "
          f"sigma = {trainer.noise_multiplier:.2f} for epsilon 8 over {args.max_steps} steps")
    before = assistant_loss(model, rows)
    print(f"held-out loss on the assistant's tokens before: {before:.3f}", flush=True)
    start = time.time()
    trainer.train()
    after = assistant_loss(model, rows)
    print(f"held-out loss on the assistant's tokens after:  {after:.3f} "
          f"({time.time() - start:.0f} s of DP training)")
    for question in ("reverse cloud", "repeat tiger", "first letter of zebra"):
        print(f"  {question!r} -> {answer(model, tokenizer, question)!r}")
    print(f"epsilon = {trainer.get_epsilon():.2f} at delta = 1e-5, one conversation the unit")
    if after >= before:
        sys.exit("the held-out loss did not go down")


if __name__ == "__main__":
    main()
