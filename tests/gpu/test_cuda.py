"""dpfx on a CUDA device through Inductor's Triton backend, the path GPU users run: skipped where
torch sees no GPU (the default suite's machine has none).

Each check is one the CPU suite makes through Inductor's C++ backend, repeated on the GPU, where
the graphs differ: the release is the GPU form (one standard normal draw sliced per parameter,
``aten.randn`` turned into Inductor's Philox by ``replace_random_passes``, instead of
``dpfx::add_noise_``), the convolution rules take the accelerator's chunk budget and ATen's
im2col, and Inductor's kernels are Triton's. With the self-check on (the default):

- every rule family (mm, sum, convolution, embedding, a lift, the vmap fallback), both
  strategies, against the batch-of-one reference at batch sizes 0, 1 and more, clipping that bites,
  one compiled pair for all batch sizes (no recompiles);
- a small Hugging Face GPT-2 (tied head, SDPA attention) at batch sizes that collide with the
  sequence length and the width;
- a GroupNorm ResNet-style CNN (Conv2d per-sample and ghost rules);
- bf16 parameters against the float32 DP-SGD gradient;
- the noise: std sigma*C/D per parameter, mean 0, fresh each step, Gaussian tails, reproducible
  with a seed;
- the auditor's canary: at sigma 0, one added example moves the release by at most C/D;
- an nn.LSTM (unrolled at capture, where cuDNN's kernel would run);
- ``noise="optimizer"``: the clipped sums left on the device, noised there (the device's own
  generator, its statistics, its seed and its state in a checkpoint) and stepped by DPOptimizer.

Run it twice with the same ``TORCHINDUCTOR_CACHE_DIR`` for the warm-cache path.
"""
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from dpfx.rules.fallback import FallbackWarning
from support.models import MLP, mse, ResNetGN, tiny_gpt2_lm
from support.noise_stats import assert_noise_per_parameter, assert_uncorrelated
from support.reference import check_one_compiled_pair, loop_dp_sgd_grads, run_dpfx, run_dpfx_multi

# DPFX_TEST_DEVICE=cpu runs the same checks through Inductor's C++ backend (the checks' own test).
DEV = os.environ.get("DPFX_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(),
                                reason="no CUDA device")
C, D = 0.05, 4


def _example_norms(model, loss_fn, inputs, y) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for i in range(y.shape[0]):
        loss = loss_fn(model(*(t[i:i + 1] for t in inputs)), y[i:i + 1])
        grads = torch.autograd.grad(loss, params)
        norms.append(float(torch.sqrt(sum(g.float().pow(2).sum() for g in grads))))
    return norms




