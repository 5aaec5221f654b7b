"""Distributed DP-SGD over torch.distributed (gloo, 2 processes spawned by the test itself).

With sigma = 0 the two ranks' gradients and parameters after k steps equal the independent
reference (tests/support/reference.py, torch.func per-example gradients) on the union of the ranks'
batches, with clipping that bites, both loss reductions and both strategies; with sigma > 0
(seeded) the noise is added once globally (std sigma*C/D on every parameter, tested per
parameter at 5 standard errors), is identical on every rank and fresh every step. A mismatched
model is an error on every rank, not a hang; noise in the graph is refused under more than one
rank (each rank would add its own). Every collective runs under a bounded timeout.
"""
import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dpfx
from support import gloo_ranks
from support.models import MLP
from support.noise_stats import assert_noise_per_parameter, assert_uncorrelated
from support.reference import clip_fraction, dp_sgd_grads

C, D, LR, SIGMA = 0.3, 6, 0.5, 2.0
# Each step, each rank's batch (rank 1's second batch is empty; sizes differ across ranks).
SIZES = [(3, 2), (4, 0), (1, 5)]
NOISE_STEPS = 60
# (strategy, loss reduction) of the exact runs: the mm rule's materialized and ghost forms.
CASES = [("materialize", "mean"), ("ghost", "sum")]


def _data(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    n = SIZES[step][rank]
    return torch.randn(n, 8, generator=g) * 3, torch.randn(n, 4, generator=g)


def _example_loss(out, y):
    return ((out - y) ** 2).mean()


def _loss(dp, x, y, reduction="mean"):
    out = dp(x)
    if x.shape[0] == 0:
        return out.sum() * 0.0
    per_example = ((out - y) ** 2).flatten(1).mean(1)
    return per_example.mean() if reduction == "mean" else per_example.sum()


def _train(strategy, reduction, sigma, steps, empty=False):
    """One private run on this rank: (parameters after the run, p.grad of every step)."""
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=D,
                      loss_reduction=reduction, strategy=strategy, seed=7, backend="eager")
    assert dp.dp_config.noise == "optimizer"          # chosen because world > 1
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), dp)
    grads = {n: [] for n, _ in model.named_parameters()}
    for step in range(steps):
        x, y = _data(step % len(SIZES), dist.get_rank())
        if empty:
            x, y = x[:0], y[:0]
        opt.zero_grad()
        _loss(dp, x, y, reduction).backward()
        opt.step()
        for n, p in model.named_parameters():
            grads[n].append(p.grad.clone())
    return ({n: p.detach() for n, p in model.named_parameters()},
            {n: torch.stack(g) for n, g in grads.items()})


def _graph_noise_refusal() -> str:
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=D,
                      noise="graph", backend="eager")
    try:
        dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), dp)
    except ValueError as e:
        return str(e)
    return "not refused"


def _scenario(scenario: str):
    if scenario == "steps":         # the exact runs, the noisy one and the refusal: one spawn
        return {**{case: _train(*case, sigma=0.0, steps=len(SIZES)) for case in CASES},
                "noise": _train("auto", "mean", SIGMA, NOISE_STEPS, empty=True),
                "graph_noise": _graph_noise_refusal()}
    torch.manual_seed(0)                                  # "mismatch"
    model = MLP(8, 16, 4)
    if dist.get_rank() == 1:
        with torch.no_grad():
            model.fc1.weight.add_(1.0)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA,
                      expected_batch_size=D, backend="eager")
    dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), dp)
    return {}


def _spawn(tmp_path, scenario):
    return gloo_ranks.spawn(tmp_path, 2, _scenario, scenario, deadline=240, timeout=60)


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    results, errors = _spawn(tmp_path_factory.mktemp("steps"), "steps")
    assert not errors, errors
    return results


def _reference_run(reduction):
    """SGD on the union of the ranks' batches with the torch.func DP-SGD gradient (sigma = 0):
    (parameters after the run, gradient of every step). Shares no code with dpfx."""
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    grads = {n: [] for n, _ in model.named_parameters()}
    for step in range(len(SIZES)):
        (x0, y0), (x1, y1) = _data(step, 0), _data(step, 1)
        x, y = torch.cat([x0, x1]), torch.cat([y0, y1])
        assert clip_fraction(model, _example_loss, x, y, C) == 1.0      # clipping bites
        want = dp_sgd_grads(model, _example_loss, x, y, max_grad_norm=C,
                            loss_reduction=reduction, expected_batch_size=D)
        with torch.no_grad():
            for n, p in model.named_parameters():
                grads[n].append(want[n])
                p -= LR * want[n]
    return ({n: p.detach() for n, p in model.named_parameters()},
            {n: torch.stack(g) for n, g in grads.items()})


def test_two_ranks_equal_the_reference_on_the_union(steps):
    results = steps
    for case in CASES:
        want_params, want_grads = _reference_run(case[1])
        for rank in range(2):
            params, grads = results[rank][case]
            for n in want_params:
                torch.testing.assert_close(grads[n], want_grads[n], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{case} rank {rank} {n}: {m}")
                torch.testing.assert_close(params[n], want_params[n], rtol=1e-5, atol=1e-6)
                assert torch.equal(grads[n], results[0][case][1][n])  # same on every rank


def test_noise_is_added_once_globally(steps):
    results = steps
    params, noise = results[0]["noise"]                # 60 steps of empty batches: pure noise
    for n in noise:                                    # identical on every rank
        assert torch.equal(noise[n], results[1]["noise"][1][n])
        assert torch.equal(params[n], results[1]["noise"][0][n])
    # sigma*C/D once, on every parameter: not sqrt(2) times that (independent noise on both
    # ranks), not 2x (the same noise on both), not 0 (on none).
    assert_noise_per_parameter(noise, SIGMA * C / D)
    flat = torch.cat([d.flatten(1) for d in noise.values()], 1)
    assert_uncorrelated(flat[:-1], flat[1:], "consecutive steps")
    for rank in range(2):
        assert "noise='optimizer'" in results[rank]["graph_noise"], results[rank]["graph_noise"]


def test_mismatched_models_fail_on_every_rank(tmp_path):
    results, errors = _spawn(tmp_path, "mismatch")
    assert set(errors) == {0, 1}, errors
    assert all("ranks hold different models" in e for e in errors.values())


def _killed_on_rank_1():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return {}


def test_a_rank_dying_during_its_work_fails_the_run(tmp_path):
    """Only a death after every rank finished is let through (Note [A rank that aborts after
    its work] in gloo_ranks.py)."""
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        gloo_ranks.spawn(tmp_path, 2, _killed_on_rank_1, deadline=120, timeout=30)
    assert not (tmp_path / "rank1.done").exists()


def test_ddp_wrapped_model_is_refused():
    class FakeDDP(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, module):                       # no process group needed to refuse
            torch.nn.Module.__init__(self)
            self.module = module

    with pytest.raises(TypeError, match="compile the bare module"):
        dpfx.compile(FakeDDP(MLP()), max_grad_norm=1.0, noise_multiplier=1.0)
