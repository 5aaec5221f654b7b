"""Correlated noise once per coordinate across ranks: one spawn of two gloo ranks, two paths.

- replicated: rank 0 draws the noise and holds the correlation state over every coordinate
  (Note [Noise once across ranks] in dpfx/loop/optim.py); rank 1 holds none;
- sharded with ``fully_shard`` per layer: each rank holds the state of the coordinates it owns
  and noises them (Note [Correlated noise where it is drawn]), so the state is sharded like the
  gradients.

Each path trains steps of empty batches at sigma > 0 (the release is the noise alone) with the
run-time check on, and the released noise over every coordinate must have the covariance across
steps sigma^2 C^2 C^{-1} C^{-T} / D^2: a coordinate noised on both ranks would show twice the
variance, one noised by none zero, and the two shards must be independent (one fixed seed mixed
with the rank). backend="eager": the optimizer adds this noise after the graph.
"""
import pytest
import torch
import torch.distributed as dist

import dpfx
from support import gloo_ranks, mf_strategy
from support.models import MLP
from support.noise_stats import assert_uncorrelated

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed")

C, D, SIGMA, STEPS = 0.3, 6, 2.0, 6


def _path(sharded: bool) -> dict:
    torch.manual_seed(0)
    model = MLP(32, 64, 32)                       # 4,192 coordinates
    if sharded:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model.fc1)
        fully_shard(model.fc2)
        fully_shard(model)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=D,
                      seed=7, backend="eager")
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp,
                           mechanism=mf_strategy.toeplitz3(STEPS), check_noise_every=1)
    named = [(n, p) for n, p in model.named_parameters()]
    local = {n: [] for n, _ in named}
    x, y = torch.randn(0, 32), torch.randn(0, 32)
    for _ in range(STEPS):
        opt.zero_grad()
        ((dp(x) - y) ** 2).mean().backward()
        opt.step()
        for n, p in named:
            local[n].append((p.grad.to_local() if sharded else p.grad).clone())
    state = opt._correlated
    return {"local": {n: torch.stack(v) for n, v in local.items()},
            "state": None if state is None else (state.t, state.state_dict()["buffers"].shape),
            "checked": None if opt._check is None else opt._check.checked,
            "padded": sum(layout.padded for layout in dp._sharding._layouts) if sharded else
            sum(p.numel() for _, p in named)}


def _both() -> dict:
    return {"replicated": _path(False), "sharded": _path(True)}


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    results, errors = gloo_ranks.spawn(tmp_path_factory.mktemp("correlated"), 2, _both,
                                       deadline=420)
    assert not errors, errors
    assert sorted(results) == [0, 1], sorted(results)
    return results


def _expected() -> torch.Tensor:
    return mf_strategy.release_covariance(mf_strategy.toeplitz3(STEPS), STEPS, SIGMA * C / D)


def test_replicated_rank0_holds_the_state_and_noises_once(released):
    ranks = [released[r]["replicated"] for r in range(2)]
    assert ranks[0]["state"] == (STEPS, (2, ranks[0]["padded"])), ranks[0]["state"]
    assert ranks[0]["checked"] == STEPS
    assert ranks[1]["state"] is None and ranks[1]["checked"] is None
    for n, g in ranks[1]["local"].items():
        assert torch.equal(g, ranks[0]["local"][n]), f"rank 1 released another {n}"
    noise = torch.cat([g.flatten(1) for g in ranks[0]["local"].values()], 1)
    mf_strategy.assert_covariance(noise, _expected(), "replicated")


def test_sharded_each_rank_holds_the_state_of_its_shard(released):
    ranks = [released[r]["sharded"] for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["state"] == (STEPS, (2, got["padded"])), (r, got["state"])
        assert got["checked"] == STEPS, r
        assert 4192 / 2 <= got["padded"] < 4192, (r, got["padded"])   # its shard, not the model
    full = {n: torch.cat([got["local"][n] for got in ranks], 1) for n in ranks[0]["local"]}
    assert full["fc1.weight"].shape == (STEPS, 64, 32)
    noise = torch.cat([g.flatten(1) for g in full.values()], 1)
    assert noise.shape[1] == 4192
    mf_strategy.assert_covariance(noise, _expected(), "sharded")
    w = full["fc1.weight"].flatten(2)
    assert_uncorrelated(w[:, :32], w[:, 32:], "the two ranks' shards of fc1.weight")
