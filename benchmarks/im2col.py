"""dpfx's C im2col (``dpfx/csrc/im2col.c``) against ATen's im2col, and against the same kernel at
another git revision, on the benchmark CNN's three layers and a few larger ones, interleaved in
one process.

    python benchmarks/im2col.py                       # markdown table to stdout
    python benchmarks/im2col.py --against 5ac0538     # adds that revision's kernel as a column
    python benchmarks/im2col.py --against 5ac0538 --step 32   # and whole CNN steps with each

``--step B`` also times whole DP-SGD steps of the benchmark CNN at batch B (dpfx with the
current kernel, dpfx with the revision's, the latter with the input-gradient op's layout changes
by ATen's copies as well (``conv_layout.py``), non-private torch.compile), interleaved over
``--rounds`` rounds: what the kernels are worth in the step.

``--against`` builds the revision's ``csrc/im2col.c`` with ``dpfx/ops/native.py``'s compiler and
flags, under its own symbol names, and checks that it and the current kernel give ATen's values
bit for bit before timing. Each cell is the minimum over ``--repeats`` rounds of the median of
``--calls`` calls (ms), every call allocating its output as the op does.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run import machine_info  # noqa: E402

from dpfx.ops import native  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# (B, C, H = W, stride): the benchmark CNN's three 3x3 layers at B = 32, the same at stride 1,
# then a CIFAR ResNet layer and an ImageNet-sized stem
SHAPES = [(32, 3, 32, 2), (32, 32, 16, 2), (32, 64, 8, 2), (32, 32, 16, 1), (32, 64, 8, 1),
          (64, 64, 16, 1), (8, 3, 224, 2)]


class OtherBuild:
    """csrc/im2col.c as it was at ``revision``, under its own symbol names. Kernels from before
    the caller-allocated scratch (csrc/im2col.c's ``scratch`` argument) take no scratch: ``kernel``
    drops it from the current signature's arguments."""

    def __init__(self, revision: str):
        source = subprocess.run(["git", "show", f"{revision}:dpfx/csrc/im2col.c"], cwd=ROOT,
                                check=True, capture_output=True, text=True).stdout
        self.takes_scratch = "scratch" in source
        work = tempfile.mkdtemp()
        c_path, so_path = os.path.join(work, "im2col.c"), os.path.join(work, "im2col.so")
        with open(c_path, "w") as f:
            f.write(source.replace("dpfx_im2col_", "other_im2col_"))
        subprocess.run([native._compiler(), *native._FLAGS, c_path, "-o", so_path], check=True)
        self.lib = ctypes.CDLL(so_path)

    def kernel(self, name: str):
        """The revision's ``name`` (dpfx_im2col_f32 or _f64), called as the current one is."""
        fn = getattr(self.lib, name.replace("dpfx_im2col_", "other_im2col_"))
        fn.restype = None
        if self.takes_scratch:
            fn.argtypes = getattr(native.library(), name).argtypes
            return fn
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 14, ctypes.c_int]
        return lambda *args: fn(*args[:-2], args[-1])


