"""Adaptive clipping over two gloo ranks (Note [Adaptive clipping over several ranks] in
dpfx/loop/grads.py): the count of unclipped examples travels with the clipped sums.

At sigma = 0, replicated (all-reduce) and sharded with ``fully_shard`` (reduce-scatter), every
step's bound and every parameter equal an independent reference over the union of the ranks'
batches (per-example gradients by torch.func, each clipped at that step's C_t, the count of
norms at most C_t, Andrew et al.'s update), with batch sizes that differ across ranks, an empty
one among them. At sigma > 0 the count and the gradient are each noised once, replicated and
sharded: test_noise_ranks.py.
"""
import math

import pytest
import torch
import torch.distributed as dist

import dpfx
from support import gloo_ranks
from support.models import MLP
from support.reference import per_example_grads, per_example_norms

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed")

C0, D, LR, ETA, QUANTILE = 1.0, 6, 0.5, 0.5, 0.5
SIZES = [(3, 2), (4, 0), (1, 5)]


def _data(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    n = SIZES[step][rank]
    return torch.randn(n, 8, generator=g) * 3, torch.randn(n, 4, generator=g)


def _example_loss(out, y):
    return ((out - y) ** 2).mean()


def _train(mode: str):
    """This rank's run at sigma 0: (parameters after it, the bound after every step)."""
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    if mode == "sharded":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model.fc1)
        fully_shard(model.fc2)
        fully_shard(model)
    dp = dpfx.compile(model, max_grad_norm=C0, noise_multiplier=0.0, expected_batch_size=D,
                      clipping="adaptive", target_unclipped_quantile=QUANTILE, clip_lr=ETA,
                      backend="eager", seed=11, blocks=False)   # the one-graph sharded path
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), dp)
    bounds = []
    for step in range(len(SIZES)):
        x, y = _data(step, dist.get_rank())
        opt.zero_grad()
        out = dp(x)
        per_example = ((out - y) ** 2).flatten(1).mean(1)
        (per_example.sum() / D).backward()
        opt.step()
        bounds.append(dp.adaptive_clip.bound)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
              for n, p in model.named_parameters()}
    return params, bounds


def _reference():
    """SGD on the union of the ranks' batches, each example's gradient clipped at C_t, and the
    bound moved by the count of norms at most C_t. Shares no code with dpfx."""
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    bound, bounds, bit = C0, [], False
    for step in range(len(SIZES)):
        (x0, y0), (x1, y1) = _data(step, 0), _data(step, 1)
        x, y = torch.cat([x0, x1]), torch.cat([y0, y1])
        g = per_example_grads(model, _example_loss, x, y)
        norms = per_example_norms(g)
        bit = bit or bool((norms > bound).any())
        factor = (bound / (norms + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                grad = (g[n] * factor.view(-1, *[1] * (g[n].dim() - 1))).sum(0) / D
                p -= LR * grad
        count = float(((norms <= bound).float() - 0.5).sum())
        bound = bound * math.exp(-ETA * (count / D + 0.5 - QUANTILE))
        bounds.append(bound)
    assert bit, "clipping must bite at some step"
    return {n: p.detach() for n, p in model.named_parameters()}, bounds


def _both() -> dict:
    return {mode: _train(mode) for mode in ("replicated", "sharded")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both modes in one spawn: starting the ranks is most of the time."""
    results, errors = gloo_ranks.spawn(tmp_path_factory.mktemp("adaptive"), 2, _both,
                                       deadline=300)
    assert not errors, errors
    return results


@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_bound_and_parameters_equal_the_reference_on_the_union(runs, mode):
    results = {rank: runs[rank][mode] for rank in runs}
    want_params, want_bounds = _reference()
    assert len(set(want_bounds)) == len(want_bounds), "the bound must move every step"
    for rank in range(2):
        params, bounds = results[rank]
        assert bounds == pytest.approx(want_bounds, rel=1e-6), (rank, bounds, want_bounds)
        for n in want_params:
            torch.testing.assert_close(params[n], want_params[n], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {n}: {m}")
