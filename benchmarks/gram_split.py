"""The ghost norm's Gram products: the full form against splits that use the Grams' symmetry.

    python benchmarks/gram_split.py                       # B=16, T=64, the GPT rows' layer widths
    python benchmarks/gram_split.py --B 8 --T 32 --shapes 64x192 64x256 256x64

For a Linear layer with input rows x_b (T, din) and output-gradient rows g_b (T, dout) per
example b, the squared norm of b's weight gradient is sum((g_b g_b^T) * (x_b x_b^T)) (the
ghost norm; dpfx's strategy "ghost"). Both Grams are symmetric, so with the T rows split into k
blocks only the k(k+1)/2 blocks on and above the diagonal are needed (off-diagonal ones counted
twice): 3/4 of the Gram flops for k=2, 10/16 for k=4. This script times, compiled by Inductor
(the same C++ backend dpfx lowers to), the full form and the 2- and 4-block splits, interleaved
(round-robin, --rounds rounds of --calls calls each, median per call), and prints each form's
time and the Gram products' useful rate in GFLOP/s (2*B*T*T*(din+dout) flops for the full form).
Session 16-17 question: is the transformer rows' remaining cost (the Grams' exact extra flops,
benchmarks/dp_work.py) reducible by doing fewer of them?
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def full(x, g):
    return ((g @ g.transpose(1, 2)) * (x @ x.transpose(1, 2))).sum((1, 2))


def split(k: int):
    def norm_sq(x, g):
        T = x.shape[1]
        step = T // k
        xs = [x[:, i * step:(i + 1) * step] for i in range(k)]
        gs = [g[:, i * step:(i + 1) * step] for i in range(k)]
        total = 0
        for i in range(k):
            for j in range(i, k):
                term = ((gs[i] @ gs[j].transpose(1, 2)) * (xs[i] @ xs[j].transpose(1, 2))).sum((1, 2))
                total = total + (term if i == j else 2 * term)
        return total
    return norm_sq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--shapes", nargs="+", default=["128x384", "128x128", "128x512", "512x128"],
                    help="DINxDOUT of the Linear layers")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    forms = {"full": full, "2 blocks": split(2), "4 blocks": split(4)}
    print(f"B={args.B} T={args.T} threads={args.threads} torch {torch.__version__}; "
          f"median us per call ({args.rounds} interleaved rounds x {args.calls} calls)\n")
    print("| din x dout | " + " | ".join(forms) + " | full form GFLOP/s |")
    print("|---|" + "---:|" * (len(forms) + 1))
    for shape in args.shapes:
        din, dout = (int(v) for v in shape.split("x"))
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(args.B, args.T, din, generator=gen)
        g = torch.randn(args.B, args.T, dout, generator=gen)
        compiled = {name: torch.compile(f, dynamic=False) for name, f in forms.items()}
        want = full(x, g)
        for name, f in compiled.items():
            got = f(x, g)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-3), name
        times = {name: [] for name in forms}
        for _ in range(args.rounds):
            for name, f in compiled.items():
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    f(x, g)
                times[name].append((time.perf_counter() - t0) / args.calls)
        med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        flops = 2 * args.B * args.T * args.T * (din + dout)
        rate = flops / (med["full"] * 1e-6) / 1e9
        print(f"| {din} x {dout} | " + " | ".join(f"{med[n]:.0f}" for n in forms)
              + f" | {rate:.0f} |")


if __name__ == "__main__":
    main()