@pytest.fixture(autouse=True)
def _exact_matmuls():
    """float32 matrix products in full precision (no TF32), as the reference computes them."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("strategy", ["materialize", "auto"])
def test_every_rule_family(strategy):
    from support.models import FRONTIER_RULES, Families

    torch.manual_seed(0)
    model = Families().to(DEV)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=D,
                      strategy=strategy)
    assert dp.dp_config.backend == "inductor" and dp.dp_config.self_check

    def make(b):
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(0, 11, (b, 5), generator=g)
        return (ids.to(DEV),), (torch.arange(b) % 3).to(DEV)

    with pytest.warns(FallbackWarning, match="'heads'"):
        # 8: the width; 5: the sequence length
        _check(dp, model, F.cross_entropy, make, [4, 0, 1, 8, 5], "mean")
    params = dp._dpfx_backend.param_grads
    if strategy == "materialize":
        # The GPU graph may leave a convolution's bias gradient to a sum (the "sum" rule), and
        # torch 2.11 writes the embedding's backward as an index_put (seen on an H200, torch
        # 2.11, with every gradient exact): either form of each is right.
        other = {"conv.bias": ["sum"], "emb.weight": ["index_put"]}
        for pg in params:
            assert pg.rules in (FRONTIER_RULES[pg.name], other.get(pg.name)), (pg.name, pg.rules)
    assert all(p.grad is None for p in model.parameters())


def _check(dp, model, loss_fn, make, batches, reduction, tol=None):
    check_one_compiled_pair(dp, model, loss_fn, make, batches, reduction, max_grad_norm=C,
                            divisor=D, tol=tol)


def test_gpt2_tiny():
    torch.manual_seed(0)
    model, lm_loss, make = tiny_gpt2_lm(device=DEV)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction="sum")
    _check(dp, model, lm_loss, make, [3, 0, 1, 4, 8], "sum")   # 4 = T, 8 = the width
    fired = {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}
    # The tied LM head: the table's scatter-add and the head's mm. torch 2.13 decomposes the table
    # gradient into a masked index_put (the "embedding" rule), 2.11 into a plain one ("index_put");
    # both have the ghost form, so no (B, V, d) tables either way.
    scatter, head = sorted(fired["model.transformer.wte.weight"])
    assert (scatter, head) in {("embedding", "mm"), ("index_put", "mm")}, (scatter, head)
    strategy = {pg.name: pg.strategy for pg in dp._dpfx_backend.param_grads}
    assert strategy["model.transformer.wte.weight"] == "ghost"


@pytest.mark.parametrize("strategy", ["materialize", "auto"])
def test_resnet_gn(strategy):
    torch.manual_seed(0)
    model = ResNetGN(c=4).to(DEV)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=D,
                      strategy=strategy)

    def make(b):
        g = torch.Generator().manual_seed(b)
        x = torch.randn(b, 1, 8, 8, generator=g) * 3
        return (x.to(DEV),), (torch.arange(b) % 3).to(DEV)

    _check(dp, model, F.cross_entropy, make, [3, 0, 1, 4, 8], "mean", {"rtol": 1e-3,
                                                                       "atol": 1e-6})


def test_bf16_parameters_match_the_float32_gradient():
    """bf16 parameters: norms, clipping and the sums in float32, one cast at the output. Each
    parameter's gradient within 3% (relative L2) of the float32 DP-SGD gradient of the same
    model in float32; clipping bites."""
    torch.manual_seed(0)
    ref = MLP(8, 32, 4).to(DEV)
    model = MLP(8, 32, 4).to(DEV)
    model.load_state_dict(ref.state_dict())
    model.to(torch.bfloat16)
    x, y = torch.randn(16, 8, device=DEV) * 3, torch.randn(16, 4, device=DEV)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction="sum")
    got = run_dpfx_multi(dp, model, mse, (x.bfloat16(),), y.bfloat16(), "sum")
    want = loop_dp_sgd_grads(ref, mse, (x,), y, max_grad_norm=C, loss_reduction="sum")
    assert min(_example_norms(ref, mse, (x,), y)) > 2 * C
    for k in want:
        assert got[k].dtype == torch.bfloat16
        err = (got[k].float() - want[k]).norm() / want[k].norm()
        assert err < 0.03, (k, float(err))


SIGMA, C_NOISE, D_NOISE = 4.0, 0.5, 8


def _noise_draws(steps: int, seed, noise: str = "graph") -> dict:
    """The noise of ``steps`` steps, per parameter: the release less the DP-SGD gradient. With
    ``noise="optimizer"`` the release is DPOptimizer's gradient, read off an SGD step of lr 1."""
    torch.manual_seed(0)
    model = MLP(8, 32, 3).to(DEV)  # 387 parameters; fc2.bias has 3
    x, y = torch.randn(6, 8, device=DEV) * 3, torch.randn(6, 3, device=DEV)
    want = loop_dp_sgd_grads(model, mse, (x,), y, max_grad_norm=C_NOISE, loss_reduction="sum")
    want = {k: v / D_NOISE for k, v in want.items()}
    dp = dpfx.compile(model, max_grad_norm=C_NOISE, noise_multiplier=SIGMA,
                      expected_batch_size=D_NOISE, seed=seed, noise=noise)
    if noise == "graph":
        runs = [run_dpfx(dp, model, mse, x, y) for _ in range(steps)]
    else:
        opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), dp)
        assert opt._generator.device.type == torch.device(DEV).type, "noise drawn on the device"
        runs = []
        for _ in range(steps):
            before = {k: p.detach().clone() for k, p in model.named_parameters()}
            opt.zero_grad()
            mse(dp(x), y).backward()
            opt.step()
            runs.append({k: before[k] - p.detach() for k, p in model.named_parameters()})
            with torch.no_grad():       # every step from the same weights
                for k, p in model.named_parameters():
                    p.copy_(before[k])
    return {k: (torch.stack([r[k] for r in runs]) - want[k]).cpu() for k in want}


