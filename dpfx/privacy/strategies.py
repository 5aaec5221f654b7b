"""Strategy matrices for correlated noise (matrix-factorization mechanisms): which C, at what cost.

    from dpfx.privacy import strategies
    s = strategies.bandmf(steps=1000, bands=16)        # an optimized banded Toeplitz C
    s.recursion()                                      # what the runtime runs: ToeplitzRecursion
    s.sensitivity(min_separation=100, participations=10)   # sqrt(10): bands <= separation
    s.noise_variance(999)                              # Var(w_t) per coordinate, t counted from 0
    strategies.expected_error(s)                       # prefix-sum RMSE per unit of sigma * S

A matrix-factorization mechanism (DP-MF, DP-FTRL) releases x_t = sum_i clip(g_i) + sigma * S * w_t
with w = C^{-1} z for a lower-triangular n x n strategy matrix C (privacy/recursion.py gives the
recursions). Every strategy here is normalized so that its largest column L2 norm is exactly 1: one
participation of one example then moves C G by at most S, and ``sensitivity`` gives the factor for
several participations. The identity (``gaussian``) is DP-SGD.

Optimized strategies minimize the prefix-sum workload's total squared error times the squared
sensitivity, ||A C^{-1}||_F^2 * sens(C)^2 (A the lower-triangular ones matrix, the sum of the
first t updates), which is what the model's iterates see (Choquette-Choo et al. 2023, "Amplified
banded matrix factorization"; McMahan et al. 2024, "Don't use tree aggregation, use BLTs").

    strategy   runtime state, vectors per parameter   objective
    gaussian   0                                      none (C = I, DP-SGD)
    bandmf     bands - 1                              optimized: error * column norm^2
                                                      (* participations, bands <= separation)
    bsr        bands - 1 (steps - 1 unbanded)         none: (1 - x)^(-1/2) truncated to bands
    blt        buffers (fewer if one has no weight)   optimized: error * min-sep sensitivity^2
    matrix     t at step t (every earlier w)          none: the user's own C

Each step costs the runtime one (Toeplitz, dense) or two (BLT) multiply-adds per state vector and
parameter.

# Note [Toeplitz arithmetic in O(n log n)]
The optimizers never form an n x n matrix: a lower-triangular Toeplitz C is its first column c,
its inverse is the power series 1 / c(x) (Newton's iteration r <- r (2 - c r), products by FFT),
and A C^{-1} is Toeplitz with first column cumsum(r), so ||A C^{-1}||_F^2 = sum_j (n - j) b_j^2.
A BLT is optimized through its inverse (Dvijotham et al. 2024, "Efficient and near-optimal noise
generation for streaming differential privacy"): C^{-1} has generating function
R(x) = 1 - sum_i w_i x / (1 - h_i x) with h_i in (0, 1), w_i >= 0 and
rho = sum_i w_i / (1 - h_i) < 1.
Then R has no zero in the closed unit disc, C = 1 / R = sum_m (1 - R)^m has nonnegative
coefficients, and its state-space form has the matrix diag(h) + 1 w^T, similar to the symmetric
diag(h) + v v^T (v = sqrt(w)): C is a BLT whose theta are that matrix's eigenvalues (in [0, 1),
by interlacing and R(1) > 0) and whose omega_i = (q_i . v)^2 > 0. So every point of the search space
is a valid BLT with nonnegative, nonincreasing coefficients, the condition under which the min-sep
sensitivity below is exact (test_strategies.py::test_sensitivity_matches_brute_force).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator

import numpy as np
import torch

from dpfx.privacy import strategy_fit
from dpfx.privacy.recursion import BLTRecursion, DenseRecursion, ToeplitzRecursion

_F64 = torch.float64
# Exhaustive search over participation patterns is used below this many patterns (a fallback for
# matrices whose structure does not decide the worst pattern).
_BRUTE_FORCE_PATTERNS = 20000


def _integer(name: str, value, low: int, high: int | None = None) -> int:
    """``value`` as an int in low .. high, or a ValueError naming the argument."""
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number < low or (high is not None and
                                                                      number > high):
        bound = f"an integer >= {low}" if high is None else f"an integer in {low} .. {high}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return number


def participation_schema(steps: int, min_separation: int | None,
                         participations: int | None) -> tuple[int, int]:
    """(separation b, participations k) of a (k, b)-min-sep schema, k capped at what fits in steps.

    Neither given: one participation. Only ``participations`` k: the widest separation at which
    k participations fit, b = (steps - 1) // (k - 1) (cyclic sampling over p parts, with
    k = ceil(steps / p), gives b >= p). Only ``min_separation``: as many participations as fit,
    ceil(steps / b).
    """
    if min_separation is not None:
        min_separation = _integer("min_separation", min_separation, 1)
    if participations is not None:
        participations = _integer("participations", participations, 1)
    if min_separation is None and participations is None:
        return steps, 1
    if min_separation is None:
        if participations > steps:
            raise ValueError(f"participations={participations} exceeds steps={steps}: an example "
                             f"takes part in at most one batch per step")
        min_separation = steps if participations == 1 else (steps - 1) // (participations - 1)
    fits = -(-steps // min_separation)
    return min_separation, fits if participations is None else min(participations, fits)


@dataclasses.dataclass(frozen=True, eq=False)
class Strategy:
    """A normalized lower-triangular strategy matrix C for ``steps`` steps (max column norm 1)."""
    name: str                   # "gaussian", "bandmf", "bsr", "blt" or "matrix"
    steps: int
    form: ToeplitzRecursion | BLTRecursion | DenseRecursion     # C itself, as the runtime runs it
    options: tuple[tuple[str, int | None], ...] = ()            # how it was built (bands, ...)

    def matrix(self) -> torch.Tensor:
        return self.form.matrix(self.steps)

    def recursion(self) -> ToeplitzRecursion | BLTRecursion | DenseRecursion:
        return self.form

    @property
    def state_vectors(self) -> int:
        """How many noise vectors the runtime keeps per parameter (at most, for a dense C)."""
        if isinstance(self.form, ToeplitzRecursion):
            return min(len(self.form.coeffs), self.steps) - 1
        if isinstance(self.form, BLTRecursion):
            return len(self.form.theta)
        return self.steps - 1

    @property
    def bands(self) -> int:
        """C's bandwidth: C[i, j] = 0 whenever i - j >= bands (``steps`` when C is not banded;
        1 for the identity). Amplification by cyclic Poisson sampling needs bands <= parts."""
        f = self.form
        if isinstance(f, ToeplitzRecursion):
            nonzero = [j for j, c in enumerate(f.coeffs[:self.steps]) if c != 0]
            return nonzero[-1] + 1
        if isinstance(f, BLTRecursion):
            if not any(w != 0 for w in f.omega):
                return 1
            return min(self.steps, 2 if all(t == 0 for t in f.theta) else self.steps)
        return 1 + max(t - next(j for j, c in enumerate(row) if c != 0)
                       for t, row in enumerate(f.rows[:self.steps]))

    def column(self) -> torch.Tensor | None:
        """C's first column c_0 .. c_{n-1} when C is Toeplitz (None for a dense C)."""
        if isinstance(self.form, ToeplitzRecursion):
            c = torch.zeros(self.steps, dtype=_F64)
            k = min(self.steps, len(self.form.coeffs))
            c[:k] = torch.tensor(self.form.coeffs[:k], dtype=_F64)
            return c
        if isinstance(self.form, BLTRecursion):
            return self.form.scale * torch.tensor(self.form.coefficients(self.steps), dtype=_F64)
        return None

    @functools.cached_property
    def _noise(self) -> torch.Tensor:
        """C^{-1}'s first column (Toeplitz), or C^{-1} itself (dense), computed once per object."""
        c = self.column()
        if c is not None:
            return strategy_fit.series_inverse(c, self.steps)
        return self.form.inverse_matrix(self.steps)

    @functools.cached_property
    def _variances(self) -> torch.Tensor:
        if self.column() is not None:
            return torch.cumsum(self._noise ** 2, 0)
        return (self._noise ** 2).sum(1)

    def noise_variance(self, t: int) -> float:
        """sum_j (C^{-1})[t, j]^2, the per-coordinate variance of w_t (t = 0 .. steps - 1)."""
        return float(self._variances[_integer("t", t, 0, self.steps - 1)])

    def prefix_error(self) -> float:
        """||A C^{-1}||_F^2: the total squared error of the n prefix sums per unit of noise."""
        if self.column() is not None:
            return float(strategy_fit.prefix_error(self._noise, self.steps))
        return float((self._noise.cumsum(0) ** 2).sum())

    def sensitivity(self, min_separation: int | None = None,
                    participations: int | None = None) -> float:
        """max ||C u||_2 over u in {0,1}^n with at most ``participations`` ones, any two at least
        ``min_separation`` apart (``participation_schema``; neither given: one participation, 1).

        Exact when C^T C decides the worst pattern: then it is the earliest one, (0, b, 2b, ...).
        That holds when, for i <= j, X = C^T C has X[i, j] >= 0, X[i, j] >= X[i, j + 1] and
        X[i, j] >= X[i + 1, j + 1] wherever j - i >= b (and X[i, i] >= X[i + 1, i + 1]): map the
        p-th participation i_p to e_p = (p - 1) b <= i_p; every term X[i_p, i_q] can only grow.
        For a Toeplitz C that is implied by c_j >= 0 for all j and c_j >= c_{j+1} for j >= b
        (every BandMF with bands <= b, BSR, and every BLT made here). Otherwise the exact value by
        exhaustive search when there are at most 20000 patterns, else an UPPER BOUND:
        sqrt(k * max_i (the k largest |X[i, j]| summed)), or for a large Toeplitz C the same bound
        built from the autocorrelation of |c|.
        """
        b, k = participation_schema(self.steps, min_separation, participations)
        c = self.column()
        if c is not None:
            if self._nonincreasing_from(c, b):
                return math.sqrt(float(strategy_fit.earliest_pattern_norm2(c, b, k)))
            if self.steps > 2048:
                return math.sqrt(_toeplitz_bound(c, b, k))
        m = self.matrix()
        x = m.T @ m
        if _earliest_is_worst(x, b):
            u = torch.zeros(self.steps, dtype=_F64)
            u[:k * b:b] = 1.0
            return float(torch.linalg.vector_norm(m @ u))
        if _count_patterns(self.steps, b, k) <= _BRUTE_FORCE_PATTERNS:
            return math.sqrt(max_pattern_norm2(x, b, k))
        top = x.abs().topk(min(k, self.steps), dim=1).values.sum(1).max()
        return math.sqrt(k * float(top))

    def _nonincreasing_from(self, c: torch.Tensor, b: int) -> bool:
        """c_j >= 0 for all j and c_j >= c_{j+1} for j >= b (>= 1). For a BLT read from its
        parameters (scale > 0, theta in [0, 1), omega >= 0 make c_1, c_2, .. nonincreasing), since
        rounding in omega . theta^j may break a tie between equal coefficients by an ulp."""
        f = self.form
        if isinstance(f, BLTRecursion):
            return (f.scale > 0 and all(0 <= t < 1 for t in f.theta)
                    and all(w >= 0 for w in f.omega))
        return bool((c >= 0).all()) and bool((c[b:-1] >= c[b + 1:]).all())

    def state_dict(self) -> dict:
        f = self.form
        if isinstance(f, ToeplitzRecursion):
            form = {"kind": "toeplitz", "coeffs": list(f.coeffs)}
        elif isinstance(f, BLTRecursion):
            form = {"kind": "blt", "scale": f.scale, "theta": list(f.theta), "omega": list(f.omega)}
        else:
            form = {"kind": "dense", "rows": [list(r) for r in f.rows]}
        return {"name": self.name, "steps": self.steps, "form": form, "options": dict(self.options)}

    @classmethod
    def from_state_dict(cls, d: dict) -> Strategy:
        f = d["form"]
        if f["kind"] == "toeplitz":
            form = ToeplitzRecursion(tuple(float(x) for x in f["coeffs"]))
        elif f["kind"] == "blt":
            form = BLTRecursion(float(f["scale"]), tuple(float(x) for x in f["theta"]),
                                tuple(float(x) for x in f["omega"]))
        elif f["kind"] == "dense":
            form = DenseRecursion(tuple(tuple(float(x) for x in r) for r in f["rows"]))
        else:
            raise ValueError(f"unknown strategy form {f['kind']!r} in the state dict "
                             f"(expected 'toeplitz', 'blt' or 'dense')")
        steps = _integer("steps", d["steps"], 1)
        if isinstance(form, DenseRecursion) and len(form.rows) != steps:
            raise ValueError(f"the state dict's matrix has {len(form.rows)} rows for {steps} steps")
        return cls(d["name"], steps, form, tuple(d.get("options", {}).items()))

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v}" for k, v in self.options)
        return (f"Strategy({self.name!r}, steps={self.steps}{opts}, "
                f"recursion={type(self.form).__name__}, state_vectors={self.state_vectors})")


