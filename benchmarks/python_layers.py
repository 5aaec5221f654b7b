"""What dpfx's Python around the graphs costs inside a training loop, layer by layer.

    python benchmarks/python_layers.py                      # mlp and hf_gpt2 at their quick B
    python benchmarks/python_layers.py --models gpt --rounds 40 --out out.md

Timing a piece of Python alone understates what it costs in a training step: between two calls
the kernels evict the interpreter's working set from the caches, so the same code runs several
times slower in the loop than in a micro-benchmark (here, 15-25 us alone against 0.1-0.25 ms in
the loop for the context managers that session 15 moved out of the steady-state call). This
script therefore times whole steps, in one process, in interleaved blocks, of:

- non-private ``torch.compile`` (the baseline);
- dpfx as users run it;
- ``-loss``: dpfx with its loss tracking and loss check switched off (the output is returned
  untracked and the backward is let through as if the loss had been checked);
- ``-loss -hooks``: and the per-parameter gradient hooks removed as well;
- ``setup per call``: dpfx with the settings only a capture reads (Note [Settings only a capture
  reads] in dpfx/api.py) set up around every call, as before session 15 (the path dpfx takes
  under a non-default ``torch.compiler`` stance): what moving them into dynamo's callback saved.

The two variants switch privacy checks off: they exist only to measure what those checks cost,
here, and nothing else may run dpfx that way. The difference between two rows is that layer's
cost in the loop (median of ``--rounds`` blocks of 10 steps per method).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

DEFAULT_MODELS = ("mlp", "hf_gpt2")


def _steps(name: str, B: int):
    """{variant: step function} for one model, each on its own copy of the model."""
    import torch

    import dpfx
    from dpfx import api
    from models import build, forward, loss_fn

    def baseline():
        model, x, y = build(name, B)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        compiled = torch.compile(model)

        def step():
            loss_fn(forward(compiled, x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    real_track = api.track
    real_stance = api._default_stance

    def private(level: int):
        model, x, y = build(name, B)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=B)
        backend = dp._dpfx_backend

        def step():
            loss_fn(forward(dp, x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        if level >= 2:      # measurement only: the gradient guards off
            for handle in list(dp._grad_guards.values()):
                handle.remove()
            dp.__dict__["_all_guarded"] = True
            dp._ledger.vouches = lambda name, grad: True

        def run():
            if level >= 1:  # measurement only: the loss check off
                api.track = lambda out, *args: out
                backend.loss_released = True
            if level < 0:   # the capture settings around every call
                api._default_stance = lambda: False
            try:
                step()
            finally:
                api.track = real_track
                api._default_stance = real_stance
                backend.loss_released = False
        return run

    return {"torch.compile": baseline(), "dpfx": private(0), "-loss": private(1),
            "-loss -hooks": private(2), "setup per call": private(-1)}


def measure(name: str, B: int, rounds: int) -> dict[str, float]:
    steps = _steps(name, B)
    times = {k: [] for k in steps}
    for step in steps.values():
        for _ in range(5):
            step()
    for _ in range(rounds):
        for k, step in steps.items():
            step()      # untimed: the first step after another variant is cache-cold
            for _ in range(10):
                t0 = time.perf_counter()
                step()
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--out")
    args = parser.parse_args()

    import torch
    torch.set_num_threads(2)
    from models import MODELS
    from run import machine_info

    info = machine_info(torch.get_num_threads())

    lines = ["# dpfx's Python layers in the training loop", "",
             f"Command: `python benchmarks/python_layers.py {' '.join(sys.argv[1:])}`".rstrip(),
             f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']} "
             f"({info['torch_threads']} threads), Python {info['python']}  ",
             f"dpfx: commit {info.get('dpfx_commit', '?')}", "",
             "Median step (ms) of each variant, over --rounds interleaved blocks of 10 steps in "
             "one process; x: over torch.compile's. -loss and -loss -hooks switch privacy checks "
             "off, for this measurement only; setup per call is dpfx's path before session 15. "
             "The last three columns are differences of medians (ms).", "",
             "| model | B | torch.compile | dpfx | -loss | -loss -hooks | setup per call | "
             "loss check | hooks | setup per call - dpfx |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in args.models:
        B = MODELS[name][2][0]
        m = measure(name, B, args.rounds)
        base = m["torch.compile"]
        cell = lambda k: f"{m[k]:.2f} ({m[k] / base:.2f}x)"  # noqa: E731
        lines.append(f"| {name} | {B} | {base:.2f} | {cell('dpfx')} | {cell('-loss')} | "
                     f"{cell('-loss -hooks')} | {cell('setup per call')} | "
                     f"{m['dpfx'] - m['-loss']:+.2f} | {m['-loss'] - m['-loss -hooks']:+.2f} | "
                     f"{m['setup per call'] - m['dpfx']:+.2f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
