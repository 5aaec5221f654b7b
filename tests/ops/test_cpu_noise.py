"""The CPU noise kernel (ops/noise.py, csrc/philox_normal.c): Philox4x32-10 bit for bit against
Random123's known answers and an independent Python Philox, Box-Muller against a float64
reference, and the samples' distribution. dpfx's noise is only as good as this."""
import math
import warnings

import pytest
import torch

import dpfx
from dpfx.ops import noise as cpu_noise
from support.models import MLP, mse
from support.reference import run_dpfx

pytestmark = pytest.mark.skipif(not cpu_noise.available(), reason="no C compiler")

M32 = 0xFFFFFFFF


def _philox_py(counter, key, rounds=10):
    """Philox4x32 from Salmon et al. (SC'11), written from the paper's round function."""
    (c0, c1, c2, c3), (k0, k1) = counter, key
    for _ in range(rounds):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


@pytest.mark.parametrize("counter,key,expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, expected):
    assert cpu_noise.philox4x32_10(counter, key) == expected
    assert _philox_py(counter, key) == expected


def _normal_reference(n, key, stream=0):
    """float64 Box-Muller over the Python Philox, in the kernel's output order; ``stream`` is
    the third counter word (dpfx::add_noise_'s tensor index)."""
    m, k = n // 4, (key & M32, key >> 32)
    blocks = []
    for b in range(m + (n % 4 > 0)):
        x = _philox_py((b & M32, b >> 32, stream, 0), k)
        u = [(xi + 0.5) * 2.0 ** -32 for xi in x]
        r0, r1 = math.sqrt(-2 * math.log(u[0])), math.sqrt(-2 * math.log(u[2]))
        t0, t1 = 2 * math.pi * u[1], 2 * math.pi * u[3]
        blocks.append([r0 * math.cos(t0), r0 * math.sin(t0), r1 * math.cos(t1), r1 * math.sin(t1)])
    out = [blocks[b][j] for j in range(4) for b in range(m)]   # planes: out[b + j m]
    out += blocks[m][:n % 4] if n % 4 else []
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 7, 37, 4101, 4 * 2048 + 39])   # 2048: blocks per tile
def test_normals_match_a_float64_reference(n):
    key = 0x0123456789ABCDEF
    got = cpu_noise.philox_normal(n, key)
    assert got.dtype == torch.float32 and got.shape == (n,)
    # float32 uniforms (24-bit rounding) and the kernel's own float32 log, sine and cosine
    # (about 1 ulp each): a few ulp of z.
    torch.testing.assert_close(got.double(), _normal_reference(n, key), rtol=2e-5, atol=2e-5)


def _philox_np(blocks, key, stream=0):
    """The Python Philox above, over many blocks at once in numpy's uint64 arithmetic."""
    np = pytest.importorskip("numpy")
    c0, c1 = blocks & M32, blocks >> np.uint64(32)
    c2, c3 = np.full_like(c0, stream), np.zeros_like(c0)
    k0, k1 = key & M32, key >> 32
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0), p1 & np.uint64(M32),
                          (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1), p0 & np.uint64(M32))
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