def _toeplitz(name: str, steps: int, c: torch.Tensor, **options) -> Strategy:
    c = c[:steps] / torch.linalg.vector_norm(c[:steps])     # column 0 is the longest
    return Strategy(name, steps, ToeplitzRecursion(tuple(c.tolist())), tuple(options.items()))


def gaussian(steps: int) -> Strategy:
    """C = I: independent noise at every step (DP-SGD)."""
    steps = _integer("steps", steps, 1)
    return Strategy("gaussian", steps, ToeplitzRecursion((1.0,)))


def bsr(steps: int, bands: int | None = None) -> Strategy:
    """Banded square root (Kalinin & Lampert 2024): c_j = binom(2j, j) / 4^j, the coefficients of
    (1 - x)^(-1/2), for j < bands (all steps when None). Not banded, C C = A; no optimization."""
    steps = _integer("steps", steps, 1)
    bands = _integer("bands", steps if bands is None else bands, 1, steps)
    return _toeplitz("bsr", steps, strategy_fit.sqrt_coefficients(bands), bands=bands)


def bandmf(steps: int, bands: int, *, participations: int | None = None) -> Strategy:
    """Optimized banded Toeplitz C (Choquette-Choo et al. 2023; JAX-Privacy's banded Toeplitz).

    With ``participations`` k the schema is (k, b)-min-sep, b = (steps - 1) // (k - 1)
    (``participation_schema``; cyclic Poisson over `bands` parts gives b >= bands). When
    bands <= b (the case amplification by cyclic Poisson sampling needs) the sensitivity is
    sqrt(k) times the column norm and the optimum does not depend on k; otherwise the objective
    uses the min-sep sensitivity of the earliest pattern.
    """
    steps = _integer("steps", steps, 1)
    bands = _integer("bands", bands, 1, steps)
    b, k = participation_schema(steps, None, participations)
    if bands == 1:
        return _toeplitz("bandmf", steps, torch.ones(1, dtype=_F64), bands=1,
                         participations=participations)
    c = strategy_fit.fit_banded(steps, bands, b if bands > b else steps, k if bands > b else 1)
    return _toeplitz("bandmf", steps, c, bands=bands, participations=participations)


