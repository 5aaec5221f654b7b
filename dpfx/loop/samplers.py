"""Batch samplers for matrix-factorization mechanisms: cyclic Poisson and balls-in-bins.

    from dpfx.loop.samplers import BallsInBinsSampler, CyclicPoissonSampler

    g = torch.Generator().manual_seed(0)
    sampler = CyclicPoissonSampler(len(train_set), 256 / len(train_set), parts=4, generator=g)
    loader = DataLoader(train_set, batch_sampler=sampler,
                        collate_fn=EmptyBatchCollate(train_set[0]))      # batches may be empty
    bins = BallsInBinsSampler(len(train_set), steps_per_epoch=235, epochs=3, generator=g)

Both yield one sorted list of indices per step, like ``PoissonBatchSampler`` (loop/data.py), and
take its ``generator``, ``rank``/``world_size`` and ``secure_mode``. Neither is a
``PoissonBatchSampler``: DP-SGD's Poisson accountant does not bound their epsilon. Account them
with ``dpfx.privacy.matrix_accounting``: ``MatrixAccountant(strategy, sampler.sampling)``
(``CyclicPoisson`` or ``BallsInBins``; ``MinSeparation(parts, ...)`` also holds for the cyclic
sampler, without amplification).

# Note [Cyclic Poisson sampling]
Each example is given one of ``parts`` (b) parts, uniformly and independently of the others, once
for the sampler's life; step t Poisson-samples part t mod b at rate q * b, so an example joins a
step with probability q on average and E[batch] = q * N as under plain Poisson sampling. An
example can only join the steps of its part: any two of its steps are >= b apart (b-min-
separation), and in t steps it has at most ceil(t / b) chances. With a strategy of at most b
bands this is what the amplification of Choquette-Choo et al. 2023 ("Amplified banded matrix
factorization") needs. Independent parts (not a shuffled equal split) keep add-or-remove-one
neighbours honest: adding an example moves no other example's part (JAX-Privacy's
``PartitionType.INDEPENDENT`` for the same reason). ``steps`` is a multiple of b, so a second pass
(``iter()`` again) continues the cycle where the first ended (part b - 1, then part 0) and the
separation holds across passes. The parts are a public, data-independent choice; only the Poisson
draws must be secret. They come from ``partition_seed`` (drawn from ``generator``, from torch's
global RNG, or in secure mode from the OS, when not given): a resumed run must rebuild the
sampler with the same ``partition_seed`` (the same ``generator`` seed gives it), else an example
may change part at the restart and join two steps closer than b.
(tests/loop/test_samplers.py::test_cyclic_poisson_separation_holds_across_passes)

# Note [Balls in bins]
Every epoch each example goes to one step of that epoch, uniformly and independently (Chua et
al. 2024, "Balls-and-bins sampling for DP-SGD"): each example appears exactly once per epoch and
batch sizes are Binomial(N, 1 / steps_per_epoch). Across an epoch boundary an example can join the
last step of one epoch and the first of the next (separation 1). In secure mode a step is an
OS-CSPRNG 64-bit draw reduced modulo steps_per_epoch after rejecting the top 2^64 mod S values,
so it is exactly uniform.
"""
from __future__ import annotations

import math
import numbers
import os
import secrets
from typing import Iterator, Sized

import numpy as np
import torch
from torch.utils.data import Sampler

from dpfx.loop.data import (_loader, _secure_mask, _size, check_shard, pass_generator,
                            poisson_loader, rank_generator)
from dpfx.privacy import validate
from dpfx.privacy.matrix_accounting import BallsInBins, CyclicPoisson

__all__ = ["CyclicPoissonSampler", "BallsInBinsSampler"]


class _RankedSampler(Sampler[list[int]]):
    """What both samplers share with ``PoissonBatchSampler``: the size, the generator, secure mode
    and this rank's shard r, r + W, ... (Note [Distributed Poisson sampling] in loop/data.py)."""

    def __init__(self, num_samples, generator, rank, world_size, secure_mode):
        self.num_samples, self.rank, self.world_size = check_shard(
            num_samples, generator, rank, world_size, secure_mode)
        self.secure_mode = bool(secure_mode)
        self.user_generator = generator
        self.generator = generator if generator is None or self.world_size == 1 \
            else rank_generator(generator, self.rank)
        self.indices = torch.arange(self.rank, self.num_samples, self.world_size)

    def pass_generator(self) -> torch.Generator | None:
        """The generator of one pass, as ``PoissonBatchSampler.pass_generator`` (Note [Randomness]
        in loop/data.py); None in secure mode."""
        return pass_generator(self.generator, self.secure_mode, self.world_size)


