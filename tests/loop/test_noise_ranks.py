"""Noise once, on every rank, in every multi-rank path: one spawn of two gloo ranks runs them all.

Each path trains steps of empty batches at sigma > 0 (NOISE_STEPS; COUNT_STEPS under adaptive
clipping), so every release is the noise alone (the clipped sum of no example is 0), and every
rank keeps what it released:

- replicated, through ``make_private`` (noise="optimizer", chosen because there are two ranks):
  rank 0 noises the all-reduced sum (Note [Noise once across ranks] in dpfx/loop/optim.py), and
  every rank's accountant counts each global step once at the dataset's q;
- sharded with ``fully_shard`` per layer, as one graph (``blocks=False``) and by default (fc1
  and fc2 are blocks whose sums the backward reduce-scatters: Note [A sharded model gets blocks
  by default] in dpfx/api.py): each rank noises the shard it owns (Note [Sharded DP-SGD] in
  dpfx/loop/fsdp.py);
- adaptive clipping, replicated and sharded: the count of unclipped examples goes with the sums
  and rank 0 noises it (Note [Adaptive clipping over several ranks] in dpfx/loop/grads.py).

The released gradient is checked on each rank's own coordinates (its shard, or the whole
gradient when replicated), parameter by parameter, and coordinate by coordinate over the steps:
std sigma*C/D (under adaptive clipping sigma_grad*C_t/D, C_t the bound the step clipped to). A
coordinate noised by two ranks shows sqrt(2) times that, a shard noised by none 0. The count's
noise is read back from the bound's moves (an empty batch's centered count is 0): std sigma_b,
not sqrt(2) sigma_b. The ranks' shards draw independent streams from one fixed seed.

One spawn: starting two ranks (importing torch and dpfx in each) is most of the time; each
path adds its compile (backend="eager": the optimizer adds this noise after the graph, whatever
the backend; the sharded step through Inductor is test_fsdp.py's exact test) and its steps.
"""
import math

import pytest
import torch
import torch.distributed as dist

import dpfx
from support import gloo_ranks
from support.models import MLP
from support.noise_stats import (Z, assert_gaussian_scale, assert_uncorrelated,
                                 detectable_std_error, rms_standard_error)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed")

C, D, LR, SIGMA = 0.3, 6, 0.5, 2.0
SIGMA_B, ETA, QUANTILE = 3.0, 0.5, 0.5
# A coordinate's std over NOISE_STEPS draws, and the count's over COUNT_STEPS, resolve sqrt(2)
# (detectable_std_error): the count is one draw a step
NOISE_STEPS, COUNT_STEPS = 150, 300
PATHS = ["replicated", "sharded", "sharded_blocks", "adaptive_replicated", "adaptive_sharded"]


# -- what each rank runs -----------------------------------------------------------------------
def _shard(model) -> None:
    from torch.distributed.fsdp import fully_shard
    fully_shard(model.fc1)
    fully_shard(model.fc2)
    fully_shard(model)


def _noise(path: str) -> dict:
    """Steps of empty batches on this rank: every step's gradient as this rank holds it (its
    shard, when sharded), and the bound before every step."""
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    sharded = "sharded" in path
    if sharded:
        _shard(model)
    settings = dict(max_grad_norm=C, noise_multiplier=SIGMA, seed=7, backend="eager")
    if path.startswith("adaptive"):
        settings.update(clipping="adaptive", target_unclipped_quantile=QUANTILE, clip_lr=ETA,
                        count_noise_multiplier=SIGMA_B)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    if path == "replicated":
        data = torch.utils.data.TensorDataset(torch.randn(10 * D, 8), torch.randn(10 * D, 4))
        dp, opt, _, accountant = dpfx.make_private(model, sgd, data, batch_size=D, **settings)
    else:
        accountant = None
        dp = dpfx.compile(model, expected_batch_size=D,
                          blocks=False if path == "sharded" else None, **settings)
        opt = dpfx.DPOptimizer(sgd, dp)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    local = {n: [] for n, _ in named}
    bounds = []
    x, y = torch.randn(0, 8), torch.randn(0, 4)
    for _ in range(COUNT_STEPS if path.startswith("adaptive") else NOISE_STEPS):
        bounds.append(dp.adaptive_clip.bound if dp.adaptive_clip is not None else C)
        opt.zero_grad()
        ((dp(x) - y) ** 2).flatten(1).mean(1).mean().backward()
        opt.step()
        for n, p in named:
            if sharded:
                assert p.grad.placements == p.placements, (n, p.grad.placements)
            local[n].append((p.grad.to_local() if sharded else p.grad).clone())
    bounds.append(dp.adaptive_clip.bound if dp.adaptive_clip is not None else C)
    return {"noise": dp.dp_config.noise, "expected": dp.dp_config.expected_batch_size,
            "blocks": sorted(place.name for place in dp._sharding.places.values())
            if sharded else [],
            "shapes": {n: tuple(p.shape) for n, p in named},
            "local": {n: torch.stack(v) for n, v in local.items()},
            "bounds": bounds,
            "accounted": None if accountant is None else accountant.history}


