"""What the memory layout costs ATen's convolution backward on the benchmark CNN's shapes.

    python benchmarks/conv_layout.py                 # B = 32, the quick run's CNN batch
    python benchmarks/conv_layout.py --batch 64 --reps 50
    python benchmarks/conv_layout.py --step 32      # and whole CNN steps, layout changes by
                                                    # dpfx's kernel against ATen's copies

dpfx's graphs keep convolutions in the default (NCHW) layout: with the batch unbacked, torch
traces a convolution's output as contiguous while the kernel returns channels-last for a
channels-last input (dpfx refuses such inputs, compiled_call.py), and Inductor's layout
optimization, which converts a convolution's operands to channels-last, miscompiles Conv2d then
(lower/inductor.py, INDUCTOR_PATCHES). Non-private torch.compile with static shapes runs every
convolution channels-last. This script times the backward calls of both graphs on the CNN's shapes
(models.CNN: 3->32->64->64, 3x3, stride 2, on 32x32) in both layouts, one call at a time:
the allocator's peak during the call (its outputs and its scratch, via torch.profiler), and the
median time.

- input grad: ``output_mask=[True, False, False]``, dpfx's call for conv2 and conv3 (the weight
  gradients come from dpfx's per-sample or ghost rules);
- weight grad: ``[False, True, False]``, dpfx's ghost clipped sum (conv3);
- all: ``[True, True, True]``, the non-private backward's call;
- dpfx op: ``dpfx::conv2d_input_grad`` (Note [Conv2d input gradients in channels-last] in
  ops/conv.py), NCHW in and out, channels-last inside; "ATen's layout copies": the same
  with its two layout changes by ATen's copy instead of dpfx's transpose kernel.

The script imports dpfx (and with it Inductor), as a training process does: without that import
the NCHW calls ran 2-3x slower here, since glibc then returns their large scratch buffers to the
OS and faults the pages in again on every call.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))

import dpfx  # noqa: F401,E402  (dpfx::conv2d_input_grad; Inductor's import, as in training)

CL = torch.channels_last
# (name, C_in, C_out, input side): models.CNN's convolutions, 3x3, stride 2, padding 1
CONVS = [("conv2", 32, 64, 16), ("conv3", 64, 64, 8)]
MASKS = {"input grad": [True, False, False], "weight grad": [False, True, False],
         "all": [True, True, True]}


def peak_bytes(fn) -> int:
    fn()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def median_ms(fn, reps: int) -> float:
    for _ in range(10):     # oneDNN builds and caches its primitives on the first calls
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--step", type=int, metavar="B",
                    help="also time whole CNN steps at batch B with each layout change")
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"B={args.batch}, torch {torch.__version__}, {args.threads} threads\n")
    print("| conv | call | layout | peak during the call (MB) | median (ms) |")
    print("|---|---|---|---:|---:|")
    for name, c_in, c_out, side in CONVS:
        g = torch.randn(args.batch, c_out, side // 2, side // 2)
        x = torch.randn(args.batch, c_in, side, side)
        w = torch.randn(c_out, c_in, 3, 3)
        for call, mask in MASKS.items():
            for layout, (gg, xx, ww) in (("NCHW", (g, x, w)), ("channels-last", tuple(
                    t.contiguous(memory_format=CL) for t in (g, x, w)))):
                def run():
                    return torch.ops.aten.convolution_backward(
                        gg, xx, ww, [c_out], (2, 2), (1, 1), (1, 1), False, (0, 0), 1, mask)
                print(f"| {name} | {call} | {layout} | {peak_bytes(run) / 1e6:.3f} | "
                      f"{median_ms(run, args.reps):.3f} |", flush=True)

        def op():
            return torch.ops.dpfx.conv2d_input_grad(g, x, w, [2, 2], [1, 1], [1, 1], 1)
        print(f"| {name} | input grad | dpfx op | {peak_bytes(op) / 1e6:.3f} | "
              f"{median_ms(op, args.reps):.3f} |", flush=True)
        with aten_layout_copies():
            print(f"| {name} | input grad | dpfx op, ATen's layout copies | "
                  f"{peak_bytes(op) / 1e6:.3f} | {median_ms(op, args.reps):.3f} |", flush=True)
    if args.step:
        import step_ab
        print()
        print(step_ab.table("cnn", args.step, {
            "dpfx": ("dpfx", step_ab.nothing),
            "dpfx, ATen's layout copies": ("dpfx", aten_layout_copies)}, args.rounds))


@contextlib.contextmanager
def aten_layout_copies():
    """dpfx::conv2d_input_grad's NCHW <-> channels-last changes by ATen's copies instead of
    dpfx's transpose kernel (csrc/transpose.c)."""
    from dpfx.ops import conv as conv_kernels

    own = conv_kernels._in_layout
    conv_kernels._in_layout = lambda x, memory_format: x.contiguous(memory_format=memory_format)
    try:
        yield
    finally:
        conv_kernels._in_layout = own


if __name__ == "__main__":
    main()
