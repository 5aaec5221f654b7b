"""Poisson sampling: rates, independence, empty batches, DataLoader workers, reproducibility."""
import math
import pickle
from collections import namedtuple

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from dpfx.loop.data import (EmptyBatchCollate, PoissonBatchSampler, expected_batch_size,
                            poisson_loader)


def _indicators(sampler) -> torch.Tensor:
    """steps x N matrix: 1 where index i is in batch t."""
    rows = []
    for batch in sampler:
        row = torch.zeros(sampler.num_samples)
        row[batch] = 1.0
        rows.append(row)
    return torch.stack(rows)


def _sampler(n=1000, q=0.05, steps=400, seed=0):
    return PoissonBatchSampler(n, q, steps=steps, generator=torch.Generator().manual_seed(seed))


def test_inclusion_rate_is_q():
    n, q, steps = 1000, 0.05, 400
    x = _indicators(_sampler(n, q, steps))
    trials = n * steps
    sd = math.sqrt(trials * q * (1 - q))
    assert abs(x.sum().item() - trials * q) < 5 * sd           # a rate of 0.055 is 14 sd off
    # Each index on its own: mean over indices of (count - steps*q)^2 / (steps*q*(1-q)) ~ 1.
    per_index = x.sum(0)
    dispersion = ((per_index - steps * q) ** 2).mean() / (steps * q * (1 - q))
    assert abs(dispersion.item() - 1) < 5 * math.sqrt(2 / n)


def test_batch_sizes_are_binomial_not_fixed():
    n, q, steps = 1000, 0.05, 400
    sizes = _indicators(_sampler(n, q, steps)).sum(1)
    var = n * q * (1 - q)
    assert abs(sizes.mean().item() - n * q) < 5 * math.sqrt(var / steps)
    assert abs(sizes.var().item() / var - 1) < 5 * math.sqrt(2 / (steps - 1))


def test_small_q_times_n_gives_varying_and_empty_batches():
    sampler = _sampler(n=100, q=0.01, steps=500)
    sizes = [len(b) for b in sampler]
    assert 0 in sizes and len(set(sizes)) >= 3
    assert sizes.count(0) == pytest.approx(500 * 0.99 ** 100, abs=5 * math.sqrt(500 * 0.37 * 0.63))
    assert all(b == sorted(b) for b in sampler)


def test_steps_are_independent():
    """Inclusion indicators of consecutive steps are uncorrelated (sd 1/sqrt(N * steps) = 0.0016).

    Shuffling without replacement within an epoch would give about -q/(1-q) = -0.053 here.
    """
    x = _indicators(_sampler(n=1000, q=0.05, steps=400))
    a, b = x[:-1].flatten(), x[1:].flatten()
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(corr) < 5 / math.sqrt(a.numel())


def test_len_is_steps():
    assert len(PoissonBatchSampler(10, 0.01)) == 100                    # one epoch in expectation
    assert len(PoissonBatchSampler(10, 0.3)) == 3
    assert len(PoissonBatchSampler(10, 1.0)) == 1
    sampler = PoissonBatchSampler(list(range(10)), 0.5, steps=7)        # a sized dataset works
    assert sampler.num_samples == 10 and len(sampler) == 7 and len(list(sampler)) == 7
    assert list(PoissonBatchSampler(5, 1.0, steps=2)) == [[0, 1, 2, 3, 4]] * 2
    assert list(PoissonBatchSampler(0, 0.5, steps=3)) == [[], [], []]


def test_same_seed_same_batches():
    assert list(_sampler(seed=3)) == list(_sampler(seed=3))
    assert list(_sampler(seed=3)) != list(_sampler(seed=4))


def test_no_generator_follows_global_seed():
    sampler = PoissonBatchSampler(50, 0.2, steps=5)
    torch.manual_seed(1)
    first, second = list(sampler), list(sampler)
    assert first != second                      # fresh randomness per epoch
    torch.manual_seed(1)
    assert list(sampler) == first


def test_expected_batch_size():
    assert expected_batch_size(60000, 256 / 60000) == 256
    assert expected_batch_size(10, 0.01) == 1
    assert expected_batch_size(7, 1.0) == 7


@pytest.mark.parametrize("call, match", [
    (lambda: PoissonBatchSampler(10, 0.0), "sample_rate must be in \\(0, 1\\]"),
    (lambda: PoissonBatchSampler(10, 1.5), "sample_rate"),
    (lambda: PoissonBatchSampler(10, float("nan")), "sample_rate"),
    (lambda: PoissonBatchSampler(-1, 0.5), "num_samples"),
    (lambda: PoissonBatchSampler(10, 0.5, steps=-1), "steps"),
    (lambda: PoissonBatchSampler(10, 0.5, generator=0), "generator"),
    (lambda: expected_batch_size(0, 0.5), "n must be"),
    (lambda: expected_batch_size(10, 0.0), "sample_rate"),
    (lambda: poisson_loader(TensorDataset(torch.zeros(4)), 0.5, batch_size=2), "batch_size"),
    (lambda: poisson_loader(TensorDataset(torch.zeros(0)), 0.5), "empty"),
])
def test_bad_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------------------------
# DataLoader

def _tensor_dataset(n=40):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 4, generator=g), torch.arange(n))