def blt(steps: int, buffers: int = 4, *, min_separation: int | None = None,
        participations: int | None = None) -> Strategy:
    """Optimized buffered linear Toeplitz C with at most ``buffers`` buffers (Dvijotham et al. 2024;
    McMahan et al. 2024), for the (participations, min_separation)-min-sep schema
    (``participation_schema``; neither given: one participation). At most steps - 1 buffers are
    used, and a buffer the optimum gives no weight is dropped (``state_vectors`` says how many
    remain); when none remains, as when an example may take part in every step, C = I and the
    recursion is ``ToeplitzRecursion((1.0,))``."""
    steps = _integer("steps", steps, 1)
    buffers = _integer("buffers", buffers, 1)
    b, k = participation_schema(steps, min_separation, participations)
    options = (("buffers", buffers), ("min_separation", min_separation),
               ("participations", participations))
    # n steps leave n - 1 coefficients to shape; buffers without weight are dropped by the fit
    theta = ()
    if steps > 1:
        scale, theta, omega = strategy_fit.fit_blt(steps, min(buffers, steps - 1), b, k)
    if not theta:
        return Strategy("blt", steps, ToeplitzRecursion((1.0,)), options)
    return Strategy("blt", steps, BLTRecursion(scale, theta, omega), options)


def from_matrix(matrix) -> Strategy:
    """A user's own lower-triangular C (tensor, array or nested lists), normalized to max column
    norm 1. The runtime keeps every earlier noise vector (``DenseRecursion``)."""
    if isinstance(matrix, torch.Tensor):
        m = matrix.detach().to(device="cpu", dtype=_F64)
    else:
        m = torch.as_tensor(np.asarray(matrix, dtype=np.float64), dtype=_F64)
    if m.dim() != 2 or m.shape[0] != m.shape[1] or m.shape[0] < 1:
        raise ValueError(f"matrix must be a square n x n matrix (n >= 1), got shape "
                         f"{tuple(m.shape)}")
    if not bool(torch.isfinite(m).all()):
        raise ValueError("matrix has non-finite entries")
    above = torch.triu(m, diagonal=1)
    if bool((above != 0).any()):
        i, j = (above != 0).nonzero()[0].tolist()
        raise ValueError(f"matrix must be lower triangular: matrix[{i}, {j}] = {m[i, j].item()!r} "
                         f"is above the diagonal (use torch.tril(matrix) if that is the intent)")
    if bool((m.diagonal() == 0).any()):
        t = int((m.diagonal() == 0).nonzero()[0])
        raise ValueError(f"matrix has a zero on its diagonal at step {t}: C must be invertible")
    m = m / torch.linalg.vector_norm(m, dim=0).max()
    rows = tuple(tuple(m[t, :t + 1].tolist()) for t in range(m.shape[0]))
    return Strategy("matrix", m.shape[0], DenseRecursion(rows))


