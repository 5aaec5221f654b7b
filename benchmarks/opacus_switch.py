"""Opacus's own example loops, run with Opacus and with dpfx.opacus: only the imports differ.

    python benchmarks/opacus_switch.py                  # all five, writes latest/opacus_switch.md
    python benchmarks/opacus_switch.py mnist imdb       # some of them

Each file in ``opacus_examples/`` holds an example's model and training loop as Opacus's
repository writes them, with synthetic data in place of the download and sizes scaled down
(256 examples, batches of 64, 3 epochs: 12 steps). For the dpfx run the harness rewrites the
source's ``from opacus`` imports to ``from dpfx.opacus`` and checks that no other line changed.
Both runs start from ``torch.manual_seed(0)`` (same weights, same data); each records the
epsilon its engine reports at the example's delta, and the cross-entropy on the whole
synthetic training set before and after training. dpfx runs through Inductor, its default, so
its time includes compiling.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
import types
import warnings

os.environ.setdefault("TQDM_DISABLE", "1")

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES_DIR = os.path.join(HERE, "opacus_examples")
EXAMPLES = {   # name -> what it exercises beyond make_private
    "mnist": "conv net, flat clipping, Poisson sampling",
    "cifar10": "conv net, SGD with momentum, per-layer clipping (a list of bounds)",
    "imdb": "embedding bag, Adam, poisson_sampling=False",
    "char_lstm": "DPLSTM (nn.LSTM in dpfx), NamesDataset, variable batches",
    "image_classifier": "ModuleValidator.fix, make_private_with_epsilon, BatchMemoryManager",
}


def source(name: str, library: str) -> str:
    """The example's source as it runs with ``library``: dpfx's differs in its imports only."""
    path = os.path.join(EXAMPLES_DIR, f"{name}.py")
    text = open(path).read()
    if library == "opacus":
        return text
    switched = text.replace("from opacus", "from dpfx.opacus")
    changed = [b for a, b in zip(text.splitlines(), switched.splitlines()) if a != b]
    assert changed and all(line.startswith("from dpfx.opacus") for line in changed), changed
    return switched


def load(name: str, library: str) -> types.ModuleType:
    if EXAMPLES_DIR not in sys.path:
        sys.path.insert(0, EXAMPLES_DIR)
    module = types.ModuleType(f"{name}_{library}")
    module.__file__ = os.path.join(EXAMPLES_DIR, f"{name}.py")
    sys.modules[module.__name__] = module      # torch.compile looks the model's globals up there
    exec(compile(source(name, library), module.__file__, "exec"), module.__dict__)
    return module


def run(name: str, library: str, **overrides) -> dict:
    """Run one example with one library: epsilon, losses, steps, seconds."""
    module = load(name, library)
    args = types.SimpleNamespace(**{**module.ARGS, **overrides})
    torch.manual_seed(0)
    printed = io.StringIO()
    start = time.perf_counter()
    with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
        warnings.simplefilter("ignore")
        engine, loss_before, loss_after = module.main(args)
    seconds = time.perf_counter() - start
    return {"epsilon": engine.get_epsilon(args.delta), "loss_before": loss_before,
            "loss_after": loss_after, "steps": sum(h[2] for h in engine.accountant.history),
            "seconds": seconds, "printed": printed.getvalue()}


def table(results: dict) -> str:
    rows = ["| example | exercises | steps | epsilon Opacus | epsilon dpfx | dpfx vs Opacus | "
            "loss Opacus (before -> after) | loss dpfx (before -> after) | s Opacus | s dpfx |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        o, d = r["opacus"], r["dpfx"]
        rows.append(
            f"| {name} | {EXAMPLES[name]} | {o['steps']} / {d['steps']} | {o['epsilon']:.4f} | "
            f"{d['epsilon']:.4f} | {100 * (d['epsilon'] / o['epsilon'] - 1):+.2f}% | "
            f"{o['loss_before']:.4f} -> {o['loss_after']:.4f} | "
            f"{d['loss_before']:.4f} -> {d['loss_after']:.4f} | {o['seconds']:.1f} | "
            f"{d['seconds']:.1f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"some of {list(EXAMPLES)} (default: all)")
    parser.add_argument("--out", default=os.path.join(HERE, "latest", "opacus_switch.md"))
    args = parser.parse_args()
    unknown = set(args.names) - set(EXAMPLES)
    if unknown:
        parser.error(f"unknown examples {sorted(unknown)}; choose from {list(EXAMPLES)}")
    args.names = args.names or list(EXAMPLES)
    import opacus

    results = {}
    for name in args.names:
        results[name] = {lib: run(name, lib) for lib in ("opacus", "dpfx")}
        print(table({name: results[name]}).splitlines()[-1], flush=True)
    text = (f"# Opacus's example loops, Opacus {opacus.__version__} against dpfx.opacus\n\n"
            f"`python benchmarks/opacus_switch.py` on {time.strftime('%Y-%m-%d')}, torch "
            f"{torch.__version__}, CPU ({os.cpu_count()} cores, shared). Only the imports "
            f"differ between the two runs of a row. Epsilon: Opacus's default accountant "
            f"(PRV) against dpfx's PLD, which it maps to; the image classifier's sigma is "
            f"calibrated by each library for epsilon 50 after its 3 epochs. Loss: cross-entropy "
            f"on the whole synthetic training set, same initial weights. Seconds include "
            f"dpfx's compiles (Inductor) and the accountants' epsilon calls.\n\n"
            + table(results) + "\n")
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
