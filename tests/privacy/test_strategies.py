"""Strategy matrices against independent references: dense solves, closed forms, brute force over
participation patterns, and JAX-Privacy 2.0's optimizers."""
import itertools
import json
import math

import pytest
import torch

from dpfx.privacy import strategies, strategy_fit
from dpfx.privacy.recursion import BLTRecursion, DenseRecursion, ToeplitzRecursion

F64 = torch.float64


def _random_lower(n, seed, positive=False):
    g = torch.Generator().manual_seed(seed)
    m = torch.tril(torch.randn(n, n, generator=g, dtype=F64))
    m = m.abs() if positive else m
    return m + torch.diag(torch.full((n,), 2.0, dtype=F64))


N = 10


@pytest.fixture(scope="module")
def every_kind():
    """One strategy of every kind for N steps."""
    return [strategies.gaussian(N), strategies.bandmf(N, 3), strategies.bsr(N),
            strategies.bsr(N, 4), strategies.blt(N, 2),
            strategies.blt(N, 3, min_separation=3, participations=3),
            strategies.bandmf(N, 5, participations=3),
            strategies.from_matrix(_random_lower(N, 0))]


def _run_recursion(rec, z):
    """w_t step by step, from the formulas in recursion.py (what the runtime runs)."""
    n = z.shape[0]
    w = torch.zeros_like(z)
    if isinstance(rec, ToeplitzRecursion):
        c = rec.coeffs
        for t in range(n):
            acc = z[t].clone()
            for j in range(1, min(t, len(c) - 1) + 1):
                acc -= c[j] * w[t - j]
            w[t] = acc / c[0]
    elif isinstance(rec, BLTRecursion):
        s = torch.zeros(len(rec.theta), *z.shape[1:], dtype=F64)
        u_prev = None
        for t in range(n):
            if t > 0:
                s = torch.stack([rec.theta[i] * s[i] + u_prev for i in range(len(rec.theta))])
            u = z[t] - sum(rec.omega[i] * s[i] for i in range(len(rec.theta)))
            w[t], u_prev = u / rec.scale, u
    else:
        assert isinstance(rec, DenseRecursion)
        for t in range(n):
            row = rec.rows[t]
            w[t] = (z[t] - sum(row[j] * w[j] for j in range(t))) / row[t]
    return w


def test_recursion_gives_the_triangular_solve(every_kind):
    n = N
    z = torch.randn(n, 5, generator=torch.Generator().manual_seed(1), dtype=F64)
    kinds = set()
    for s in every_kind:
        c = s.matrix()
        kinds.add(type(s.recursion()).__name__)
        assert torch.equal(s.recursion().matrix(n), c)
        assert torch.equal(torch.triu(c, 1), torch.zeros_like(c))
        assert torch.linalg.vector_norm(c, dim=0).max().item() == pytest.approx(1, abs=1e-14)
        expected = torch.linalg.solve_triangular(c, z, upper=False)
        torch.testing.assert_close(_run_recursion(s.recursion(), z), expected, rtol=1e-10,
                                   atol=1e-10)
        inv = torch.linalg.inv(c)
        for t in range(n):
            assert s.noise_variance(t) == pytest.approx(float((inv[t] ** 2).sum()), rel=1e-10)
        error = float((torch.tril(torch.ones(n, n, dtype=F64)) @ inv).pow(2).sum() / n) ** 0.5
        assert strategies.expected_error(s) == pytest.approx(error, rel=1e-10)
    assert kinds == {"ToeplitzRecursion", "BLTRecursion", "DenseRecursion"}


def test_series_inverse_is_the_inverse_column_at_large_n():
    c = strategy_fit.sqrt_coefficients(3000)
    r = strategy_fit.series_inverse(c, 3000)
    # (1 - x)^(1/2): r_j = -binom(2j, j) / ((2j - 1) 4^j), i.e. r_j = c_j - c_{j-1}
    torch.testing.assert_close(r[1:], c[1:] - c[:-1], rtol=1e-9, atol=1e-15)
    assert r[0].item() == 1.0


def test_bsr_is_the_square_root_of_the_prefix_sums():
    n = 16
    s = strategies.bsr(n)
    col = s.column()
    closed = torch.tensor([math.comb(2 * j, j) / 4 ** j for j in range(n)], dtype=F64)
    torch.testing.assert_close(col / col[0], closed, rtol=1e-14, atol=0)
    c = s.matrix() / col[0]
    torch.testing.assert_close(c @ c, torch.tril(torch.ones(n, n, dtype=F64)), rtol=0, atol=1e-13)
    banded = strategies.bsr(n, 4)
    assert banded.state_vectors == 3 and s.state_vectors == n - 1
    torch.testing.assert_close(banded.column()[:4] / banded.column()[0], closed[:4])
    assert bool((banded.column()[4:] == 0).all())