def expected_error(strategy: Strategy, *, min_separation: int | None = None,
                   participations: int | None = None) -> float:
    """RMSE of the n prefix sums per unit of sigma * S at equal privacy under the min-sep schema:
    sqrt(||A C^{-1}||_F^2 / n) * sensitivity (one participation by default; for gaussian
    sqrt((n + 1) / 2))."""
    sens = strategy.sensitivity(min_separation, participations)
    return math.sqrt(strategy.prefix_error() / strategy.steps) * sens


def max_pattern_norm2(gram: torch.Tensor, min_separation: int, participations: int) -> float:
    """max_u u^T X u over every pattern (at most k ones, >= b apart), by exhaustive search."""
    n = gram.shape[0]
    g = gram.tolist()
    best = 0.0

    def extend(pattern, total):
        nonlocal best
        best = max(best, total)
        if len(pattern) == participations:
            return
        start = pattern[-1] + min_separation if pattern else 0
        for i in range(start, n):
            extend(pattern + [i], total + g[i][i] + 2 * sum(g[i][p] for p in pattern))

    extend([], 0.0)
    return best


def _earliest_is_worst(x: torch.Tensor, b: int) -> bool:
    """The conditions of ``Strategy.sensitivity`` on X = C^T C, checked entrywise."""
    n = x.shape[0]
    i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    far = (j - i) >= b
    if bool((x[far] < 0).any()):
        return False
    row = x[:, :-1] - x[:, 1:]                                   # X[i, j] - X[i, j + 1]
    if bool((row[far[:, :-1]] < 0).any()):
        return False
    diag = x[:-1, :-1] - x[1:, 1:]                               # X[i, j] - X[i + 1, j + 1]
    keep = far[:-1, :-1] | (i == j)[:-1, :-1]
    return not bool((diag[keep] < 0).any())


def _count_patterns(n: int, b: int, k: int) -> int:
    """Number of nonempty patterns of at most k ones in n steps, >= b apart (capped count)."""
    count = 0
    for m in range(1, k + 1):
        free = n - (m - 1) * (b - 1)
        if free < m:
            break
        count += math.comb(free, m)
        if count > _BRUTE_FORCE_PATTERNS:
            break
    return count


def _toeplitz_bound(c: torch.Tensor, b: int, k: int) -> float:
    """Upper bound on max ||C u||^2 for a Toeplitz C: X[i, i + l] <= g(l) = sum_s |c_s c_{s+l}|."""
    g = strategy_fit.autocorrelation(c.abs())
    others = torch.sort(g[b:], descending=True).values[:max(k - 1, 0)]
    return k * float(g[0] + 2 * others.sum())


__all__ = ["Strategy", "gaussian", "bandmf", "bsr", "blt", "from_matrix", "expected_error",
           "participation_schema", "max_pattern_norm2"]
