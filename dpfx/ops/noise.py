"""Fast N(0, 1) noise on the CPU: a Philox4x32-10 + Box-Muller kernel in C, on every core.

    z = torch.ops.dpfx.standard_normal(1_000_000, "cpu")  # f32[1000000], keyed from torch's
                                                          # default CPU generator
    z = philox_normal(n, key)                             # the kernel, explicit 64-bit key

DP-SGD draws one Gaussian per parameter per step. ATen's CPU ``randn`` runs MT19937 on one
thread, which would make the noise the largest single cost of a small model's DP step, and most
of the step of a model whose parameters are mostly one embedding table. Inductor's own CPU Philox
is slower still (Note [Noise from ATen's generator on CPU] in backend/__init__.py). The kernel in
``csrc/philox_normal.c`` is counter-based, so its blocks are independent: it vectorizes (16 lanes
on AVX-512, 8 on AVX2) and splits across threads, and its output for a key does not depend on
the thread count (and the Philox words are the same integers on every instruction-set path).
Its speed against ATen's: BENCHMARKS.md ("The noise"; "Levers in the code").

# Note [Where the noise key comes from]
``dpfx::standard_normal`` draws its 64-bit Philox key from torch's default CPU generator, one
``random_`` per call. The backend reseeds that generator from the OS's CSPRNG before every step
(Note [Where the graph's noise seed comes from]) and restores it afterwards, so the noise is as
unpredictable as before and a user's ``seed`` still makes it reproducible. ``DPOptimizer`` draws its keys from its own generator. Philox, like MT19937, is
a statistical generator, not a cryptographic one: ``secure_mode`` (loop/noise.py) remains the answer to
an adversary who can see the generator.

The kernel is compiled once per machine (ops/native.py: the C compiler Inductor's CPU backend
already needs, cached under ``DPFX_CACHE_DIR``). Without a working compiler ``standard_normal``
falls back to ``torch.randn`` on the same generator, with a
``RuntimeWarning``: the same distribution at ATen's speed, never weaker noise.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import operator
import threading
import warnings

import torch

from dpfx.errors import DPFXWarning
from dpfx.ops import native


@functools.cache       # one warning per process
def _library() -> ctypes.CDLL | None:
    lib = native.library()
    return lib if lib is not None else _unavailable(native.why_unavailable())


class SlowNoiseWarning(DPFXWarning, RuntimeWarning):
    """dpfx's CPU noise kernel could not be built: noise comes from torch.randn (slower)."""


def _unavailable(why: str) -> None:
    warnings.warn(f"dpfx: the fast CPU noise kernel is unavailable ({why}); noise comes from "
                  f"torch.randn instead: the same distribution, slower", SlowNoiseWarning,
                  stacklevel=3)
    return None


def available() -> bool:
    return _library() is not None