def test_bandmf_one_band_is_dpsgd_and_more_bands_help():
    n = 64
    plain = math.sqrt((n + 1) / 2)             # ||A||_F / sqrt(n) for the identity
    assert strategies.expected_error(strategies.gaussian(n)) == pytest.approx(plain, rel=1e-12)
    assert strategies.expected_error(strategies.bandmf(n, 1)) == pytest.approx(plain, rel=1e-12)
    errors = []
    for bands in (1, 2, 4, 8, 16):
        s = strategies.bandmf(n, bands, participations=4)     # separation 16 >= bands
        assert s.sensitivity(16, 4) == pytest.approx(2.0, rel=1e-12)   # sqrt(k) at every band
        errors.append(strategies.expected_error(s, min_separation=16, participations=4))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.6 * errors[0]
    # the optimum beats its own starting point, BSR truncated to the same bands
    assert errors[2] < strategies.expected_error(strategies.bsr(n, 4), min_separation=16,
                                                 participations=4)


# Reference numbers from JAX-Privacy 2.0.0 (jax 0.12, float64), prefix-sum RMSE per unit noise:
#   BandMF: c = toeplitz.optimize_banded_toeplitz(n, bands, reduction_fn=jnp.mean);
#           sqrt(toeplitz.loss(c, n, jnp.mean))
#   BLT:    blt = buffered_toeplitz.optimize(n=n, min_sep=b, max_participations=k, error="mean",
#                 min_buffers=d, max_buffers=d);
#           sqrt(buffered_toeplitz.LossFn.build_min_sep(n=n, error="mean", min_sep=b,
#                max_participations=k).loss(blt))
JAX_BANDMF = {(64, 4): 3.240593597021358, (256, 8): 4.547659956663348}
JAX_BLT = {(64, 2, 1, 1): 2.1799141577128873, (256, 3, 1, 1): 2.6172395310404633,
           (256, 3, 32, 8): 9.219303161187188}
JAX_BLT_SLOW = {(1024, 4, 1, 1): 3.057366694870827, (2000, 4, 100, 20): 21.373966851926063,
                (10000, 4, 1, 1): 3.7841670451026124}


def _dense_error(s, b, k):
    """Our RMSE recomputed densely, with the sensitivity by brute force when small."""
    n = s.steps
    inv = torch.linalg.inv(s.matrix())
    rmse = float((torch.tril(torch.ones(n, n, dtype=F64)) @ inv).pow(2).sum() / n) ** 0.5
    return rmse * s.sensitivity(b, k)


@pytest.mark.parametrize("n,bands", sorted(JAX_BANDMF))
def test_bandmf_matches_jax_privacy(n, bands):
    s = strategies.bandmf(n, bands)
    ours = _dense_error(s, None, None)
    assert ours == pytest.approx(strategies.expected_error(s), rel=1e-10)
    assert ours <= JAX_BANDMF[n, bands] * 1.001
    assert ours >= JAX_BANDMF[n, bands] * 0.98      # the same objective, not a different one


@pytest.mark.parametrize("setting", sorted(JAX_BLT))
def test_blt_matches_jax_privacy(setting):
    _check_blt(setting, JAX_BLT[setting])


@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(JAX_BLT_SLOW))
def test_blt_matches_jax_privacy_at_longer_horizons(setting):
    _check_blt(setting, JAX_BLT_SLOW[setting])


def _check_blt(setting, reference):
    n, d, b, k = setting
    s = strategies.blt(n, d, min_separation=b, participations=k)
    rec = s.recursion()
    assert isinstance(rec, BLTRecursion) and 1 <= len(rec.theta) <= d
    assert all(0 <= t < 1 for t in rec.theta) and all(w > 0 for w in rec.omega)
    col = s.column()
    assert bool((col >= 0).all()) and bool((col[1:] <= col[:-1]).all())
    ours = strategies.expected_error(s, min_separation=b, participations=k)
    if n <= 1024:
        assert ours == pytest.approx(_dense_error(s, b, k), rel=1e-10)
    assert reference * 0.98 <= ours <= reference * 1.02


# JAX-Privacy 2.0.0: sqrt(toeplitz.minsep_sensitivity_squared(
#     toeplitz.optimal_max_error_strategy_coefs(n), min_sep=b, max_participations=k, n=n)),
# the square root's coefficients with c_0 = 1 (ours are scaled to column norm 1).
JAX_BSR_SENSITIVITY = {(64, 8, 8): 7.082079598110532, (64, 5, 3): 3.74071855726157,
                       (100, 7, None): 12.222356670068137}


