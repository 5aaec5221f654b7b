"""DP training of a Hugging Face Llama sharded with FSDP2, on CPU with gloo.

    torchrun --nproc_per_node=2 examples/fsdp_llama.py
    torchrun --nproc_per_node=2 examples/fsdp_llama.py --lora      # adapters on a frozen base

A small character-level Llama (tied input and output embeddings) is sharded as users shard HF
decoders: ``fully_shard`` on every decoder layer, then on the root. ``dpfx.make_private`` compiles
it: each rank Poisson-samples its part of the data, dpfx's private graph runs on the gathered
parameters, ``step()`` reduce-scatters the clipped sums to the ranks that own each shard, and
each rank noises its own shard once (Note [Sharded DP-SGD] in dpfx/loop/fsdp.py). The parameters,
their gradients and AdamW's state stay shards. The text is the Zen of Python, which ships with
Python (nothing is downloaded).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

import dpfx


def zen_of_python() -> str:
    import codecs
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


class CharLM(nn.Module):
    def __init__(self, vocab: int, lora: bool):
        super().__init__()
        import transformers
        self.m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64,
            tie_word_embeddings=True))
        if lora:
            import peft
            self.m = peft.get_peft_model(self.m, peft.LoraConfig(
                r=4, target_modules=["q_proj", "v_proj"]))

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).logits

    def decoder_layers(self):
        base = self.m.get_base_model() if hasattr(self.m, "get_base_model") else self.m
        return base.model.layers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="expected, over all ranks")
    parser.add_argument("--target-epsilon", type=float, default=8.0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    text = zen_of_python()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text])
    T = 32
    windows = ids.unfold(0, T + 1, 4)                  # overlapping windows of the text
    data = TensorDataset(windows[:, :-1], windows[:, 1:])

    torch.manual_seed(0)                               # the same model on every rank
    model = CharLM(len(chars), args.lora)
    for layer in model.decoder_layers():
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    dp_model, optimizer, loader, accountant = dpfx.make_private_with_epsilon(
        model, optimizer, data, target_epsilon=args.target_epsilon, target_delta=1e-5,
        epochs=args.epochs, max_grad_norm=1.0, batch_size=args.batch_size)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        for x, y in loader:
            optimizer.zero_grad()
            logits = dp_model(x)
            per_example = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)
            per_example.mean().backward()
            optimizer.step()
        with torch.no_grad():                          # public evaluation on rank 0's view
            x, y = data[:64]
            loss = F.cross_entropy(dp_model(x).transpose(1, 2), y).item()
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {loss:.3f}, epsilon "
                  f"{accountant.get_epsilon(1e-5):.2f} (delta 1e-5), "
                  f"{time.perf_counter() - start:.1f} s")
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    if rank == 0:
        print(f"parameters held as {kinds}; {sum(p.to_local().numel() for p in model.parameters())}"
              f" of {sum(p.numel() for p in model.parameters())} coordinates on rank 0")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
