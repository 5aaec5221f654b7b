"""Where a training step's time goes: forward call, loss, backward, optimizer step, for dpfx and
non-private torch.compile of the same model and batch, interleaved in one process.

    python benchmarks/phases.py mlp 64            # medians of 300 steps per method
    python benchmarks/phases.py gpt 16 --profile  # plus cProfile's top functions of dpfx's step
    python benchmarks/phases.py all --out benchmarks/out/phases.md   # every model at its first
                                                  # batch size, one markdown table

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
from models import DEFAULT_MODELS, MODELS, build, forward, loss_fn  # noqa: E402

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


def split(model_name: str, B: int, steps: int) -> dict:
    """{method: {phase: median ms}} for one model, the methods' steps interleaved."""
    run, data = {}, None
    for name in ("compile", "dpfx"):
        model, x, y = build(model_name, B)
        data = (x, y)
        run[name] = stepper(name, model, B)
        for _ in range(3):
            run[name](x, y)
    times = {name: [] for name in run}
    for _ in range(steps):
        for name, step in run.items():
            times[name].append(step(*data))
    return {name: {phase: statistics.median(sum(t) if phase == "total" else t[i]
                                            for t in times[name]) * 1e3
                   for i, phase in enumerate(PHASES + ("total",))} for name in run}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="a model of benchmarks/models.py, or 'all'")
    ap.add_argument("B", type=int, nargs="?", help="batch size (default: the model's first)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", help="write the table (markdown) here too")
    args = ap.parse_args()
    names = list(DEFAULT_MODELS) if args.model == "all" else [args.model]
    lines = [f"Phase medians (ms) of {args.steps} interleaved steps, torch threads "
             f"{torch.get_num_threads()}; base: non-private torch.compile.", "",
             "| model | B | method | " + " | ".join(PHASES) + " | total |",
             "|---|---:|---|" + "---:|" * (len(PHASES) + 1)]
    for name in names:
        B = args.B or MODELS[name][2][0]
        result = split(name, B, args.steps)
        for method, phases in result.items():
            lines.append(f"| {name} | {B} | {method} | "
                         + " | ".join(f"{phases[p]:.3f}" for p in PHASES + ("total",)) + " |")
        print("\n".join(lines[-2:]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.profile:
        B = args.B or MODELS[names[0]][2][0]
        model, x, y = build(names[0], B)
        step = stepper("dpfx", model, B)
        for _ in range(3):
            step(x, y)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            step(x, y)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(35)


if __name__ == "__main__":
    main()