@pytest.mark.parametrize("setting", sorted(JAX_BSR_SENSITIVITY, key=str))
def test_bsr_sensitivity_matches_jax_privacy(setting):
    n, b, k = setting
    s = strategies.bsr(n)
    assert s.sensitivity(b, k) / s.column()[0].item() == pytest.approx(
        JAX_BSR_SENSITIVITY[setting], rel=1e-12)


def _brute_force(c, b, k):
    n = c.shape[0]
    best = 0.0
    for m in range(1, k + 1):
        for pattern in itertools.combinations(range(n), m):
            if all(q - p >= b for p, q in zip(pattern, pattern[1:])):
                u = torch.zeros(n, dtype=F64)
                u[list(pattern)] = 1.0
                best = max(best, float(torch.linalg.vector_norm(c @ u)))
    return best


def test_sensitivity_matches_brute_force(every_kind):
    n = N
    steep = BLTRecursion(1.0, (0.9, 0.3), (0.8, 0.7))          # c_1 > c_0: decided from c_1 on
    steep = BLTRecursion(1 / float(torch.linalg.vector_norm(steep.matrix(n)[:, 0])), steep.theta,
                         steep.omega)
    cases = every_kind + [strategies.from_matrix(_random_lower(n, 2, positive=True)),
                          strategies.Strategy("blt", n, steep)]
    for s in cases:
        c = s.matrix()
        for b, k in [(1, 1), (1, 3), (2, 2), (3, 4), (4, 10), (7, 2)]:
            assert s.sensitivity(b, k) == pytest.approx(_brute_force(c, b, k), rel=1e-12), \
                (s, b, k)
    assert strategies.gaussian(n).sensitivity(2, 3) == pytest.approx(math.sqrt(3))
    assert strategies.bsr(n).sensitivity() == pytest.approx(1.0)
    assert strategies.bsr(n).sensitivity(min_separation=4) == strategies.bsr(n).sensitivity(4, 3)
    assert strategies.bsr(n).sensitivity(participations=2) == strategies.bsr(n).sensitivity(9, 2)


def test_sensitivity_bounds_are_upper_bounds(monkeypatch):
    """Where no structure decides the worst pattern and search is too big: a bound, never less."""
    n = 9
    m = strategies.from_matrix(_random_lower(n, 3))
    exact = _brute_force(m.matrix(), 2, 3)
    x = m.matrix().T @ m.matrix()
    assert not strategies._earliest_is_worst(x, 2)             # no structure to rely on
    assert m.sensitivity(2, 3) == pytest.approx(exact, rel=1e-12)      # exhaustive search
    monkeypatch.setattr(strategies, "_BRUTE_FORCE_PATTERNS", 0)
    assert m.sensitivity(2, 3) >= exact
    c = torch.tensor([1.0, -0.4, 0.5, 0.3, -0.2, 0.1, 0.0, 0.05, 0.0], dtype=F64)
    toeplitz = strategies.Strategy("bandmf", n, ToeplitzRecursion(tuple(c.tolist())))
    for b, k in [(1, 3), (2, 4), (3, 2)]:
        assert strategies._toeplitz_bound(c, b, k) >= _brute_force(toeplitz.matrix(), b, k) ** 2


def test_bandmf_with_more_bands_than_the_separation():
    n, k = 24, 4                                     # separation 6 < 8 bands
    s = strategies.bandmf(n, 8, participations=k)
    plain = strategies.bandmf(n, 8)
    assert s.sensitivity(6, k) == pytest.approx(_brute_force(s.matrix(), 6, k), rel=1e-12)
    ours = strategies.expected_error(s, min_separation=6, participations=k)
    assert ours <= strategies.expected_error(plain, min_separation=6, participations=k) + 1e-9
    assert ours < strategies.expected_error(strategies.gaussian(n), min_separation=6,
                                            participations=k)