class CyclicPoissonSampler(_RankedSampler):
    """``steps`` batches; step t Poisson-samples part t mod ``parts`` of a fixed random partition
    at rate ``sample_rate * parts`` (Note [Cyclic Poisson sampling]). ``steps`` must be a multiple
    of ``parts``; by default the smallest one >= round(1 / sample_rate) (one epoch in
    expectation)."""

    def __init__(self, num_samples: int | Sized, sample_rate: float, parts: int,
                 steps: int | None = None, generator: torch.Generator | None = None,
                 rank: int = 0, world_size: int = 1, secure_mode: bool = False,
                 partition_seed: int | None = None):
        super().__init__(num_samples, generator, rank, world_size, secure_mode)
        self.sample_rate = validate.sample_rate(sample_rate)
        self.parts = validate.integer(parts, "parts", 1)
        if self.sample_rate * self.parts > 1:
            raise ValueError(
                f"sample_rate * parts must be <= 1 (each part holds about 1/parts of the data and "
                f"is sampled at rate sample_rate * parts to keep E[batch] = sample_rate * N), got "
                f"sample_rate={sample_rate} and parts={parts}: lower one of them")
        if steps is None:
            steps = self.parts * math.ceil(max(1, round(1 / self.sample_rate)) / self.parts)
        self.steps = validate.integer(steps, "steps", 0)
        if self.steps % self.parts:
            raise ValueError(
                f"steps must be a multiple of parts so that the next pass continues the cycle "
                f"(Note [Cyclic Poisson sampling]), got steps={steps} and parts={parts}: use "
                f"steps={self.parts * math.ceil(self.steps / self.parts)}")
        if partition_seed is None:
            partition_seed = self._draw_partition_seed()
        elif isinstance(partition_seed, bool) or not isinstance(partition_seed, numbers.Integral):
            raise ValueError(f"partition_seed must be an int or None, got {partition_seed!r}")
        self.partition_seed = int(partition_seed)
        labels = torch.randint(self.parts, (self.num_samples,),
                               generator=torch.Generator().manual_seed(self.partition_seed))
        mine = labels[self.indices]
        self.partition = [self.indices[mine == j] for j in range(self.parts)]

    def _draw_partition_seed(self) -> int:
        if self.secure_mode:
            return secrets.randbits(62)
        if self.user_generator is not None:     # the same on every rank: one global partition
            return int(torch.randint(0, 2**62, (), generator=self.user_generator).item())
        return int(torch.randint(0, 2**62, ()).item())

    @property
    def part_rate(self) -> float:
        """The inclusion probability of an example in a step of its part: sample_rate * parts."""
        return self.sample_rate * self.parts

    @property
    def sampling(self) -> CyclicPoisson:
        """What ``MatrixAccountant`` is told about this sampler."""
        return CyclicPoisson(self.parts, self.sample_rate)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        g = self.pass_generator()
        rate = self.part_rate
        for t in range(self.steps):
            part = self.partition[t % self.parts]
            mask = _secure_mask(len(part), rate) if g is None \
                else torch.rand(len(part), generator=g) < rate
            yield part[mask].tolist()


class BallsInBinsSampler(_RankedSampler):
    """``epochs`` epochs of ``steps_per_epoch`` batches; each epoch every example is in exactly one
    batch, chosen uniformly (Note [Balls in bins]). ``epochs`` defaults to 1."""

    def __init__(self, num_samples: int | Sized, steps_per_epoch: int, epochs: int | None = None,
                 generator: torch.Generator | None = None, rank: int = 0, world_size: int = 1,
                 secure_mode: bool = False):
        super().__init__(num_samples, generator, rank, world_size, secure_mode)
        self.steps_per_epoch = validate.integer(steps_per_epoch, "steps_per_epoch", 1)
        self.epochs = 1 if epochs is None else validate.integer(epochs, "epochs", 0)
        self.steps = self.steps_per_epoch * self.epochs

    @property
    def sampling(self) -> BallsInBins:
        """What ``MatrixAccountant`` is told about this sampler."""
        return BallsInBins(self.steps_per_epoch)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        g = self.pass_generator()
        for _ in range(self.epochs):
            bins = self._bins(g)
            order = torch.argsort(bins, stable=True)
            counts = torch.bincount(bins, minlength=self.steps_per_epoch).tolist()
            for batch in torch.split(self.indices[order], counts):
                yield batch.tolist()

    def _bins(self, g: torch.Generator | None) -> torch.Tensor:
        """int64[len(self.indices)]: each of this rank's examples' step in this epoch."""
        n, s = len(self.indices), self.steps_per_epoch
        if g is not None:
            return torch.randint(s, (n,), generator=g)
        limit = 2**64 - (2**64 % s)        # reject the top values: no modulo bias
        draws = np.frombuffer(os.urandom(8 * n), dtype=np.uint64).copy()
        while True:
            bad = np.flatnonzero(draws >= np.uint64(limit)) if limit < 2**64 else []
            if len(bad) == 0:
                break
            draws[bad] = np.frombuffer(os.urandom(8 * len(bad)), dtype=np.uint64)
        return torch.from_numpy((draws % np.uint64(s)).astype(np.int64))


def plan_loader(plan, dataset: Dataset, *, steps: int | None = None,
                generator: torch.Generator | None = None, rank: int = 0, world_size: int = 1,
                secure_mode: bool = False, **dataloader_kwargs) -> DataLoader:
    """The loader of a privacy plan (privacy/plan.py): ``poisson_loader`` for plain Poisson
    sampling, else the plan's sampler (this module) with the same collation and tracking."""
    if plan.sampler == "poisson":
        return poisson_loader(dataset, plan.sample_rate, steps=steps, generator=generator,
                              rank=rank, world_size=world_size, secure_mode=secure_mode,
                              **dataloader_kwargs)
    n = _size(dataset, dataloader_kwargs)
    ranked = dict(generator=generator, rank=rank, world_size=world_size, secure_mode=secure_mode)
    if plan.sampler == "cyclic_poisson":
        sampler = CyclicPoissonSampler(n, plan.sample_rate, plan.parts,
                                                steps=plan.steps_per_epoch, **ranked)
    else:
        sampler = BallsInBinsSampler(n, plan.steps_per_epoch, epochs=1, **ranked)
    return _loader(dataset, sampler, dataloader_kwargs)
