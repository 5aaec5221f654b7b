"""Cyclic Poisson and balls-in-bins samplers: rates, the separation and once-per-epoch properties
exactly, reproducibility, empty batches, secure mode and ranks."""
import math

import pytest
import torch

from dpfx.loop.data import PoissonBatchSampler
from dpfx.loop.samplers import BallsInBinsSampler, CyclicPoissonSampler
from dpfx.privacy.matrix_accounting import BallsInBins, CyclicPoisson


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _steps_of(batches, n):
    """For each example, the steps it appears in."""
    seen = [[] for _ in range(n)]
    for t, batch in enumerate(batches):
        assert batch == sorted(batch) and len(set(batch)) == len(batch)
        for i in batch:
            seen[i].append(t)
    return seen


# -- cyclic Poisson --------------------------------------------------------------------------------

def test_cyclic_poisson_rates():
    """Each example joins each step of its part with probability q * parts (q on average over
    all steps); the parts split the data about evenly, each example in exactly one."""
    n, q, parts, steps = 1000, 0.02, 4, 400
    sampler = CyclicPoissonSampler(n, q, parts, steps=steps, generator=_g())
    assert not isinstance(sampler, PoissonBatchSampler)     # not DP-SGD's Poisson accounting
    assert sampler.sampling == CyclicPoisson(parts, q)
    assert sorted(torch.cat(sampler.partition).tolist()) == list(range(n))
    sizes = torch.tensor([len(p) for p in sampler.partition], dtype=torch.float64)
    assert (sizes - n / parts).abs().max() < 5 * math.sqrt(n * (1 / parts) * (1 - 1 / parts))
    counts = torch.tensor([len(s) for s in _steps_of(list(sampler), n)], dtype=torch.float64)
    chances, rate = steps // parts, q * parts
    total_sd = math.sqrt(n * chances * rate * (1 - rate))
    assert abs(counts.sum().item() - n * chances * rate) < 5 * total_sd
    dispersion = ((counts - chances * rate) ** 2).mean() / (chances * rate * (1 - rate))
    assert abs(dispersion.item() - 1) < 5 * math.sqrt(2 / n)


@pytest.mark.parametrize("secure", [False, True])
def test_cyclic_poisson_separation_holds_across_passes(secure):
    """Any two appearances of an example are >= parts steps apart, over two passes too, and an
    example only ever appears in the steps of its own part."""
    n, q, parts, steps = 300, 0.1, 3, 30
    sampler = CyclicPoissonSampler(n, q, parts, steps=steps, secure_mode=secure,
                                   generator=None if secure else _g(1))
    batches = list(sampler) + list(sampler)
    part_of = {i: j for j, p in enumerate(sampler.partition) for i in p.tolist()}
    appearances = 0
    for i, ts in enumerate(_steps_of(batches, n)):
        appearances += len(ts)
        assert all(b - a >= parts for a, b in zip(ts, ts[1:])), (i, ts)
        assert all(t % parts == part_of[i] for t in ts)
    assert appearances > n                                  # the check saw repeated examples


def test_cyclic_poisson_reproducible_and_partition_seed():
    a = CyclicPoissonSampler(200, 0.05, 4, generator=_g(3))
    assert len(a) == 20 and len(list(a)) == 20              # round(1 / 0.05), a multiple of 4
    assert list(a) != list(a)                               # the generator moves on
    assert list(CyclicPoissonSampler(200, 0.05, 4, generator=_g(3))) == \
        list(CyclicPoissonSampler(200, 0.05, 4, generator=_g(3)))
    assert list(CyclicPoissonSampler(200, 0.05, 4, generator=_g(3))) != \
        list(CyclicPoissonSampler(200, 0.05, 4, generator=_g(4)))
    same = CyclicPoissonSampler(200, 0.05, 4, secure_mode=True, partition_seed=a.partition_seed)
    assert all(torch.equal(x, y) for x, y in zip(a.partition, same.partition))
    assert len(CyclicPoissonSampler(200, 0.05, 3)) == 21     # rounded up to a multiple of 3