def test_bands_and_participation_schema():
    n = 10
    assert [s.bands for s in (strategies.gaussian(n), strategies.bandmf(n, 3), strategies.bsr(n),
                              strategies.bsr(n, 4), strategies.blt(n, 2))] == [1, 3, n, 4, n]
    lower = torch.eye(n, dtype=F64)
    lower[7, 4] = 0.5                                   # one entry on the fourth diagonal
    assert strategies.from_matrix(lower).bands == 4
    for s in (strategies.gaussian(n), strategies.bandmf(n, 3), strategies.from_matrix(lower)):
        c = s.matrix()
        i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        assert bool((c[(i - j) >= s.bands] == 0).all())
        assert bool((c[(i - j) == s.bands - 1] != 0).any())
    # cyclic sampling over 8 parts in 100 steps: 13 participations, >= 8 apart
    assert strategies.participation_schema(100, None, 13) == (8, 13)
    assert strategies.participation_schema(100, 8, None) == (8, 13)
    assert strategies.participation_schema(100, None, None) == (100, 1)
    assert strategies.participation_schema(100, 30, 7) == (30, 4)
    same = strategies.bandmf(100, 8, participations=13)    # bands <= separation: k changes nothing
    assert same.state_dict()["form"] == strategies.bandmf(100, 8).state_dict()["form"]


def test_state_dict_round_trips_exactly(every_kind):
    for s in every_kind:
        d = json.loads(json.dumps(s.state_dict()))
        back = strategies.Strategy.from_state_dict(d)
        assert torch.equal(back.matrix(), s.matrix())
        assert (back.name, back.steps, back.options) == (s.name, s.steps, s.options)
        assert type(back.recursion()) is type(s.recursion())
        assert repr(back) == repr(s) and s.name in repr(s)
    assert "bands=3" in repr(every_kind[1])
    with pytest.raises(ValueError, match="unknown strategy form 'tree'"):
        strategies.Strategy.from_state_dict({"name": "x", "steps": 3, "form": {"kind": "tree"}})


def test_blt_where_every_step_may_participate_is_dpsgd():
    """With min-separation 1 and k = n the identity is optimal: no buffer is kept for nothing."""
    s = strategies.blt(8, 2, participations=8)
    assert s.state_vectors == 0 and torch.equal(s.matrix(), torch.eye(8, dtype=F64))
    assert strategies.blt(1, 4).state_vectors == 0
    assert strategies.blt(3, 4).state_vectors <= 2


def test_from_matrix_takes_tensors_arrays_and_lists():
    c = _random_lower(4, 5)
    ref = strategies.from_matrix(c).matrix()
    assert torch.linalg.vector_norm(ref, dim=0).max().item() == pytest.approx(1.0, abs=1e-15)
    torch.testing.assert_close(ref * c.norm(dim=0).max(), c, rtol=1e-15, atol=0)
    for same in (c.clone().requires_grad_(True), c.numpy(), c.tolist()):
        assert torch.equal(strategies.from_matrix(same).matrix(), ref)


def test_optimizers_are_deterministic():
    a, b = strategies.blt(96, 3), strategies.blt(96, 3)
    assert a.state_dict() == b.state_dict()
    assert strategies.bandmf(96, 5).state_dict() == strategies.bandmf(96, 5).state_dict()


def test_invalid_arguments_name_themselves():
    bad = [(lambda: strategies.gaussian(0), "steps"),
           (lambda: strategies.bandmf(10, 0), "bands"),
           (lambda: strategies.bandmf(10, 11), "bands"),
           (lambda: strategies.bsr(10, 0), "bands"),
           (lambda: strategies.blt(10, 0), "buffers"),
           (lambda: strategies.blt(10, 2, min_separation=0), "min_separation"),
           (lambda: strategies.blt(10, 2, participations=11), "participations"),
           (lambda: strategies.from_matrix(torch.ones(3, 3)), r"lower triangular: matrix\[0, 1\]"),
           (lambda: strategies.from_matrix(torch.diag(torch.tensor([1.0, 0.0]))), "zero on its"),
           (lambda: strategies.from_matrix(torch.ones(2, 3)), "square"),
           (lambda: strategies.gaussian(4).noise_variance(4), "t must"),
           (lambda: strategies.gaussian(4).sensitivity(0, 1), "min_separation")]
    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.slow
def test_large_horizons():
    """n = 10^4: the optimizers never form an n x n matrix. BLT beats the (unbanded) square root;
    BandMF beats the square root truncated to its bands (banded noise does not cancel over 10^4
    steps of one participation: its error grows like sqrt(t), which is why it is used with
    amplification by sampling)."""
    n = 10000
    blt, band = strategies.blt(n, 4), strategies.bandmf(n, 64)
    assert strategies.expected_error(blt) < strategies.expected_error(strategies.bsr(n))
    assert strategies.expected_error(band) < strategies.expected_error(strategies.bsr(n, 64))
    for s in (blt, band):
        assert s.noise_variance(n - 1) > 0
    multi = strategies.blt(n, 4, participations=10)
    assert multi.sensitivity(participations=10) > 1.0
    assert strategies.expected_error(multi, participations=10) < strategies.expected_error(
        blt, participations=10)