def _every_path() -> dict:
    return {path: _noise(path) for path in PATHS}


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    results, errors = gloo_ranks.spawn(tmp_path_factory.mktemp("noise"), 2, _every_path,
                                       deadline=420)
    assert not errors, errors
    assert sorted(results) == [0, 1], sorted(results)
    return results


# -- the checks --------------------------------------------------------------------------------
def _grad_noise_multiplier(path: str) -> float:
    """Andrew et al.'s split of sigma between the gradient and the count (Note [Adaptive
    clipping] in dpfx/privacy/adaptive.py), computed here from the formula."""
    if not path.startswith("adaptive"):
        return SIGMA
    return (SIGMA ** -2 - (2 * SIGMA_B) ** -2) ** -0.5


def _check_noised_once(released, path: str) -> None:
    ranks = [released[r][path] for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["noise"] == "optimizer" and got["expected"] == D, (r, got["noise"])
        assert got["bounds"] == ranks[0]["bounds"], f"rank {r}'s bounds differ from rank 0's"
    # each step's std: sigma C_t / D, C_t the bound the step clipped to
    bounds = torch.tensor(ranks[0]["bounds"][:-1], dtype=torch.float64)
    std = _grad_noise_multiplier(path) * bounds / D
    steps = len(bounds)
    assert steps >= NOISE_STEPS and detectable_std_error(steps) < 2 ** 0.5 - 1

    def scaled(draws):                       # (steps, ...) in units of each step's std
        return draws.double() / std.view(-1, *[1] * (draws.dim() - 1))

    # every coordinate: the ranks' shards end to end (Shard(0)) when sharded, else one
    # gradient that every rank holds
    if "sharded" in path:
        full = {n: torch.cat([got["local"][n] for got in ranks], 1) for n in ranks[0]["local"]}
    else:
        full = ranks[0]["local"]
        for n, g in ranks[1]["local"].items():
            assert torch.equal(g, full[n]), f"rank 1 released another {n}"
    for n, g in full.items():
        assert g.shape[1:] == ranks[0]["shapes"][n], (n, g.shape)
    # each rank's own coordinates, parameter by parameter
    for r, got in enumerate(ranks):
        for n, mine in got["local"].items():
            assert detectable_std_error(mine[0].numel() * steps) < 2 ** 0.5 - 1, n
            assert_gaussian_scale(scaled(mine), 1.0, f"{path}: rank {r}'s coordinates of {n}")
    # every coordinate on its own, over the steps
    flat = scaled(torch.cat([g.flatten(1) for g in full.values()], 1))   # (steps, coordinates)
    assert_gaussian_scale(flat, 1.0, f"{path}: all coordinates")
    rms = flat.pow(2).mean(0).sqrt()
    worst = int((rms - 1).abs().argmax())
    assert float((rms - 1).abs().max()) < Z * rms_standard_error(steps), \
        f"{path}: coordinate {worst}: std {float(rms[worst]):.3f} x sigma C / D"
    assert_uncorrelated(flat[:-1], flat[1:], f"{path}: consecutive steps")
    if "sharded" in path:      # one fixed seed, two ranks: independent streams
        w = scaled(full["fc1.weight"])
        assert_uncorrelated(w[:, :8], w[:, 8:], f"{path}: the two ranks' shards of fc1.weight")


def _check_count_noised_once(released, path: str) -> None:
    """An empty batch's centered count is 0, so log(C_{t+1} / C_t) = -eta (z / D + 1/2 - q):
    z, the count's noise, has std sigma_b."""
    bounds = released[0][path]["bounds"]
    z = torch.tensor([D * (-math.log(b / a) / ETA - 0.5 + QUANTILE)
                      for a, b in zip(bounds[:-1], bounds[1:])], dtype=torch.float64)
    assert len(z) == COUNT_STEPS and detectable_std_error(len(z)) < 2 ** 0.5 - 1
    assert_gaussian_scale(z, SIGMA_B, f"{path}: the count's noise")


def test_replicated_noise_is_added_once_and_each_step_counted_once(released):
    _check_noised_once(released, "replicated")
    for r in range(2):      # (sigma, q, steps): q of the whole dataset, each global step once
        assert released[r]["replicated"]["accounted"] == [(SIGMA, D / (10 * D), NOISE_STEPS)], r


@pytest.mark.parametrize("path", ["sharded", "sharded_blocks"])
def test_each_rank_noises_its_shard_once(released, path):
    # the default took the block path (fc1, fc2 have places); blocks=False the one graph
    assert released[0][path]["blocks"] == (["fc1", "fc2"] if path == "sharded_blocks" else []), \
        released[0][path]["blocks"]
    _check_noised_once(released, path)


@pytest.mark.parametrize("path", ["adaptive_replicated", "adaptive_sharded"])
def test_adaptive_count_and_gradient_are_noised_once(released, path):
    _check_count_noised_once(released, path)
    _check_noised_once(released, path)