def test_cyclic_poisson_empty_batches():
    sizes = [len(b) for b in CyclicPoissonSampler(40, 0.01, 2, steps=200, generator=_g())]
    assert 0 in sizes and max(sizes) > 0
    assert list(CyclicPoissonSampler(0, 0.25, 2, steps=4, generator=_g())) == [[]] * 4


def test_cyclic_poisson_refusals():
    with pytest.raises(ValueError, match="sample_rate=0.3 and parts=4"):
        CyclicPoissonSampler(100, 0.3, 4)
    with pytest.raises(ValueError, match="steps=10 and parts=4: use steps=12"):
        CyclicPoissonSampler(100, 0.1, 4, steps=10)
    with pytest.raises(ValueError, match="secure_mode"):
        CyclicPoissonSampler(100, 0.1, 4, generator=_g(), secure_mode=True)
    with pytest.raises(ValueError, match="parts must be an int >= 1"):
        CyclicPoissonSampler(100, 0.1, 0)


def test_cyclic_poisson_ranks_share_one_partition():
    """Ranks handed one seed sample disjoint shards that cover the data, by one global partition:
    the union keeps the separation."""
    n, q, parts, steps, world = 120, 0.2, 3, 60, 2
    ranks = [CyclicPoissonSampler(n, q, parts, steps=steps, generator=_g(5), rank=r,
                                  world_size=world) for r in range(world)]
    assert ranks[0].partition_seed == ranks[1].partition_seed
    union = [sorted(a + b) for a, b in zip(*(list(s) for s in ranks))]
    owners = [set().union(*map(set, s)) for s in (list(r) for r in ranks)]
    assert not owners[0] & owners[1]
    for ts in _steps_of(union, n):
        assert len({t % parts for t in ts}) <= 1
    rate = sum(map(len, union)) / (n * steps)
    assert abs(rate - q) < 5 * math.sqrt(q * (1 - q) / (n * steps))


# -- balls in bins ---------------------------------------------------------------------------------

@pytest.mark.parametrize("secure", [False, True])
def test_balls_in_bins_once_per_epoch(secure):
    n, per_epoch, epochs = 500, 7, 40
    sampler = BallsInBinsSampler(n, per_epoch, epochs=epochs, secure_mode=secure,
                                 generator=None if secure else _g(2))
    batches = list(sampler)
    assert len(sampler) == len(batches) == per_epoch * epochs
    assert sampler.sampling == BallsInBins(per_epoch)
    position = torch.zeros(per_epoch)
    for e in range(epochs):
        epoch = batches[e * per_epoch:(e + 1) * per_epoch]
        assert sorted(i for b in epoch for i in b) == list(range(n))   # exactly once each
        for t, b in enumerate(epoch):
            position[t] += len(b)
    # the step of an example is uniform: per-step counts are Multinomial(n * epochs, 1/S)
    expected = n * epochs / per_epoch
    chi2 = (((position - expected) ** 2) / expected).sum().item()
    assert chi2 < per_epoch - 1 + 5 * math.sqrt(2 * (per_epoch - 1))


def test_balls_in_bins_reproducible_and_empty():
    a = list(BallsInBinsSampler(50, 5, epochs=2, generator=_g(9)))
    assert a == list(BallsInBinsSampler(50, 5, epochs=2, generator=_g(9)))
    assert a != list(BallsInBinsSampler(50, 5, epochs=2, generator=_g(10)))
    sizes = [len(b) for b in BallsInBinsSampler(3, 10, generator=_g())]
    assert sizes.count(0) >= 7 and sum(sizes) == 3
    assert list(BallsInBinsSampler(0, 3, epochs=2, generator=_g())) == [[]] * 6
    assert len(BallsInBinsSampler(10, 4)) == 4                          # one epoch by default
    with pytest.raises(ValueError, match="steps_per_epoch must be an int >= 1"):
        BallsInBinsSampler(10, 0)


def test_balls_in_bins_ranks():
    n, per_epoch, world = 90, 4, 3
    ranks = [list(BallsInBinsSampler(n, per_epoch, epochs=2, generator=_g(1), rank=r,
                                     world_size=world)) for r in range(world)]
    union = [sorted(sum(bs, [])) for bs in zip(*ranks)]
    for e in range(2):
        assert sorted(sum(union[e * per_epoch:(e + 1) * per_epoch], [])) == list(range(n))