def _check_loader(loader, dataset, sampler):
    empties = 0
    for (x, y), idx in zip(loader, sampler, strict=True):
        assert x.shape == (len(idx), 3, 4) and x.dtype == torch.float32
        assert y.shape == (len(idx),) and y.dtype == torch.int64
        assert torch.equal(y, torch.tensor(idx, dtype=torch.int64))
        assert torch.equal(x, dataset.tensors[0][idx])
        empties += len(idx) == 0
    assert empties > 0


def test_loader_with_workers_yields_empty_batches_as_b0_tensors():
    dataset = _tensor_dataset()
    loader = poisson_loader(dataset, 0.02, steps=30, num_workers=2, pin_memory=False,
                            generator=torch.Generator().manual_seed(5))
    sampler = PoissonBatchSampler(len(dataset), 0.02, steps=30,
                                  generator=torch.Generator().manual_seed(5))
    assert len(loader) == 30
    _check_loader(loader, dataset, sampler)


@pytest.mark.filterwarnings("ignore:.*pin_memory")
def test_loader_pin_memory_and_default_steps():
    dataset = _tensor_dataset()
    loader = poisson_loader(dataset, 0.02, pin_memory=True,
                            generator=torch.Generator().manual_seed(6))
    sampler = PoissonBatchSampler(len(dataset), 0.02, generator=torch.Generator().manual_seed(6))
    assert len(loader) == 50
    _check_loader(loader, dataset, sampler)


class _Records(Dataset):
    Item = namedtuple("Item", "image meta")

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return self.Item(torch.full((2, 2), float(i), dtype=torch.float16),
                         {"label": i, "weight": 0.5 * i, "name": f"r{i}", "flags": [True, False]})


def test_empty_batch_matches_structure_of_real_batches():
    collate = EmptyBatchCollate(_Records()[0])
    full, empty = collate([_Records()[i] for i in range(3)]), collate([])
    assert isinstance(empty, _Records.Item)
    assert empty.image.shape == (0, 2, 2) and empty.image.dtype == torch.float16
    meta = empty.meta
    assert meta["label"].shape == (0,) and meta["label"].dtype == full.meta["label"].dtype
    assert meta["weight"].shape == (0,) and meta["weight"].dtype == full.meta["weight"].dtype
    assert meta["name"] == []
    assert [f.shape for f in meta["flags"]] == [(0,), (0,)]
    assert meta["flags"][0].dtype == torch.bool
    assert collate([]) is not collate([]) and collate([]).image is not empty.image


def test_custom_collate_is_wrapped_and_picklable():
    collate = EmptyBatchCollate(_Records()[0], _stack_images)
    clone = pickle.loads(pickle.dumps(collate))
    assert clone([]).shape == (0, 2, 2)
    assert clone([_Records()[1]]).shape == (1, 2, 2)
    loader = poisson_loader(_Records(), 0.1, steps=20, collate_fn=_stack_images,
                            generator=torch.Generator().manual_seed(0))
    shapes = {tuple(b.shape[1:]) for b in loader}
    sizes = [len(b) for b in loader]
    assert shapes == {(2, 2)} and 0 in sizes


def _stack_images(batch):
    return torch.stack([item.image for item in batch])


def test_distributed_shards_partition_the_dataset_and_keep_rate_q():
    """Rank r samples the examples r, r+W, ...: the shards are disjoint and cover the dataset,
    each example's inclusion rate is q, and ranks without a generator draw independently."""
    n, q, world, steps = 30, 0.3, 3, 3000
    samplers = [PoissonBatchSampler(n, q, steps=steps, rank=r, world_size=world)
                for r in range(world)]
    counts = torch.zeros(n)
    owners = {}
    per_rank_batches = []
    for r, s in enumerate(samplers):
        batches = list(s)
        per_rank_batches.append(batches)
        for b in batches:
            for i in b:
                assert owners.setdefault(i, r) == r
                counts[i] += 1
    assert set(owners) == set(range(n))
    rate = counts / steps
    assert (rate - q).abs().max().item() < 5 * (q * (1 - q) / steps) ** 0.5
    # independent across ranks: rank 0's and rank 1's batch sizes are uncorrelated
    a = torch.tensor([len(b) for b in per_rank_batches[0]], dtype=torch.float)
    b = torch.tensor([len(b) for b in per_rank_batches[1]], dtype=torch.float)
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 5 / steps ** 0.5
    with pytest.raises(ValueError, match="rank must be < world_size"):
        PoissonBatchSampler(n, q, rank=3, world_size=3)


def test_ranks_given_one_seed_draw_independent_masks():
    # Every rank is handed the same seeded generator (a replayable run). Drawn as given, rank 0
    # and rank 1 would keep the same positions of their partitions, so examples 2k and 2k + 1
    # would join together: the union would not be a Poisson batch. The sampler mixes the rank in.
    q, n = 0.5, 4000
    masks = []
    for rank in (0, 1):
        sampler = PoissonBatchSampler(n, q, steps=1, rank=rank, world_size=2,
                                      generator=torch.Generator().manual_seed(7))
        (batch,) = list(sampler)
        mask = torch.zeros(n // 2, dtype=torch.bool)
        mask[(torch.tensor(batch, dtype=torch.long) - rank) // 2] = True
        masks.append(mask)
    together = float((masks[0] & masks[1]).float().mean())
    assert abs(together - q * q) < 0.04, together          # independent: q^2, not q
    again = PoissonBatchSampler(n, q, steps=1, rank=1, world_size=2,
                                generator=torch.Generator().manual_seed(7))
    assert list(again) == [sorted(((masks[1].nonzero().flatten() * 2) + 1).tolist())]  # replayable
