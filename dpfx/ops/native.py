"""dpfx's C kernels (``csrc/*.c``), built once per machine and loaded with ctypes.

The kernels are plain C with OpenMP, compiled with the C compiler Inductor's CPU backend already
needs (``DPFX_CC``, else ``CC``, else ``gcc``) into one shared library cached under
``DPFX_CACHE_DIR`` (default ``~/.cache/dpfx``), keyed by the sources, the flags, the compiler and
the CPU. No torch C++ extension is built: that costs a minute of compile on the first import, and
ctypes calls are cheap next to the kernels. Each caller has a fallback for ``library() is None``
(no compiler, or the build failed): the same values from ATen, slower (cpu_noise, rules/
convolution). ``why_unavailable()`` says why.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

_SOURCES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "csrc", "*.c")))
# -mprefer-vector-width=256: with -march=native GCC tunes some AVX2 CPUs (AMD Zen 1) for 128-bit
# vectors, and the Box-Muller loop then calls libmvec's SSE logf/cosf, about 1.5 times slower
# than with 256-bit vectors (the same values). Where 512-bit registers exist
# the noise kernel uses them regardless (Philox through intrinsics, Box-Muller by a pragma in
# csrc/philox_normal.c).
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=256", "-ffast-math", "-fopenmp",
          "-shared", "-fPIC"]

_I64, _U64, _F64, _PTR, _INT = (ctypes.c_int64, ctypes.c_uint64, ctypes.c_double,
                                ctypes.c_void_p, ctypes.c_int)
# name -> argument types (every kernel returns void)
_SIGNATURES = {
    "dpfx_philox_normal": [_PTR, _I64, _U64, _INT],
    "dpfx_philox4x32_10": [_PTR, _PTR, _PTR],
    "dpfx_philox_add_noise_f32": [_PTR, _PTR, _I64, _U64, _F64, _F64, _F64, _INT],
    "dpfx_philox_add_noise_f64": [_PTR, _PTR, _I64, _U64, _F64, _F64, _F64, _INT],
    "dpfx_im2col_f32": [_PTR, _PTR, *[_I64] * 14, _PTR, _INT],
    "dpfx_im2col_f64": [_PTR, _PTR, *[_I64] * 14, _PTR, _INT],
    "dpfx_transpose_f32": [_PTR, _PTR, _I64, _I64, _I64, _INT],
    "dpfx_transpose_f64": [_PTR, _PTR, _I64, _I64, _I64, _INT],
}

_why: list[str] = []


def _compiler() -> str | None:
    for name in (os.environ.get("DPFX_CC"), os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built (``why_unavailable()``)."""
    cc = _compiler()
    if cc is None:
        _why.append("no C compiler found (set DPFX_CC)")
        return None
    sources = []
    for path in _SOURCES:
        with open(path, "rb") as f:
            sources.append(f.read())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([*sources, " ".join(_FLAGS).encode(), version.encode(),
                                     platform.machine().encode(), _cpu_id().encode()]))
    cache = os.environ.get("DPFX_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "dpfx")
    path = os.path.join(cache, f"dpfx_kernels_{key.hexdigest()[:20]}.so")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        # Build beside the target and rename: concurrent processes (torchrun ranks) never load
        # a half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        result = subprocess.run([cc, *_FLAGS, "-x", "c", *_SOURCES, "-o", tmp, "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            _why.append(f"{cc} failed: {result.stderr.strip()[-500:]}")
            return None
        os.replace(tmp, path)
    lib = ctypes.CDLL(path)
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return lib


def why_unavailable() -> str:
    return _why[-1] if _why else "unknown"
