"""The work a DP step adds to the non-private step, counted (not timed), per benchmark model.

    python benchmarks/dp_work.py                  # the flop-counted models at their first B
    python benchmarks/dp_work.py --out benchmarks/out/dp_work.md

For each model: the non-private step's flops (torch.utils.flop_counter over the eager forward,
loss and backward), and what dpfx's graph adds to it, from the per-parameter costs its rules
report (``dpfx.explain``'s table, evaluated at the batch size):
- ghost parameters: the per-sample norm's own flops (Gram matrices, or ||a||^2 ||g||^2), over
  the book-keeping product that replaces the weight gradient at the same cost;
- materialized parameters: the per-sample product replaces the weight-gradient product at the
  same flops, and the (B, *shape) per-sample gradients are read twice more (the norm and the
  clipped sum), counted as 2 flops an element;
- the noise: one normal per trainable parameter (drawn by the C kernel, not counted as flops)
  and the noisy gradient's pass over the parameters.
The embedding model and the LSTM are left out by default: their non-private kernels (the
embedding's backward scatter, ATen's fused LSTM) have no flop formula in torch's counter, and
their steps are bound by memory traffic, not flops. This is the floor the targets are read
against: a step whose extra flops are a fifth of its own
cannot run at 1.1x in a compute-bound regime, and a small step is bound by per-call costs instead
(benchmarks/phases.py).
"""
from __future__ import annotations

import argparse
import os
import sys

import sympy
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import DEFAULT_MODELS, MODELS, build, forward, loss_fn  # noqa: E402


def step_flops(name: str, B: int) -> int:
    model, x, y = build(name, B)
    with FlopCounterMode(display=False) as counter:
        loss_fn(forward(model, x), y).backward()
    return counter.get_total_flops()


def dp_extra(name: str, B: int) -> dict:
    """Extra flops of dpfx's per-sample norms and clipped sums, and the trainable parameter
    count (the noise), from the rules' symbolic costs at batch size B."""
    import dpfx

    model, x, y = build(name, B)
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=B,
                      backend="eager")
    loss_fn(forward(dp, x), y).backward()
    extra, ghost, materialized = 0.0, 0, 0
    for pg in dp._dpfx_backend.param_grads:
        for cost in pg.costs:
            at_b = {k: _at(v, B) for k, v in cost.items() if k in (
                "flops", "memory", "ghost_flops", "ghost_memory")}
            if pg.strategy == "ghost" and "ghost_flops" in at_b:
                extra += max(at_b["ghost_flops"] - at_b["flops"], 0)
            else:
                extra += 2 * at_b["memory"]
        ghost += pg.strategy == "ghost"
        materialized += pg.strategy != "ghost"
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"extra_flops": extra, "params": params, "ghost": ghost, "materialized": materialized}


def _at(expr, B: int) -> float:
    expr = sympy.sympify(expr)
    return float(expr.subs({s: B for s in expr.free_symbols}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", choices=list(MODELS),
                    default=[m for m in DEFAULT_MODELS if m not in ("embedding", "lstm")])
    ap.add_argument("--out")
    args = ap.parse_args()
    lines = ["| model | B | non-private step (MFLOP) | DP norms and sums (MFLOP) | extra "
             "| parameters (normals a step) | ghost / materialized parameters |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name in args.models:
        B = MODELS[name][2][0]
        base = step_flops(name, B)
        dp = dp_extra(name, B)
        lines.append(f"| {name} | {B} | {base / 1e6:.1f} | {dp['extra_flops'] / 1e6:.1f} | "
                     f"{dp['extra_flops'] / base:.1%} | {dp['params']:,} | "
                     f"{dp['ghost']} / {dp['materialized']} |")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
