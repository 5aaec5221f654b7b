"""The per-sample Conv2d weight-gradient product: patches of the whole batch then one bmm, against
dpfx::conv2d_per_sample_grad's chunks of examples (Note [Per-sample conv2d gradients in chunks
of examples], dpfx/ops/conv.py), at several chunk sizes in bytes and at dpfx's own
(at least 8 examples up to 4 MiB), interleaved in one process;
with ``--orientation``, the op on the benchmark ResNet's nine convolutions with each chunk's
products taken as (C_resp, P) x (P, C*K) and transposed where dpfx takes them so (Note [The
per-sample conv2d product's orientation]).

    python benchmarks/conv_product.py                                  # markdown table to stdout
    python benchmarks/conv_product.py --out benchmarks/out/conv_product.md
    python benchmarks/conv_product.py --orientation --batch 256

Each cell is the minimum over ``--repeats`` rounds of the median of ``--calls`` calls (ms); the
rounds alternate the variants, so load drift hits all of them alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run import machine_info  # noqa: E402

from dpfx.ops import conv as conv_kernels  # noqa: E402

# (B, C_in, H = W, C_out, stride): the benchmark CNN's three layers at B = 32, then layers of
# CIFAR-sized ResNets whose patches reach tens of MiB.
SHAPES = [(32, 3, 32, 32, 2), (32, 32, 16, 64, 2), (32, 64, 8, 64, 2),
          (64, 64, 16, 64, 1), (32, 64, 32, 128, 1)]
CHUNKS_MIB = (1, 2, 4, 16)


def _median_ms(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run(repeats: int, calls: int) -> str:
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    rows = []
    default = conv_kernels._CHUNK_BYTES
    default_chunk = conv_kernels._CHUNK_BYTES, conv_kernels._CHUNK_MIN_EXAMPLES
    for batch, c_in, size, c_out, stride in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(batch, c_in, size, size)
        out_size = (size + 2 - 3) // stride + 1
        response = torch.randn(batch, c_out, out_size * out_size)
        args = ([3, 3], [1, 1], [1, 1], [stride, stride])

        def whole():
            patches = torch.ops.dpfx.im2col(x, *args)
            return torch.bmm(response, patches.transpose(1, 2))

        variants = {"whole batch": whole}
        for mib in CHUNKS_MIB:
            def chunked(mib=mib):
                conv_kernels._CHUNK_BYTES = mib << 20
                conv_kernels._CHUNK_MIN_EXAMPLES = 1
                return torch.ops.dpfx.conv2d_per_sample_grad(response, x, *args, 1)
            variants[f"{mib} MiB chunks"] = chunked

        def dpfx_chunks():
            conv_kernels._CHUNK_BYTES, conv_kernels._CHUNK_MIN_EXAMPLES = default_chunk
            return torch.ops.dpfx.conv2d_per_sample_grad(response, x, *args, 1)
        variants["dpfx's chunks (8 examples up to 4 MiB, else 1 MiB)"] = dpfx_chunks
        torch.testing.assert_close(variants[f"{CHUNKS_MIB[0]} MiB chunks"](), whole())
        n = max(5, calls // max(1, batch * c_in * size * size // 200_000))
        best = {k: float("inf") for k in variants}
        for _ in range(repeats):
            for name, fn in variants.items():
                best[name] = min(best[name], _median_ms(fn, n))
        conv_kernels._CHUNK_BYTES, conv_kernels._CHUNK_MIN_EXAMPLES = default_chunk
        patches_mib = batch * c_in * 9 * out_size ** 2 * 4 / 2 ** 20
        rows.append((f"B={batch}, {c_in}->{c_out}, {size}x{size}, stride {stride}",
                     patches_mib, best))
    names = list(rows[0][2])
    info = machine_info(torch.get_num_threads())
    lines = [f"`python benchmarks/conv_product.py` at dpfx {info.get('dpfx_commit', '?')}: "
             f"{info['cpu']}, {info['torch_threads']} threads, torch {info['torch']}; "
             f"load {open('/proc/loadavg').read().split()[0]} at the end; "
             f"dpfx's default chunk {default >> 20} MiB; ms",
             "", "| conv (3x3, padding 1) | patches (MiB) | " + " | ".join(names) + " |",
             "|---|---:|" + "---:|" * len(names)]
    for label, mib, best in rows:
        lines.append(f"| {label} | {mib:.1f} | " + " | ".join(f"{best[k]:.2f}" for k in names)
                     + " |")
    return "\n".join(lines) + "\n"


# (C_in, C_out, H = W of the input, stride, kernel): models.ResNetGN's convolutions
RESNET = [(3, 16, 32, 1, 3), (16, 16, 32, 1, 3), (16, 16, 32, 1, 3), (16, 32, 32, 2, 3),
          (32, 32, 16, 1, 3), (16, 32, 32, 2, 1), (32, 64, 16, 2, 3), (64, 64, 8, 1, 3),
          (32, 64, 16, 2, 1)]


def orientation(batch: int, repeats: int, calls: int) -> str:
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    default = conv_kernels._TRANSPOSED_PRODUCT
    lines, totals = [], {False: 0.0, True: 0.0}
    for c_in, c_out, size, stride, k in RESNET:
        torch.manual_seed(0)
        pad, out_size = k // 2, (size + 2 * (k // 2) - k) // stride + 1
        x = torch.randn(batch, c_in, size, size)
        response = torch.randn(batch, c_out, out_size * out_size)
        args = ([k, k], [1, 1], [pad, pad], [stride, stride])

        def op(transposed):
            conv_kernels._TRANSPOSED_PRODUCT = transposed
            return torch.ops.dpfx.conv2d_per_sample_grad(response, x, *args, 1)
        torch.testing.assert_close(op(True), op(False))
        best = {False: float("inf"), True: float("inf")}
        for _ in range(repeats):
            for transposed in best:
                best[transposed] = min(best[transposed],
                                       _median_ms(lambda: op(transposed), calls))
        for transposed in best:
            totals[transposed] += best[transposed]
        lines.append(f"| {c_in}->{c_out}, {k}x{k}, {size}x{size}, stride {stride} | "
                     f"{best[False]:.2f} | {best[True]:.2f} |")
    conv_kernels._TRANSPOSED_PRODUCT = default
    info = machine_info(torch.get_num_threads())
    head = [f"`python benchmarks/conv_product.py --orientation --batch {batch}` at dpfx "
            f"{info.get('dpfx_commit', '?')}: {info['cpu']}, {info['torch_threads']} threads, "
            f"torch {info['torch']}; load {open('/proc/loadavg').read().split()[0]} at the end; "
            f"ms, the minimum over {repeats} rounds of the median of {calls} calls", "",
            "| conv | (C_resp, P) x (P, C*K) | dpfx's orientation |", "|---|---:|---:|"]
    return "\n".join(head + lines + [f"| all nine | {totals[False]:.1f} | {totals[True]:.1f} |"]) \
        + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--orientation", action="store_true")
    parser.add_argument("--batch", type=int, default=256, help="with --orientation")
    parser.add_argument("--out")
    args = parser.parse_args()
    table = (orientation(args.batch, args.repeats, min(args.calls, 10)) if args.orientation
             else run(args.repeats, args.calls))
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
