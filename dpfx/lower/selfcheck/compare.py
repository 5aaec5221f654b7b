"""The self-check's comparisons: a compiled graph's outputs against the eager reference's.

    compare("backward", b, names, got, want)     # raises PrivacyError past the tolerance
    close(x, y, 1e-4)                            # the same test, for one pair

||got - want|| <= tol (||want|| + sqrt(n) s), s the graph's own scale (Note [The self-check's
floor scales with the graph]); the norms are float64-accurate at float32's speed, streamed
through the cache where the pair allows.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from dpfx.errors import PrivacyError


# Note [Attention kernels' side outputs are not compared]
# A fused attention kernel on a GPU returns the seed and offset of its dropout RNG, which the
# forward graph saves for the backward (Note [Attention kernels keep the leading dims apart] in
# passes/verify/forward.py). Without dropout they are allocated and never written: two runs of the same
# graph on the same inputs return different bits. They carry no example's data, so the forward
# check leaves them out (layout "side"): of the comparison with the eager reference (``skip``)
# and, being batch-free outputs that are not compared as such, of the independence check.
# (tests/lower/test_fused_attention.py::test_side_outputs_compared_would_refuse)
def compare(which: str, b: int, names: list, got: list, want: list,
             low_precision: bool = False, measured: dict | None = None,
             skip: set = frozenset()) -> None:
    """Every output of a compiled graph against the eager reference's, but those in ``skip``;
    ``measured``: the outputs the reference measured as it released them (``record``), by
    position."""
    measured = dict(measured or {})
    for i, (x, y) in enumerate(zip(got, want)):
        if i in skip:
            continue
        if i not in measured and isinstance(y, torch.Tensor) and y.is_floating_point():
            measured[i] = measure(x, y)
    scale = max((m.scale_norm / m.numel ** 0.5 for m in measured.values()
                 if m.numel and math.isfinite(m.scale_norm)),
                default=0.0) or 1.0
    for i, name in enumerate(names):
        if i in skip:
            continue
        if i in measured:
            m = measured[i]
            if not m.within(2e-2 if m.element_size <= 2 or low_precision else 1e-3, scale):
                raise PrivacyError(
                    f"dpfx's self-check: the compiled {which} graph disagrees with dpfx's "
                    f"verified graph on output {name} at batch size {b} (relative error "
                    f"{m.relative_error():.3g}). The code Inductor generated is not the graph "
                    f"dpfx proved (a torch bug); dpfx refuses to train with it. Use "
                    f"backend='eager' and report this with your torch version.")
        elif isinstance(y := want[i], torch.Tensor) and not torch.equal(got[i], y):
            raise PrivacyError(f"dpfx's self-check: the compiled {which} graph disagrees with "
                               f"its verified graph on output {name} at batch size {b}")


@dataclasses.dataclass
class _Measure:
    """What comparing two floating tensors needs, so that neither has to be kept: ||x - y|| with
    NaNs lined up (None: shapes or NaN places differ), ||y|| for the relative bound, ||y|| with
    NaNs read as 0 for the graph's scale (Note [The self-check's floor scales with the graph])."""
    gap: float | None
    norm: float
    scale_norm: float
    numel: int
    element_size: int

    def within(self, tol: float, scale: float) -> bool:
        return self.gap is not None and self.gap <= tol * (self.norm + self.numel ** 0.5 * scale)

    def relative_error(self) -> float:
        return math.inf if self.gap is None else self.gap / max(self.norm, 1e-30)


def measure(x: torch.Tensor | None, y: torch.Tensor) -> _Measure:
    n, size = y.numel(), y.element_size()
    if not isinstance(x, torch.Tensor) or x.shape != y.shape:     # missing, or misshapen
        return _Measure(None, math.nan, math.nan, n, size)
    if x.is_floating_point() and x.element_size() >= 4 and y.dtype == x.dtype:
        gap, norm = _gap_and_norm(x, y)
        if math.isfinite(gap):    # y finite and x - y finite: x is finite too
            return _Measure(gap, norm, norm, n, size)
    if not x.is_floating_point() or x.element_size() < 4:
        x, y = x.double(), y.double()
    norm = _norm(y)
    if not torch.equal(torch.isnan(x), torch.isnan(y)):
        return _Measure(None, norm, norm, n, size)
    return _Measure(_norm((x - y).nan_to_num_()), norm, norm, n, size)


# Note [The self-check's comparisons are few passes over the data]
# Copying each output to float64 and clearing its NaNs would take four passes per side, each a
# parallel region, over every gradient: most of the check on a model with many gradient
# entries. The norms are as accurate as a
# float64 accumulation (Note [Norms in float32 rows, summed in float64]), the difference is
# taken once in the outputs' own precision (float32 at least), and NaNs, which must sit at the
# same places on both sides, are cleared only from the difference, or from a side whose norm
# came out NaN. Where the expected side's norm and the difference's are finite (then neither
# side holds a NaN or an infinity, the common case) there is nothing to line up or clear: two
# passes (the difference's norm, and the expected side's, taken once for the graph's scale too)
# where the NaN masks, their comparison and the clearing would take seven. A NaN or an infinity on
# the compiled side alone makes the difference's norm non-finite and takes the path that lines
# them up.
#
# Note [Norms in float32 rows, summed in float64]
# A float64 norm of a float32 tensor converts every entry first, on one thread: slow on an LM's
# logits. ATen's float32 norm of the whole tensor is an order of magnitude faster but not accurate
# enough (1e-3 relative at 19M entries, the check's own tolerance). So a float32 tensor's norm is
# taken as the float32 norms of rows of _ROW entries, their squares summed in float64: as fast as
# the float32 norm, and within 1e-9 of the float64 norm on those logits. A row's sum of at most 1024
# float32 squares is off by at most 1024 * 2^-24 (6e-5) relative, next to the check's 1e-3. Two
# things float32 squares lose are recomputed in float64: an infinity (an entry that is one, or a row
# whose squares overflowed) and a norm below sqrt(n) * 1e-17, where squares that fell below
# float32's normal range (entries under 1e-19) could be 1e-4 of the sum. A NaN entry makes a NaN
# norm either way.
_ROW = 1024
_SMALL = 1e-17


def _raw_norm(t: torch.Tensor) -> float:
    """The Euclidean norm of ``t``, as accurate as accumulating in float64: NaN if ``t`` holds a
    NaN."""
    n = t.numel()
    if t.dtype == torch.float32 and n >= 2 * _ROW:
        norm = math.sqrt(_square_sum(t.reshape(-1)))
        if math.isnan(norm) or _SMALL * n ** 0.5 <= norm < math.inf:
            return norm      # NaN for a NaN entry; inf (an inf entry or overflow) is recomputed
    return float(torch.linalg.vector_norm(t, dtype=torch.float64))


def _square_sum(flat: torch.Tensor) -> float:
    """The sum of squares of a 1-D float32 tensor: float32 norms of rows of _ROW entries, their
    squares and the tail's summed in float64 (Note [Norms in float32 rows, summed in float64])."""
    k = flat.numel() // _ROW
    total = 0.0
    if k:
        rows = torch.linalg.vector_norm(flat[:k * _ROW].view(k, _ROW), dim=1)
        total = float(rows.double().square().sum())
    if k * _ROW < flat.numel():
        total += float(torch.linalg.vector_norm(flat[k * _ROW:], dtype=torch.float64)) ** 2
    return total