@pytest.mark.parametrize("noise", ["graph", "optimizer"])
def test_noise_statistics(noise):
    """std sigma*C/D on every parameter (a 3-entry bias on its own) and pooled, mean 0, fresh each
    step, parameters uncorrelated, Gaussian tails (tests/support/noise_stats.py, 5 standard
    errors); in the graph and at the optimizer, whose noise is drawn on the device."""
    draws = _noise_draws(100, seed=2024, noise=noise)
    std = SIGMA * C_NOISE / D_NOISE
    assert_noise_per_parameter(draws, std)
    noise = torch.cat([d.flatten(1) for d in draws.values()], 1)
    assert_uncorrelated(noise[:-1], noise[1:], "consecutive steps")
    assert_uncorrelated(draws["fc1.weight"].flatten(1)[:, :96],
                        draws["fc2.weight"].flatten(1)[:, :96], "fc1.weight and fc2.weight")
    n = noise.numel()
    tail = (noise.abs() > 2 * std).double().mean().item()
    assert abs(tail - 0.0455) < 5 * math.sqrt(0.0455 * 0.9545 / n)


@pytest.mark.parametrize("noise", ["graph", "optimizer"])
def test_seed_reproducible(noise):
    a, b, c = (_noise_draws(2, seed=s, noise=noise) for s in (123, 123, 124))
    for k in a:
        torch.testing.assert_close(a[k], b[k])
        assert not torch.allclose(a[k][0], a[k][1])
        assert not torch.allclose(a[k], c[k])


def test_optimizer_noise_resumes_from_a_checkpoint():
    """A seeded run's device generator travels in DPOptimizer.state_dict(): a new optimizer loaded
    from it after one step draws the second step's noise, not the first's again."""
    def run(steps, state=None):
        torch.manual_seed(0)
        model = MLP(8, 16, 3).to(DEV)
        dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=1.0, expected_batch_size=4,
                          seed=7, noise="optimizer")
        opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp)  # same weights
        if state is not None:
            opt.load_state_dict(state)
        x, y = torch.randn(4, 8, device=DEV), torch.randn(4, 3, device=DEV)
        grads = []
        for _ in range(steps):
            opt.zero_grad()
            mse(dp(x), y).backward()
            opt.step()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).cpu())
        return grads, opt.state_dict()

    (first, second), _ = run(2)
    (_,), state = run(1)
    assert state["generator_device"] == torch.device(DEV).type
    (resumed,), _ = run(1, state)
    torch.testing.assert_close(resumed, second)
    assert not torch.allclose(resumed, first)


def test_canary_moves_the_release_by_at_most_c_over_d():
    """The auditor's view at sigma 0: one canary example with a huge gradient moves the mean
    loss's release by more than 0.99 C/D and at most C/D."""
    def release(with_canary: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).to(DEV)
        dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=D)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(6, 4, generator=g), torch.arange(6) % 3
        if with_canary:
            x, y = torch.cat([x, torch.full((1, 4), 100.0)]), torch.cat([y, torch.tensor([2])])
        F.cross_entropy(dp(x.to(DEV)), y.to(DEV)).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    moved = float((release(True) - release(False)).norm())
    assert 0.99 * C / D < moved <= C / D * (1 + 1e-4), moved