def philox_normal(n: int, key: int) -> torch.Tensor:
    """f32[n] of N(0, 1) from the C kernel under the 64-bit ``key`` (see csrc/philox_normal.c)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the fast CPU noise kernel is unavailable")
    out = torch.empty(n, dtype=torch.float32)
    if n:
        lib.dpfx_philox_normal(out.data_ptr(), n, key & (2**64 - 1), torch.get_num_threads())
    return out


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, ...]:
    """One raw Philox4x32-10 block, for the known-answer tests."""
    lib = _library()
    ctr = (ctypes.c_uint32 * 4)(*counter)
    k = (ctypes.c_uint32 * 2)(*key)
    out = (ctypes.c_uint32 * 4)()
    lib.dpfx_philox4x32_10(ctr, k, out)
    return tuple(out)


def draw_key(generator: torch.Generator | None = None) -> int:
    """64 random bits from ``generator`` (torch's default CPU generator when None)."""
    word = torch.empty((), dtype=torch.int64).random_(-2**63, None, generator=generator)
    return int(word) & (2**64 - 1)


def gaussian(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """f32[n] of N(0, 1) on the CPU: the C kernel, or torch.randn where it cannot be built."""
    if _library() is None:
        return torch.randn(n, generator=generator, dtype=torch.float32)
    return philox_normal(n, draw_key(generator))


# Note [The noise op is a plain library op]
# The op is defined with torch.library.Library and one CompositeExplicitAutograd kernel rather
# than @custom_op: a custom_op runs Python autograd, backend-select and redispatch layers before
# the kernel, about three times the call's cost (the graph calls it once a step). It takes no
# tensor, so one kernel serves every dispatch key; register_fake gives its shape to fake tensors.
_LIBRARY = torch.library.Library("dpfx", "FRAGMENT")
_LIBRARY.define("standard_normal(SymInt n, Device device) -> Tensor",
                tags=(torch.Tag.nondeterministic_seeded,))


# Note [The self-check's backward runs without noise]
# The self-check (lower/selfcheck/) compares the compiled backward with the verified graph run
# eagerly, within a tolerance relative to each released gradient's norm. With the noise in that
# gradient the norm is the noise's, sigma C sqrt(n) / D for a parameter of n entries, while
# everything Inductor's code computes (norms, clip factors, clipped sums) adds up to at most
# B C / D: with a 2048 x 2048 weight a release off by a whole example's C / D passed
# (tests/lower/test_selfcheck.py::test_noise_does_not_hide_a_wrong_clipped_sum); on GPT-2 small, at
# sigma 1, the tolerance would be 3 C / D for an MLP weight and 12 C / D for the embedding. So the
# check's graph runs take place under ``noiseless()``, in which both noise ops add zero: the
# call, its scale and its division still run, and the comparison sees the clipped sums alone.
# The flag is thread-local: a training step on another thread while a model's first call
# checks itself keeps its noise. That the graph adds noise of the configured scale is the
# verifier's proof (check_release in passes/verify/release.py); the draw itself is dpfx's
# kernel, not code Inductor generates.
_state = threading.local()


@contextlib.contextmanager
def noiseless():
    """Both noise ops add zero on this thread (the self-check's runs; see the Note above)."""
    before = getattr(_state, "noiseless", False)
    _state.noiseless = True
    try:
        yield
    finally:
        _state.noiseless = before


def silenced() -> bool:
    """Whether this thread is inside ``noiseless()``."""
    return getattr(_state, "noiseless", False)


def standard_normal(n: int, device: torch.device) -> torch.Tensor:
    """f32[n] of N(0, 1), keyed from torch's default CPU generator: the graph's noise on CPU
    (zeros under ``noiseless()``)."""
    if silenced():
        return torch.zeros(n, dtype=torch.float32)
    return gaussian(n)


_LIBRARY.impl("standard_normal", standard_normal, "CompositeExplicitAutograd")


@torch.library.register_fake("dpfx::standard_normal", lib=_LIBRARY)
def _(n, device):
    return torch.empty(n, dtype=torch.float32, device=device)


# Note [Noise added in place]
# ``dpfx::add_noise_(sums, std, multiplier, divisor)`` is the release of a CPU graph:
# every sum s_t becomes ((s_t + std * z_t) * multiplier) / divisor in place, z_t i.i.d. N(0, 1),
# in one pass that draws the normals in registers (csrc/philox_normal.c). The graph drew one
# parameter-sized buffer of normals, then read it back beside each clipped sum in a pointwise
# kernel that wrote a third buffer (and Inductor turned add(mm, noise) into an addmm that copied
# the noise first): three parameter-sized passes and two live buffers more than the step needs.
# One call serves every parameter of a backward graph under one 64-bit key drawn from torch's
# default CPU generator (Note [Where the noise key comes from]); tensor t of the call takes the
# Philox stream t, so no two tensors share a counter. The graph holds the op functionally, as
# ``auto_functionalized_v2`` (what aot_autograd makes of a mutating op); Inductor re-inplaces it
# into the clipped sums' own buffers, which nothing else reads. The verifier reads the call as
# the noise and its arguments as the release's scale (passes/verify/release.py).
_LIBRARY.define("add_noise_(Tensor(a!)[] sums, float std, float multiplier, SymInt divisor) -> ()",
                tags=(torch.Tag.nondeterministic_seeded,))


def add_noise_(sums: list[torch.Tensor], std: float, multiplier: float, divisor: int) -> None:
    """sums[t] <- ((sums[t] + std * N(0, 1)) * multiplier) / divisor, in place, one key (std 0
    under ``noiseless()``)."""
    if silenced():
        std = 0.0
    add_noise_keyed(sums, std, multiplier, divisor, None)


def add_noise_keyed(sums: list[torch.Tensor], std: float, multiplier: float, divisor: int,
                    generator: torch.Generator | None) -> None:
    """``add_noise_`` with the key drawn from ``generator`` (torch's default CPU generator when
    None): DPOptimizer's noise, added in place to the clipped sums or their flat buffer."""
    dtypes = set(map(_DTYPE, sums))
    if not dtypes <= _NOISE_DTYPES:
        raise TypeError(f"dpfx::add_noise_ takes float32 and float64 sums, not "
                        f"{sorted(str(d) for d in dtypes - _NOISE_DTYPES)}")
    lib = _library()
    if lib is None:     # the same distribution from torch.randn, at ATen's speed
        for x in sums:
            x.add_(torch.randn(x.shape, dtype=torch.float32, generator=generator),
                   alpha=std).mul_(multiplier)
            x.div_(divisor)
        return
    key = draw_key(generator)
    n, threads = len(sums), torch.get_num_threads()
    if len(dtypes) == 1 and all(map(_CONTIGUOUS, sums)):
        # the common call (every sum of one dtype, contiguous), its pointers read in C: a
        # step's Python per parameter is host time on every step (tensor t still takes stream t)
        kernel = lib.dpfx_philox_add_noise_f32 if torch.float32 in dtypes else \
            lib.dpfx_philox_add_noise_f64
        ptrs = (ctypes.c_void_p * n)(*map(_DATA_PTR, sums))
        sizes = (ctypes.c_int64 * n)(*map(_NUMEL, sums))
        kernel(ptrs, sizes, n, key, float(std), float(multiplier), float(divisor), threads)
        return
    for dtype, kernel in ((torch.float32, lib.dpfx_philox_add_noise_f32),
                          (torch.float64, lib.dpfx_philox_add_noise_f64)):
        if dtype not in dtypes:
            continue
        # A tensor's stream is its position in the call, whatever the dtype grouping: the
        # kernel reads stream t for the t-th pointer, and a position of the other dtype stays
        # an empty entry (null, size 0).
        ptrs = (ctypes.c_void_p * n)()
        sizes = (ctypes.c_int64 * n)()
        copied = []
        for t, x in enumerate(sums):
            if x.dtype is not dtype:
                continue
            if not x.is_contiguous():
                d = x.contiguous()
                copied.append((x, d))
                x = d
            ptrs[t], sizes[t] = x.data_ptr(), x.numel()
        kernel(ptrs, sizes, n, key, float(std), float(multiplier), float(divisor), threads)
        for x, d in copied:
            x.copy_(d)


_NOISE_DTYPES = frozenset({torch.float32, torch.float64})
_DTYPE = operator.attrgetter("dtype")
_CONTIGUOUS = operator.methodcaller("is_contiguous")
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel


_LIBRARY.impl("add_noise_", add_noise_, "CompositeExplicitAutograd")


@torch.library.register_fake("dpfx::add_noise_", lib=_LIBRARY)
def _(sums, std, multiplier, divisor):
    return None