# Note [The self-check's comparisons stream through the cache]
# ||x - y|| and ||y|| of a float32 pair would be three passes over memory and a fresh buffer the
# size of the output for x - y (page faults, and a tied [V, d] gradient's size beside both
# sides' gradients at the first step's peak). Where the two are paired entry for
# entry by their memory order (both row-major, or both laid out alike over dense memory: a
# compiled output and its eager twin usually are), the difference is taken in chunks of
# _CHUNK entries into one reused buffer, and each chunk's difference and its y are normed
# while they are in cache: one read of each side. Outputs equal on both sides are common (saved
# activations computed alike: most of the entries an LM's check compares): their squared
# differences sum to 0, which would send them to a float64 norm of the difference (one thread),
# to tell a zero gap from one whose float32 squares underflowed. A chunk whose
# squared differences sum to 0 is asked instead whether its difference, still in cache, holds
# any nonzero entry: a pair with none has a gap of exactly 0. The norms are _raw_norm's sums
# (rows of _ROW, in float64), with the same recomputations where float32 squares lose
# (Note [Norms in float32 rows, summed in float64]); an all-zero y's norm is 0. Other pairs
# (strides that differ, views with gaps) take x - y, as do tensors off the CPU (each chunk's
# norms would wait on the device).
_CHUNK = 1 << 18