def test_char_lstm():
    """nn.LSTM, unrolled at capture (dpfx/capture/rnn.py) where cuDNN's fused kernel would run, through
    Triton: the Opacus tutorial's char-LSTM at batch sizes 0, 1, 7 (= T) and 4."""
    from support.models import CharLSTM, scale_weights

    torch.manual_seed(0)
    model = scale_weights(CharLSTM(), 2.0).to(DEV)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=D)

    def make(b):
        g = torch.Generator().manual_seed(b)
        return (torch.randint(0, 12, (b, 7), generator=g).to(DEV),), (torch.arange(b) % 4).to(DEV)

    _check(dp, model, F.cross_entropy, make, [4, 0, 1, 7], "mean", {"rtol": 1e-3, "atol": 1e-6})


def test_noise_at_the_optimizer():
    """``noise="optimizer"`` (what distributed and sharded training use): the backward leaves the
    clipped sums on the device, DPOptimizer.step() adds the noise there and steps; at sigma 0 the
    step is SGD on the DP-SGD gradient, and the accountant counts one step."""
    torch.manual_seed(1)
    model = MLP(8, 16, 4).to(DEV)
    x, y = torch.randn(6, 8, device=DEV) * 3, torch.randn(6, 4, device=DEV)
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=D,
                      noise="optimizer")
    acc = dpfx.privacy.Accountant()
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), dp, accountant=acc,
                           sample_rate=0.1)
    want = loop_dp_sgd_grads(model, mse, (x,), y, max_grad_norm=0.1, loss_reduction="sum")
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt.zero_grad()
    mse(dp(x), y).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(s.device.type == torch.device(DEV).type for s in dp.clipped_sums.values())
    opt.step()
    assert acc.steps == 1
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[k] - want[k] / D, rtol=1e-4, atol=1e-6)


CAPTURED_AFTER_A_PLAIN_COMPILE = """
import sys, torch, torch.nn.functional as F
dev = sys.argv[1]
torch.compile(lambda a: (a * 2).sin())(torch.randn(3, device=dev))   # before dpfx's import
import dpfx
from support.models import MLP
from support.reference import assert_close, loop_dp_sgd_grads
torch.manual_seed(0)
model = MLP(8, 16, 4).to(dev)
dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=4,
                  loss=F.cross_entropy)
for b in (5, 0, 1, 8):
    x = torch.randn(b, 8, device=dev) * 3
    y = torch.randint(0, 4, (b,), device=dev)
    for i in range(b):      # clipping bites on every example
        g = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]),
                                list(model.parameters()))
        assert float(sum(t.pow(2).sum() for t in g).sqrt()) > 0.05
    model.zero_grad(set_to_none=True)
    dp.loss(x, y).backward()
    want = loop_dp_sgd_grads(model, F.cross_entropy, (x,), y, max_grad_norm=0.05,
                             loss_reduction="sum")
    got = {k: torch.zeros_like(p) if p.grad is None else p.grad
           for k, p in model.named_parameters()}
    assert_close(got, {k: v / 4 for k, v in want.items()}, rtol=1e-4, atol=1e-6)
assert dp.compile_count == 4, dp.compile_count   # the empty batch: a pair of its own
"""


def test_captured_loss_after_a_plain_compile():
    """The loss captured with the model (``dp.loss(x, y)``), in a process that compiled something
    before importing dpfx, as a notebook does: exact against the batch-of-one loop at batch sizes
    0, 1 and more, clipping biting (the empty batch compiles a pair of its own, as on the CPU).
    On the GPU, Inductor traces with its cached table of random decompositions, which must hold
    dpfx's loss-gradient decomposition."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # tests/
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", CAPTURED_AFTER_A_PLAIN_COMPILE, DEV],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