def _caller(fn):
    """fn (a kernel with the current signature) as ATen's im2col is called."""
    def call(x, kernel, dilation, padding, stride):
        b, c, h, w = x.shape
        oh, ow = ((size + 2 * p - d * (k - 1) - 1) // s + 1
                  for size, k, d, p, s in zip((h, w), kernel, dilation, padding, stride))
        out = x.new_empty(b, c * kernel[0] * kernel[1], oh * ow)
        threads = torch.get_num_threads()
        phases = math.prod(-(-(size + 2 * p) // s) * s
                           for size, p, s in zip((h, w), padding, stride))
        scratch = x.new_empty(threads * phases)
        fn(x.data_ptr(), out.data_ptr(), b, c, h, w, *kernel, *dilation, *padding, *stride, oh,
           ow, scratch.data_ptr(), threads)
        return out
    return call


def _median_ms(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def step_table(against: str, batch: int, rounds: int) -> str:
    """Whole CNN steps with the current kernel and with ``against``'s (step_ab.py)."""
    import step_ab

    current, other = native.library(), OtherBuild(against)

    lookups = [0]

    class WithOther:    # the loaded kernels, with im2col taken from the other build
        def __getattr__(self, name):
            if name.startswith("dpfx_im2col_"):
                lookups[0] += 1
                return other.kernel(name)
            return getattr(current, name)

    own = native.library    # the cached loader itself: native.library is what gets patched

    @contextlib.contextmanager
    def other_im2col():
        native.library = WithOther
        try:
            yield
        finally:
            native.library = own

    @contextlib.contextmanager
    def other_im2col_and_aten_copies():    # both kernels undone (im2col and layout transpose)
        from conv_layout import aten_layout_copies
        with other_im2col(), aten_layout_copies():
            yield

    table = step_ab.table("cnn", batch, {
        "dpfx": ("dpfx", step_ab.nothing),
        f"dpfx, im2col at {against}": ("dpfx", other_im2col),
        f"dpfx, im2col at {against}, ATen's layout copies": ("dpfx",
                                                             other_im2col_and_aten_copies)},
        rounds)
    assert native.library is own and lookups[0] > 0
    return table + (f"\nThe other build's im2col was called {lookups[0]} times (the two "
                    f"variants' steps, warm-up included), the current one's in the rest.\n")


def run(repeats: int, calls: int, against: str | None) -> str:
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if native.library() is None:
        raise SystemExit(f"dpfx's kernels are unavailable: {native.why_unavailable()}")
    variants = {"ATen": torch.ops.aten.im2col.default,
                "dpfx": _caller(native.library().dpfx_im2col_f32)}
    if against:
        variants[f"dpfx at {against}"] = _caller(OtherBuild(against).kernel("dpfx_im2col_f32"))
    rows = []
    for batch, channels, size, stride in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(batch, channels, size, size)
        args = ([3, 3], [1, 1], [1, 1], [stride, stride])
        expected = torch.ops.aten.im2col.default(x, *args)
        for name, fn in variants.items():
            assert torch.equal(fn(x, *args), expected), name
        best = {name: float("inf") for name in variants}
        for _ in range(repeats):
            for name, fn in variants.items():
                best[name] = min(best[name], _median_ms(lambda: fn(x, *args), calls))
        mib = expected.numel() * expected.element_size() / 2**20
        rows.append(f"| {batch} x {channels} x {size}^2, stride {stride} | {mib:.2f} | "
                    + " | ".join(f"{best[name]:.3f}" for name in variants) + " |")
    header = ("| input (3x3, padding 1) | patches (MiB) | "
              + " | ".join(f"{name} (ms)" for name in variants) + " |")
    argv = sys.argv[1:]
    if "--out" in argv:     # a path of this machine: not part of the command as reported
        del argv[argv.index("--out"):argv.index("--out") + 2]
    command = " ".join(["python benchmarks/im2col.py", *argv])
    info = machine_info(torch.get_num_threads())
    dirty = " (uncommitted changes)" if info.get("dpfx_uncommitted") else ""
    return "\n".join([
        "# im2col: dpfx's C kernel against ATen's", "",
        f"Command: `{command}` at dpfx {info.get('dpfx_commit', '?')}{dirty}  ",
        f"Machine: {info['cpu']}, {info['torch_threads']} threads, torch {info['torch']}; "
        f"load {open('/proc/loadavg').read().split()[0]} at the end; float32; each cell the "
        f"minimum over {repeats} interleaved rounds of the median of {calls} calls.", "",
        header, "|---|---:|" + "---:|" * len(variants), *rows, ""])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--against", help="a git revision whose csrc/im2col.c to time as well")
    parser.add_argument("--step", type=int, metavar="B",
                        help="with --against: also time whole CNN steps at this batch size")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out", help="write the table here as well as to stdout")
    args = parser.parse_args()
    if args.step and not args.against:
        parser.error("--step needs --against")
    table = run(args.repeats, args.calls, args.against)
    if args.step:
        table += "\n" + step_table(args.against, args.step, args.rounds)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table)


if __name__ == "__main__":
    main()
