"""Step time of dpfx's strategies side by side on one benchmark model, against non-private
torch.compile: does ``strategy="auto"`` pick the fastest form?

    python benchmarks/strategies.py cnn 32                # auto, materialize, ghost; 2 threads
    python benchmarks/strategies.py cnn 64 --threads 1 --steps 60

One process holds every method; the timed steps go round-robin in blocks (one untimed step per
turn), as in run.py, so outside load falls on every method alike. Each method compiles with a
fresh Inductor cache and its own model and data (dpfx marks the batch dim of its inputs unbacked,
which would make a shared input recompile the non-private method). Prints the median and min step
and the load average; with 2 threads on a busy machine, prefer --threads 1.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("batch", type=int)
    ap.add_argument("--strategies", default="auto,materialize,ghost")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from torch._inductor.utils import fresh_cache

    import methods
    import models

    torch.set_num_threads(args.threads)
    factories = {"non-private torch.compile": methods.nonprivate_compile}
    for s in args.strategies.split(","):
        factories[f"dpfx strategy={s}"] = lambda m, B, s=s: methods._dpfx(m, B, s)
    cache_root = tempfile.mkdtemp(prefix="dpfx-strategies-")
    live = {}
    for name, factory in factories.items():
        with fresh_cache(dir=cache_root, delete=False):
            model, x, y = models.build(args.model, args.batch)
            m = factory(model, args.batch)
            t0 = time.perf_counter()
            for _ in range(3):
                m.step(x, y)
        print(f"{name}: compile + warm-up {time.perf_counter() - t0:.1f} s", flush=True)
        live[name] = (m, x, y)
    times = {name: [] for name in live}
    while min(len(t) for t in times.values()) < args.steps:
        for name, (m, x, y) in live.items():
            m.step(x, y)
            for _ in range(args.block):
                t0 = time.perf_counter()
                m.step(x, y)
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["non-private torch.compile"])
    print(f"{args.model} B={args.batch} threads={args.threads} load {os.getloadavg()}")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"  {name:28s} median {med * 1e3:8.2f} ms  min {min(t) * 1e3:8.2f} ms  "
              f"x{med / base:.2f}")
    if "dpfx strategy=auto" in live:
        import dpfx

        model, x, _ = models.build(args.model, args.batch)
        for row in dpfx.explain(model, x, max_grad_norm=1.0, noise_multiplier=1.0).rows:
            print(f"  auto: {row.name:14s} {row.strategy:11s} {row.form}")


if __name__ == "__main__":
    main()