def test_box_muller_is_accurate_over_a_million_normals():
    """The kernel's own log, sine and cosine (Cephes polynomials, the angle reduced in turns)
    against float64 Box-Muller on the uniforms of 2^18 Philox blocks: every quadrant, the
    smallest uniforms and those next to 1. The compiler may round a uniform one ulp away from
    this emulation of it (-ffast-math reassociates its scaling), so each pair is checked in
    polar form with that ulp allowed for: the radius^2 = -2 ln u0 within 2 ulp(u0)/u0 + 1e-6
    relative, the angle 2 pi u1 within 2 pi ulp(u1) + 2e-7. A wrong quadrant or polynomial is
    off by orders of magnitude more."""
    np = pytest.importorskip("numpy")
    n, key = 4 << 18, 0x9E3779B97F4A7C15
    got = cpu_noise.philox_normal(n, key).double().numpy().reshape(4, -1)
    words = _philox_np(np.arange(n // 4, dtype=np.uint64), key)
    # The kernel's uniform: two exact halves to float32, + 1/2, * 2^-32 (float32 throughout).
    u = [((((w >> np.uint64(16)).astype(np.float32) * np.float32(65536)
             + (w & np.uint64(0xFFFF)).astype(np.float32)) + np.float32(0.5))
          * np.float32(2.0 ** -32)).astype(np.float64) for w in words]
    for z_cos, z_sin, u_radius, u_angle in ((got[0], got[1], u[0], u[1]),
                                            (got[2], got[3], u[2], u[3])):
        radius2 = -2 * np.log(u_radius)
        ulp = np.spacing(u_radius.astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(z_cos ** 2 + z_sin ** 2 - radius2)
                      <= 2 * ulp / u_radius + 1e-6 * radius2)
        turn = np.angle(np.exp(1j * (np.arctan2(z_sin, z_cos) - 2 * np.pi * u_angle)))
        angle_ulp = 2 * np.pi * np.spacing(u_angle.astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(turn) <= angle_ulp + 2e-7)


def test_output_does_not_depend_on_thread_count():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_noise.philox_normal(100_003, 42)
        torch.set_num_threads(max(2, threads))
        many = cpu_noise.philox_normal(100_003, 42)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    assert not torch.equal(one, cpu_noise.philox_normal(100_003, 43))


def test_samples_are_standard_normal():
    scipy_stats = pytest.importorskip("scipy.stats")
    z = cpu_noise.philox_normal(2_000_003, 2**63 + 12345).double()
    n = z.numel()
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert z.var().item() == pytest.approx(1.0, abs=5 * math.sqrt(2 / n))
    assert (z ** 3).mean().item() == pytest.approx(0.0, abs=5 * math.sqrt(15 / n))
    assert (z ** 4).mean().item() == pytest.approx(3.0, abs=5 * math.sqrt(96 / n))
    assert scipy_stats.kstest(z.numpy(), "norm").pvalue > 1e-4
    # Tails: P(|z| > 4) = 6.33e-5, about 127 of 2M; the largest |z| the kernel can give is 6.76.
    beyond4 = (z.abs() > 4).sum().item()
    assert 127 - 5 * math.sqrt(127) < beyond4 < 127 + 5 * math.sqrt(127)
    assert z.abs().max().item() < 6.8
    # The four planes (cos and sin of each Box-Muller pair) are uncorrelated.
    planes = z[:4 * (n // 4)].view(4, -1)
    corr = torch.corrcoef(planes) - torch.eye(4, dtype=torch.float64)
    assert corr.abs().max().item() < 5 / math.sqrt(n // 4)


def test_keys_come_from_the_generator():
    a = cpu_noise.gaussian(1000, torch.Generator().manual_seed(5))
    b = cpu_noise.gaussian(1000, torch.Generator().manual_seed(5))
    c = cpu_noise.gaussian(1000, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(9)
    d = torch.ops.dpfx.standard_normal(1000, "cpu")
    torch.manual_seed(9)
    assert torch.equal(d, torch.ops.dpfx.standard_normal(1000, "cpu"))
    assert not torch.equal(d, torch.ops.dpfx.standard_normal(1000, "cpu"))  # generator moved on


def test_graph_noise_on_cpu_is_the_kernel():
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, backend="eager")
    run_dpfx(dp, model, mse, torch.randn(3, 8), torch.randn(3, 4))
    noise = [n for n in dp._dpfx_backend.last_backward.gm.graph.nodes
             if n.meta.get("dpfx") == "noise"]
    assert [(n.target, n.args) for n in noise] == [
        (torch.ops.higher_order.auto_functionalized_v2, (torch.ops.dpfx.add_noise_.default,))]


def _add_noise(sums, std, multiplier, divisor, seed):
    """Runs dpfx::add_noise_ under torch.manual_seed(seed); returns the key it drew."""
    torch.manual_seed(seed)
    key = cpu_noise.draw_key()
    torch.manual_seed(seed)
    torch.ops.dpfx.add_noise_(sums, std, multiplier, divisor)
    return key


def test_add_noise_matches_a_float64_reference():
    """Note [Noise added in place]: sums[t] <- ((sums[t] + std z_t) * multiplier) / divisor with
    z_t the reference normals of Philox stream t under the call's one key, for float32 and
    float64 sums, a non-contiguous one (written back), an empty one, sizes across tiles."""
    sizes = [37, 0, 4 * 2048 + 39, 3, 12]
    before = [torch.randn(n, dtype=torch.float64 if t == 3 else torch.float32)
              for t, n in enumerate(sizes)]
    sums = [x.clone() for x in before]
    sums[4] = before[4].clone().view(3, 4).t()           # non-contiguous (4, 3)
    before[4] = sums[4].clone()
    key = _add_noise(sums, 0.7, 0.25, 3, seed=11)
    for t, (x, b) in enumerate(zip(sums, before)):
        z = _normal_reference(b.numel(), key, stream=t).view(b.shape) if b.numel() else 0
        expected = (b.double() + 0.7 * z) * 0.25 / 3
        torch.testing.assert_close(x.double(), expected, rtol=2e-5, atol=2e-5)
    # Streams differ: the same size at two positions gets two draws.
    a, b = torch.zeros(64), torch.zeros(64)
    _add_noise([a, b], 1.0, 1.0, 1, seed=3)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_add_noise_of_one_dtype_matches_the_reference(dtype):
    """The common call (every sum of one dtype and contiguous, its pointers read in C) draws
    what the general path draws: tensor t takes Philox stream t, an empty one among them too."""
    sizes = [37, 0, 4 * 2048 + 39, 3]
    before = [torch.randn(n, dtype=dtype) for n in sizes]
    sums = [x.clone() for x in before]
    key = _add_noise(sums, 0.7, 0.25, 3, seed=11)
    for t, (x, b) in enumerate(zip(sums, before)):
        z = _normal_reference(b.numel(), key, stream=t) if b.numel() else 0
        torch.testing.assert_close(x.double(), (b.double() + 0.7 * z) * 0.25 / 3,
                                   rtol=2e-5, atol=2e-5)


def test_add_noise_does_not_depend_on_thread_count_and_refuses_half_precision():
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            sums = [torch.zeros(100_003), torch.zeros(5), torch.zeros(9000, dtype=torch.float64)]
            _add_noise(sums, 1.0, 1.0, 1, seed=4)
            runs.append(sums)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    ok, low = torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="float32 and float64"):
        torch.ops.dpfx.add_noise_([ok, low], 1.0, 1.0, 1)
    assert not ok.any()         # refused before touching anything


def test_without_a_compiler_noise_falls_back_to_torch_randn(monkeypatch):
    monkeypatch.setattr(cpu_noise, "_library", lambda: cpu_noise._unavailable("test"))
    with pytest.warns(RuntimeWarning, match="torch.randn instead"):
        z = cpu_noise.gaussian(10_000, torch.Generator().manual_seed(1))
    torch.testing.assert_close(z, torch.randn(10_000, generator=torch.Generator().manual_seed(1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model = MLP()
        dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, backend="eager",
                          expected_batch_size=4)
        grads = run_dpfx(dp, model, mse, torch.randn(0, 8), torch.randn(0, 4))
    assert all(g.abs().sum() > 0 for g in grads.values())     # noise, from torch.randn
    # dpfx::add_noise_ on its own: torch.randn's draws, scaled as the kernel scales its own.
    sums = [torch.zeros(20_000), torch.zeros(7, dtype=torch.float64)]
    torch.manual_seed(2)
    with pytest.warns(RuntimeWarning, match="torch.randn instead"):
        torch.ops.dpfx.add_noise_(sums, 3.0, 0.5, 2)
    torch.manual_seed(2)
    torch.testing.assert_close(sums[0], torch.randn(20_000) * 3.0 * 0.5 / 2)
    assert sums[0].std().item() == pytest.approx(0.75, rel=0.05)


def test_noiseless_is_this_threads_alone():
    """Note [The self-check's backward runs without noise]: under ``noiseless()`` both noise ops
    add zero on this thread, scale and division still applied; another thread's release, and this
    thread's after the block, keep their noise."""
    import threading

    sums = [torch.ones(1000), torch.ones(10, dtype=torch.float64)]
    other = {}

    def elsewhere():
        x = [torch.ones(1000)]
        torch.ops.dpfx.add_noise_(x, 1.0, 0.5, 2)
        other["std"] = float(x[0].std())

    with cpu_noise.noiseless():
        torch.ops.dpfx.add_noise_(sums, 1.0, 0.5, 2)
        assert float(torch.ops.dpfx.standard_normal(100, torch.device("cpu")).abs().max()) == 0
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    assert all(torch.equal(x, torch.full_like(x, 0.25)) for x in sums)
    assert 0.2 < other["std"] < 0.3                      # 0.5 / 2 * N(0, 1)
    after = [torch.ones(1000)]
    torch.ops.dpfx.add_noise_(after, 1.0, 0.5, 2)
    assert 0.2 < float(after[0].std()) < 0.3
    assert float(torch.ops.dpfx.standard_normal(100, torch.device("cpu")).std()) > 0.5
