"""Per-rank memory and step time of sharded DP training (FSDP2), beside the unsharded dpfx run and
plain (non-private) ``fully_shard`` training.

    python benchmarks/sharded.py                       # 2 gloo ranks, MLP 8 x 2048^2, B = 64
    python benchmarks/sharded.py --world 2 --layers 8 --width 2048 --batch 64 --steps 10

Each method runs in fresh processes (``--world`` ranks, gloo, one thread each), AdamW, the same
model and per-rank batch:
- ``fsdp``: plain ``fully_shard`` training (per layer, then the root), eager, non-private;
- ``dpfx-default``: the same sharding, ``dpfx.compile`` (Inductor), sigma 1, no ``blocks=``
  (each unit but the root a block: Note [A sharded model gets blocks by default] in dpfx/api.py);
- ``dpfx-sharded``: the same, with ``blocks=False``: one private graph;
- ``dpfx-blocks``: the same, with ``blocks="auto"`` (each unit a block: Note [Sharded blocks] in
  dpfx/loop/fsdp.py);
- ``dpfx-replicated``: dpfx's unsharded data-parallel path (every rank holds the whole model).
``--model llama`` runs an HF Llama (from a config) sharded per decoder layer instead, with a
token cross-entropy. Per rank it reports the step peak (the growth of the peak resident set,
VmHWM, over the resident set just before a steady step, with VmHWM reset through
/proc/self/clear_refs; the largest over the steady steps), the tensor bytes held between steps
(parameters, gradients and optimizer state, as ``to_local()`` shards where sharded), the
resident set size after the steady steps (compiled code and the interpreter included) and
right after a backward, and the median step time. Writes a markdown table to stdout and --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _llama(layers: int, width: int) -> nn.Module:
    import transformers
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
        num_attention_heads=max(1, width // 64), num_key_value_heads=max(1, width // 64),
        vocab_size=8192, max_position_embeddings=256))


class _Logits(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).logits


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def _worker(rank, world, port, method, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    import dpfx
    from torch.distributed.fsdp import fully_shard

    llama = args.model == "llama"
    model = _Logits(_llama(args.layers, args.width)) if llama else _model(args.layers, args.width)
    if method != "dpfx-replicated":
        if llama:
            for layer in model.m.model.layers:
                fully_shard(layer)
        else:
            for m in model:
                if isinstance(m, nn.Linear):
                    fully_shard(m)
        fully_shard(model)
    step_model = model
    if method.startswith("dpfx"):
        step_model = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0,
                                  expected_batch_size=args.batch * world,
                                  blocks={"dpfx-blocks": "auto", "dpfx-sharded": False,
                                          "dpfx-default": None}.get(method))
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4) if args.optimizer == "adamw" else \
        torch.optim.SGD(params, lr=1e-3)
    if method.startswith("dpfx"):
        opt = dpfx.DPOptimizer(opt, step_model)
    g = torch.Generator().manual_seed(rank)
    if llama:
        x = torch.randint(0, 8192, (args.batch, args.seq), generator=g)
        y = torch.randint(0, 8192, (args.batch, args.seq), generator=g)
    else:
        x = torch.randn(args.batch, args.width, generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)

    def loss_of(out):
        if llama:
            return F.cross_entropy(out.flatten(0, 1), y.flatten())
        return F.cross_entropy(out, y)

    times, rss, mid, peaks = [], [], [], []
    for step in range(args.steps + 1):
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")        # VmHWM := VmRSS
        before = _status_bytes("VmRSS")
        start = time.perf_counter()
        opt.zero_grad()
        loss_of(step_model(x)).backward()
        mid.append(_rss())
        opt.step()
        times.append(time.perf_counter() - start)
        peaks.append(_status_bytes("VmHWM") - before)
        rss.append(_rss())
    held = sum(_local_bytes(p) for p in model.parameters())
    held += sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    held += sum(_local_bytes(v) for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    result = {"method": method, "rank": rank, "first_step_s": times[0],
              "step_ms": 1e3 * statistics.median(times[1:]),
              "held_MB": held / 2**20, "rss_MB": rss[-1] / 2**20,
              "rss_backward_MB": max(mid[1:]) / 2**20,
              "rss_growth_MB": (rss[-1] - rss[1]) / 2**20,
              "step_peak_MB": max(peaks[1:]) / 2**20}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", choices=["mlp", "llama"], default="mlp")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--seq", type=int, default=64, help="the Llama's sequence length")
    parser.add_argument("--methods", nargs="+",
                        default=["fsdp", "dpfx-default", "dpfx-blocks", "dpfx-sharded",
                                 "dpfx-replicated"])
    parser.add_argument("--out", default="benchmarks/out/sharded.md")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    rows = []
    for method in args.methods:
        stem = f"{args.out}.{method}"
        mp.start_processes(_worker, args=(args.world, _free_port(), method, args, stem),
                           nprocs=args.world, start_method="spawn")
        for rank in range(args.world):
            with open(f"{stem}.rank{rank}") as f:
                rows.append(json.load(f))
            os.remove(f"{stem}.rank{rank}")
    if args.model == "llama":
        params = sum(p.numel() for p in _llama(args.layers, args.width).parameters())
        what = (f"HF Llama, {args.layers} decoder layers of width {args.width}, V = 8192, "
                f"T = {args.seq}, sharded per decoder layer")
    else:
        params = sum(p.numel() for p in _model(args.layers, args.width).parameters())
        what = f"MLP {args.layers} x {args.width}^2 + head, sharded per Linear"
    lines = [f"Sharded DP training, {args.world} gloo ranks on one machine, {what} "
             f"({params / 1e6:.1f}M parameters, {params * 4 / 2**20:.0f} MB in fp32), "
             f"{args.batch} examples per rank, {args.optimizer}, {args.steps} steps after the first; "
             f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f} at the end.", "",
             "| method | rank | step peak (MB) | tensors held between steps (MB) | "
             "RSS between steps (MB) | RSS after a backward (MB) | first step (s) | "
             "step (ms, median) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['rank']} | {r['step_peak_MB']:.0f} | "
                     f"{r['held_MB']:.0f} | {r['rss_MB']:.0f} | {r['rss_backward_MB']:.0f} | "
                     f"{r['first_step_s']:.1f} | {r['step_ms']:.0f} |")
    text = "\n".join(lines)
    print(text)
    with open(args.out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