def _gap_and_norm(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(||x - y||, ||y||) for floating tensors of one shape and dtype, each as accurate as a
    float64 accumulation; the gap is NaN where ||y|| is not finite, and NaN or inf where x - y
    holds a NaN or an infinity (the caller lines those up)."""
    pair = _paired(x, y) if x.dtype == torch.float32 and x.numel() >= 2 * _ROW \
        and x.device.type == "cpu" else None
    if pair is None:
        norm = _raw_norm(y)
        return (_raw_norm(x - y) if math.isfinite(norm) else math.nan), norm
    fx, fy = pair
    n = fx.numel()
    buf = torch.empty(min(n, _CHUNK), dtype=fx.dtype, device=fx.device)
    gap_sq = norm_sq = 0.0
    equal = True      # every entry of x - y is 0 (for floats: x == y, but NaN != NaN)
    for start in range(0, n, _CHUNK):
        xs, ys = fx[start:start + _CHUNK], fy[start:start + _CHUNK]
        d = torch.sub(xs, ys, out=buf[:xs.numel()])
        chunk = _square_sum(d)
        if equal and (chunk != 0.0 or bool(d.any())):
            equal = False
        gap_sq += chunk
        norm_sq += _square_sum(ys)
    floor = _SMALL * n ** 0.5
    norm = math.sqrt(norm_sq)
    if not (math.isnan(norm) or floor <= norm < math.inf):
        norm = 0.0 if norm_sq == 0.0 and not bool(fy.any()) else \
            float(torch.linalg.vector_norm(y, dtype=torch.float64))
    if not math.isfinite(norm):
        return math.nan, norm
    gap = math.sqrt(gap_sq)
    if not (equal or math.isnan(gap) or floor <= gap < math.inf):
        gap = _raw_norm(x - y)
    return gap, norm


def _paired(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``x`` and ``y`` as 1-D views that pair their entries, without a copy: both row-major, or
    both with the same strides over dense memory; None otherwise."""
    if x.is_contiguous() and y.is_contiguous():
        return x.view(-1), y.view(-1)
    if x.stride() == y.stride() and _dense(x):
        n = x.numel()
        return x.as_strided((n,), (1,)), y.as_strided((n,), (1,))
    return None


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s entries fill a block of memory once each: its dims, ordered by stride,
    are a row-major layout of some permutation."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _norm(t: torch.Tensor) -> float:
    """The Euclidean norm of ``t`` accumulated in float64, NaN entries read as 0."""
    norm = _raw_norm(t)
    if math.isnan(norm):
        norm = float(torch.linalg.vector_norm(t.nan_to_num(), dtype=torch.float64))
    return norm


# Note [The self-check's floor scales with the graph]
# ||x - y|| <= tol * (||y|| + sqrt(n) * scale): relative, with a floor for outputs near zero (the
# spatial mean after an InstanceNorm is ~1e-8 on both sides, all rounding, next to activations of
# order 1). The floor's scale is the graph's own: the largest RMS entry among its outputs. A fixed
# floor of sqrt(n) let a 1% error through in every DP gradient, whose entries are of order C/D
# (C = 1, D = 256: ~1e-3 each), so the floor outweighed the relative term 250 times
# (tests/lower/test_selfcheck.py::test_miscompiled_graph_refused_before_training, "dp-scale").
def close(x, y, tol: float, scale: float = 1.0) -> bool:
    return measure(x, y).within(tol, scale)
