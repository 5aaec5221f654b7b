"""Whole training steps of one benchmark model under several variants of dpfx, interleaved in
one process: what a kernel or a code path is worth inside the step, where caches are colder
than in a loop over one call.

A variant is a name, the method that builds its step (``methods.METHODS``) and a context-manager
factory entered around building and around every one of its steps (the switch it measures:
a patched function, another kernel library). ``rounds`` rounds each run one step of every
variant in turn, so load drift falls on all of them alike. Used by ``im2col.py --step`` and
``conv_layout.py --step``.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, ContextManager

import methods
import models

Variant = tuple[str, Callable[[], ContextManager]]   # (method name, switch)


def nothing() -> ContextManager:
    return contextlib.nullcontext()


def table(model: str, batch: int, variants: dict[str, Variant], rounds: int,
          baseline: str = "compile") -> str:
    """Median and min step (ms) of every variant and of the baseline method, as markdown."""
    everything = {**variants, f"non-private {baseline}": (baseline, nothing)}
    steps, x, y = {}, None, None
    for name, (method, switch) in everything.items():
        net, x, y = models.build(model, batch)
        with switch():
            steps[name] = methods.make(method, net, batch, x, y).step
            for _ in range(3):
                steps[name](x, y)
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            with everything[name][1]():
                start = time.perf_counter()
                step(x, y)
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times[f"non-private {baseline}"])
    rows = [f"| {name} | {statistics.median(t) * 1e3:.2f} | {min(t) * 1e3:.2f} | "
            f"{statistics.median(t) / base:.2f} |" for name, t in times.items()]
    return "\n".join([f"Whole steps of the benchmark {model} at B={batch}, {rounds} interleaved "
                      f"rounds:", "", f"| variant | median step (ms) | min (ms) | x {baseline} |",
                      "|---|---:|---:|---:|", *rows, ""])
