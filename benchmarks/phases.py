"""Where a training step's time goes: forward call, loss, backward, optimizer step, for dpfx and
non-private torch.compile of the same model and batch, interleaved in one process.

    python benchmarks/phases.py mlp 64            # medians of 300 steps per method
    python benchmarks/phases.py gpt 16 --profile  # plus cProfile's top functions of dpfx's step

The phases are timed with ``time.perf_counter`` around each call (CPU, so no synchronisation is
needed). Use it to find per-call overhead; the step figures that count are run.py's.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import methods  # noqa: E402
from models import build, forward, loss_fn  # noqa: E402

PHASES = ("forward", "loss", "backward", "step")


def stepper(name: str, model, B: int):
    """A function running one step and returning the four phase times in seconds."""
    opt = torch.optim.SGD(model.parameters(), lr=methods.LR)
    if name == "dpfx":
        import dpfx
        run = dpfx.compile(model, max_grad_norm=methods.C, noise_multiplier=methods.SIGMA,
                           expected_batch_size=B)
    else:
        run = torch.compile(model)

    def step(x, y):
        t0 = time.perf_counter()
        out = forward(run, x)
        t1 = time.perf_counter()
        loss = loss_fn(out, y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("B", type=int)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    steps, data = {}, None
    for name in ("compile", "dpfx"):
        model, x, y = build(args.model, args.B)
        data = (x, y)
        steps[name] = stepper(name, model, args.B)
        for _ in range(3):
            steps[name](x, y)
    times = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            times[name].append(step(*data))
    print(f"{args.model} B={args.B}, medians of {args.steps} steps (ms), threads "
          f"{torch.get_num_threads()}")
    print(f"{'phase':<10}" + "".join(f"{n:>12}" for n in steps))
    for i, phase in enumerate(PHASES + ("total",)):
        row = [statistics.median(sum(t) if phase == "total" else t[i] for t in times[n]) * 1e3
               for n in steps]
        print(f"{phase:<10}" + "".join(f"{v:>12.3f}" for v in row))
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            steps["dpfx"](*data)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(35)


if __name__ == "__main__":
    main()
