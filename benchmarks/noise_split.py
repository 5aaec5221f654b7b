"""Where the noise kernel's time goes: the Philox words against the Box-Muller transform.

    python benchmarks/noise_split.py                       # 1.28M and 301k samples, 1 and 2 threads
    python benchmarks/noise_split.py --sizes 1280000 --threads 1 2 4

DP-SGD draws one N(0, 1) sample per parameter per step, and on the small benchmark models that
draw is a fixed share of the step (run.py's "noise alone" column). This builds dpfx's own kernel
(``dpfx/csrc/philox_normal.c``, with the flags ``dpfx/native.py`` uses) into a small C program
beside a variant that runs the same Philox4x32-10 tiles and only folds the words together (no
Box-Muller), and prints the best of 30 runs of each: full sample, Philox alone, and the
difference, the transform. The variant is this script's, not dpfx's: the library never draws
words it does not transform.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <omp.h>

/* The kernel's tiling and Philox, without the transform: the words are xor-folded so that the
 * compiler keeps them. */
static void philox_only(uint32_t *sink, int64_t n, uint64_t key, int threads) {
    const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    const int64_t m = n / 4, blocks = m + (n % 4 != 0);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t lo = 0; lo < blocks; lo += BLOCKS_PER_TASK) {
        const int64_t count = lo + BLOCKS_PER_TASK < blocks ? BLOCKS_PER_TASK : blocks - lo;
        uint32_t x[4][BLOCKS_PER_TASK];
        philox_tile(x, lo, count, k0, k1, 0);
        uint32_t acc = 0;
        for (int64_t j = 0; j < count; j++) acc ^= x[0][j] ^ x[1][j] ^ x[2][j] ^ x[3][j];
        sink[16 * omp_get_thread_num()] ^= acc;
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char **argv) {
    const int64_t n = atoll(argv[1]);
    const int threads = atoi(argv[2]);
    float *out = malloc(4 * n);
    uint32_t sink[16 * 64] = {0};
    double full = 1e9, words = 1e9;
    for (int r = 0; r < 30; r++) {
        double t = now();
        dpfx_philox_normal(out, n, (uint64_t)r, threads);
        t = now() - t;
        if (t < full) full = t;
        t = now();
        philox_only(sink, n, (uint64_t)r, threads);
        t = now() - t;
        if (t < words) words = t;
    }
    printf("%.4f %.4f %u\n", 1e3 * full, 1e3 * words, sink[0] ^ (uint32_t)out[n / 2]);
    return 0;
}
"""


def main() -> None:
    from dpfx import native

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_280_000, 301_066])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    cc = native._compiler()
    if cc is None:
        sys.exit("no C compiler")
    flags = [f for f in native._FLAGS if f not in ("-shared", "-fPIC")]
    kernel = (ROOT / "dpfx" / "csrc" / "philox_normal.c").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "noise_split.c"), os.path.join(tmp, "noise_split")
        Path(src).write_text(kernel + HARNESS)
        subprocess.run([cc, *flags, src, "-o", exe, "-lm"], check=True)
        print(f"compiler {os.path.basename(cc)}, flags {' '.join(flags)}\n")
        print("| samples | threads | full (ms) | Philox words alone (ms) | Box-Muller (ms, the "
              "difference) | full, ns per sample per thread |")
        print("|---:|---:|---:|---:|---:|---:|")
        for n in args.sizes:
            for threads in args.threads:
                full, words, _ = subprocess.run([exe, str(n), str(threads)], check=True,
                                                capture_output=True, text=True).stdout.split()
                full, words = float(full), float(words)
                print(f"| {n} | {threads} | {full:.3f} | {words:.3f} | {full - words:.3f} | "
                      f"{1e6 * full * threads / n:.2f} |", flush=True)


if __name__ == "__main__":
    main()
