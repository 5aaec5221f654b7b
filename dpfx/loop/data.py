"""Poisson sampling for DP-SGD: every example joins every batch independently with probability q.

    from dpfx.loop.data import expected_batch_size, poisson_loader

    q = 256 / len(train_set)
    loader = poisson_loader(train_set, q, generator=torch.Generator().manual_seed(0),
                            num_workers=2, pin_memory=True)
    dp_model = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.1,
                            expected_batch_size=expected_batch_size(len(train_set), q))
    for x, y in loader:          # len(loader) == round(1 / q) steps; x.shape[0] varies, may be 0
        ...

# Note [Why Poisson sampling]
The accountants in ``dpfx.privacy`` analyse ``PoissonSampledDpEvent``: each step, each example
is included independently with probability q, so batch sizes are Binomial(N, q), vary from step
to step, and are sometimes 0. Shuffle-and-chunk batches of a fixed size are a different mechanism
whose epsilon those accountants do not bound. With the mean loss, DP-SGD divides by the
*expected* batch size q*N (``expected_batch_size``), never by the realised one, which would leak
it.

# Note [Epoch length]
``steps`` defaults to ``round(1 / q)``: one "epoch" in expectation, since each step draws q*N
examples on average, so round(1/q) steps touch N examples on average (each example is seen
Binomial(round(1/q), q) times, ~1 on average, possibly 0 or 2+). Pass ``steps`` for any other
length; ``len(sampler)`` and ``len(loader)`` are ``steps``, and ``steps`` is what the accountant
must be told.

# Note [Empty batches]
With small q*N, some batches are empty. ``default_collate([])`` fails, so ``poisson_loader``
wraps the collate function in ``EmptyBatchCollate``, which returns tensors of batch size 0 with
the trailing shapes and dtypes of a real batch. The template is the user's collate function
applied to ``[dataset[0]]``, sliced to 0 rows, so it matches exactly what real batches look like
(this assumes dim 0 is the batch dim, as ``default_collate`` makes it). ``EmptyBatchCollate`` is a
module-level class, so it pickles into worker processes (``num_workers > 0``, any start method).

# Note [Distributed Poisson sampling]
With ``rank`` and ``world_size``, rank r samples only the examples r, r + W, r + 2W, ... (a
partition of the dataset), each with probability q, independently of the other ranks; every rank
runs the same number of steps. The union of the ranks' batches is then exactly one Poisson batch
of the whole dataset with rate q: the accountant counts one step per global step, with q, and the
divisor is the global expected batch size q*N.

# Note [Randomness]
Sampling runs in the main process (a ``batch_sampler`` is never sent to workers) from
``torch.rand(N, generator=g) < q``. The same ``generator`` seed gives the same batches; without
one each ``iter()`` seeds a fresh generator from torch's global RNG, like ``RandomSampler``.
With ``world_size > 1`` and no ``generator``, each rank seeds from the OS's CSPRNG instead, so that
ranks (which share torch's default seed) do not draw the same masks; a ``generator`` (the same
seed on every rank) is mixed with the rank first (``rank_generator``), for the same reason.
torch's Mersenne Twister is not a cryptographic RNG: DP's guarantee assumes the sampling is
secret and truly random, and batches drawn from torch's generator repeat under
``torch.manual_seed``. ``secure_mode=True`` closes that gap (Note [Secure sampling]).

# Note [Secure sampling]
With ``secure_mode=True`` every inclusion decision is a 64-bit integer from the OS's CSPRNG
(``os.urandom``) compared with floor(q * 2^64): each example joins with probability q rounded
down by less than 2^-64, independently of torch's generators, of ``torch.manual_seed`` and of
other runs and ranks. Nothing is seeded, so nothing can be replayed; a ``generator`` is refused.
(tests/loop/test_loop_privacy.py::test_secure_sampling_ignores_torch_seed)
"""
from __future__ import annotations

import collections.abc
import fractions
import hashlib
import math
import numbers
import os
import secrets
from typing import Callable, Iterator, Sized

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate

from dpfx.errors import OptionValueError
from dpfx.privacy import validate

__all__ = ["PoissonBatchSampler", "PoissonLoader", "poisson_loader", "expected_batch_size",
           "EmptyBatchCollate"]


def check_shard(num_samples, generator, rank, world_size, secure_mode) -> tuple[int, int, int]:
    """(num_samples, rank, world_size) of a sampler of this rank's shard r, r + W, ...
    (``num_samples`` an int or a Sized), checked with its generator, for every sampler."""
    if not isinstance(num_samples, numbers.Integral) and isinstance(num_samples, Sized):
        num_samples = len(num_samples)
    num_samples = validate.integer(num_samples, "num_samples", 0)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise OptionValueError(f"generator must be a torch.Generator or None, got {generator!r}")
    validate.secure_sampling(secure_mode, generator)
    world_size = validate.integer(world_size, "world_size", 1)
    rank = validate.integer(rank, "rank", 0)
    if rank >= world_size:
        raise OptionValueError(f"rank must be < world_size, got rank {rank}, world_size "
                               f"{world_size}")
    return num_samples, rank, world_size


def pass_generator(generator: torch.Generator | None, secure_mode: bool,
                   world_size: int) -> torch.Generator | None:
    """The generator of one pass of a sampler (Note [Randomness]): the sampler's own, None in
    secure mode, else a fresh one."""
    if secure_mode:
        return None
    if generator is not None:
        return generator
    if world_size > 1:
        # Ranks share torch's default seed; correlated draws across shards would break the
        # independence Poisson sampling's analysis needs.
        return torch.Generator().manual_seed(secrets.randbits(62))
    # fresh randomness per iter(), reproducible under torch.manual_seed
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    return torch.Generator().manual_seed(seed)


def expected_batch_size(n: int, q: float) -> int:
    """round(q * n), at least 1: the divisor of DP-SGD's mean loss under Poisson sampling."""
    n = validate.integer(n, "n", 1)
    return max(1, round(validate.sample_rate(q) * n))


class PoissonBatchSampler(Sampler[list[int]]):
    """``steps`` batches of indices into ``range(num_samples)``, each index in each batch with
    probability ``sample_rate``, independently (Note [Why Poisson sampling]).

    ``num_samples`` is an int or anything with ``len()`` (a dataset). ``steps`` defaults to
    ``round(1 / sample_rate)``, one epoch in expectation (Note [Epoch length]). Batches are
    sorted lists of ints and may be empty.
    """

    def __init__(self, num_samples: int | Sized, sample_rate: float, steps: int | None = None,
                 generator: torch.Generator | None = None, rank: int = 0, world_size: int = 1,
                 secure_mode: bool = False):
        self.num_samples, self.rank, self.world_size = check_shard(
            num_samples, generator, rank, world_size, secure_mode)
        self.sample_rate = validate.sample_rate(sample_rate)
        self.steps = max(1, round(1 / self.sample_rate)) if steps is None \
            else validate.integer(steps, "steps", 0)
        self.secure_mode = bool(secure_mode)
        self.generator = generator if generator is None or self.world_size == 1 \
            else rank_generator(generator, self.rank)
        # Note [Distributed Poisson sampling]: rank r owns the examples r, r + W, r + 2W, ...
        self.indices = torch.arange(self.rank, self.num_samples, self.world_size)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        g = self.pass_generator()
        for _ in range(self.steps):
            yield self.indices[self.draw(g)].tolist()

    def pass_generator(self) -> torch.Generator | None:
        """The generator one pass over the steps draws from (Note [Randomness]); None in secure
        mode, whose draws come from the OS's CSPRNG (Note [Secure sampling])."""
        return pass_generator(self.generator, self.secure_mode, self.world_size)

    def draw(self, g: torch.Generator | None) -> torch.Tensor:
        """bool[len(self.indices)]: which of this rank's indices join this step."""
        if g is None:
            return _secure_mask(len(self.indices), self.sample_rate)
        return torch.rand(len(self.indices), generator=g) < self.sample_rate


def rank_generator(generator: torch.Generator, rank: int) -> torch.Generator:
    """This rank's sampling generator, from the user's (Note [Randomness]): a draw from it, hashed
    with the rank. Every rank is handed the same seed; drawn as it is, it would give every rank
    the same mask over its partition, and examples r and r + 1 would join or stay out together."""
    draw = int(torch.randint(0, 2**62, (), generator=generator).item())
    digest = hashlib.sha256(f"dpfx-rank-sampling:{draw}:{rank}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 2)


def _secure_mask(n: int, q: float) -> torch.Tensor:
    """bool[n], each True with probability floor(q * 2^64) / 2^64, from os.urandom."""
    if q >= 1:
        return torch.ones(n, dtype=torch.bool)
    threshold = np.uint64(int(fractions.Fraction(q) * 2**64))
    draws = np.frombuffer(os.urandom(8 * n), dtype=np.uint64)
    return torch.from_numpy(draws < threshold)


def _empty_like_batch(batch):
    """A B=0 version of a collated batch: tensors keep dtype and trailing shape."""
    if isinstance(batch, torch.Tensor):
        return batch[:0].clone()
    if isinstance(batch, collections.abc.Mapping):
        items = {k: _empty_like_batch(v) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):        # namedtuple
        return type(batch)(*(_empty_like_batch(v) for v in batch))
    if isinstance(batch, tuple):
        return tuple(_empty_like_batch(v) for v in batch)
    if isinstance(batch, list):
        if any(isinstance(v, (torch.Tensor, collections.abc.Mapping, tuple, list)) for v in batch):
            return [_empty_like_batch(v) for v in batch]   # a structure of batched fields
        return []                                          # one field, one entry per example
    return batch                                           # not batched: keep as is


class EmptyBatchCollate:
    """Collate that maps ``[]`` to a B=0 batch shaped like ``template`` (Note [Empty batches]).

    A module-level class, not a closure, so DataLoader workers can unpickle it.
    """

    def __init__(self, example, collate_fn: Callable = default_collate):
        self.collate_fn = collate_fn
        self.empty = _empty_like_batch(collate_fn([example]))

    def __call__(self, batch):
        if len(batch) == 0:
            return _empty_like_batch(self.empty)    # a fresh copy per batch
        return self.collate_fn(batch)


_OWN_ARGS = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


def poisson_loader(dataset: Dataset, sample_rate: float, *, steps: int | None = None,
                   generator: torch.Generator | None = None, rank: int = 0, world_size: int = 1,
                   secure_mode: bool = False, **dataloader_kwargs) -> DataLoader:
    """A DataLoader over ``dataset`` with Poisson batches (``PoissonBatchSampler``).

    ``generator`` drives the sampling only; ``secure_mode`` samples from the OS's CSPRNG
    instead (Note [Secure sampling]). ``collate_fn`` (default ``default_collate``) is
    wrapped in ``EmptyBatchCollate``; other keyword arguments (``num_workers``, ``pin_memory``,
    ...) go to ``DataLoader``, except those that choose batches, which would defeat the sampling.
    """
    sampler = PoissonBatchSampler(_size(dataset, dataloader_kwargs), sample_rate, steps=steps,
                                  generator=generator, rank=rank, world_size=world_size,
                                  secure_mode=secure_mode)
    return _loader(dataset, sampler, dataloader_kwargs)


def _size(dataset: Dataset, dataloader_kwargs: dict) -> int:
    clash = [k for k in _OWN_ARGS if k in dataloader_kwargs]
    if clash:
        raise ValueError(f"the private loader chooses batches itself (sample_rate, steps); do "
                         f"not pass {', '.join(clash)}")
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
        raise ValueError("dataset must be a map-style dataset with __len__ and __getitem__; "
                         f"private sampling needs random access, got {type(dataset).__name__}")
    if len(dataset) == 0:
        raise ValueError("dataset is empty: nothing to sample")
    return len(dataset)


def _loader(dataset: Dataset, batch_sampler, dataloader_kwargs: dict) -> DataLoader:
    collate_fn = dataloader_kwargs.pop("collate_fn", None) or default_collate
    return PoissonLoader(dataset, batch_sampler=batch_sampler,
                         collate_fn=EmptyBatchCollate(dataset[0], collate_fn), **dataloader_kwargs)


class PoissonLoader(DataLoader):
    """A DataLoader whose batches' tensors are tracked (``loss_track.track_batch``): what user
    code computes from them before the loss or the model is part of dpfx's check (Note [The
    batch's own tensors are followed too] in loss/track.py)."""

    def __iter__(self):
        from dpfx.loss.track import track_batch

        for batch in super().__iter__():
            yield track_batch(batch)


# -- virtual batches: a logical batch as physical ones ---------------------------------------------
class VirtualBatches:
    """Iterates ``loader`` and yields each batch as near-equal physical batches of at most
    ``max_physical_batch_size`` examples (Note [Near-equal physical batches]), signalling ``optimizer`` to skip every step but a
    logical batch's last (Note [Virtual batches] in loop/optim.py). An empty logical batch yields one empty
    physical batch, so its (pure-noise) step still happens."""

    def __init__(self, loader, max_physical_batch_size: int, optimizer):
        if isinstance(max_physical_batch_size, bool) or not isinstance(
                max_physical_batch_size, int) or max_physical_batch_size < 1:
            raise ValueError(f"max_physical_batch_size must be an int >= 1, got "
                             f"{max_physical_batch_size!r}")
        from dpfx.loop.optim import DPOptimizer

        if not isinstance(optimizer, DPOptimizer):
            raise TypeError("virtual batches need a dpfx.DPOptimizer to skip the inner steps")
        self.loader = loader
        self.max_physical_batch_size = max_physical_batch_size
        self.optimizer = optimizer

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        from dpfx.loss.track import TrackedTensor, track_batch, untrack

        for batch in self.loader:
            tracked = any(isinstance(t, TrackedTensor)
                          for t in torch.utils._pytree.tree_leaves(batch))
            plain = untrack(batch) if tracked else batch
            chunks = split_batch(plain, self.max_physical_batch_size,
                                 agreed_pieces(self.optimizer.dp_model, plain,
                                               self.max_physical_batch_size))
            for i, chunk in enumerate(chunks):
                self.optimizer.signal_skip_step(i < len(chunks) - 1)
                yield track_batch(chunk) if tracked else chunk     # each a batch of its own


# Note [Near-equal physical batches]
# A logical batch of n examples runs as p = ceil(n / size) physical batches, the fewest the cap
# allows, whose sizes differ by at most one (9 at a cap of 8: 5 + 4, not 8 + 1). The clipped sums
# add up the same whatever the split (Note [Virtual batches] in loop/optim.py), so only the cost
# changes: a model whose code branches on the batch size compiles a separate graph for a batch of
# one (Note [Deciding a branch on the batch size] in capture/batch_branches.py), and cutting
# full batches first made every logical batch of k * size + 1 examples pay for that graph on the
# hot path (a 35 s step in a GPT-2 run). With near-equal pieces a physical batch of one row comes
# only from a logical batch of one row, or from a cap below 3 (every split of 3 rows at a cap of 2
# has a row alone): each of the p pieces holds at least floor(n / p) >= 2 rows when n > size >= 3.
# (tests/loop/test_split_batch.py)
# Note [Every rank runs as many physical batches]
# On a model sharded with fully_shard, a block's forward and backward ops gather its unit's
# parameters with a collective each time they run (Note [Sharded blocks] in loop/fsdp.py), so
# every rank must run the same number of physical batches in a logical step. Poisson batches
# differ in size across ranks, and so does the number of pieces a cap cuts them into: a rank
# with fewer pieces would wait at the step's reduction while another waits in a block's
# gather, until the process group's timeout. Before splitting, the ranks of a sharded model
# agree on the largest count (one all-reduce of one integer per logical batch), and a rank with
# fewer pieces runs empty ones after its own: an empty physical batch adds nothing to the
# clipped sums and runs the same collectives. (tests/hf/test_trainer_ranks.py, a sharded
# DPTrainer with gradient accumulation; tests/loop/test_split_batch.py)
def agreed_pieces(dp_model, batch, size: int) -> int | None:
    """The number of physical batches every rank of ``dp_model``'s sharding runs for this
    logical batch (Note [Every rank runs as many physical batches]); None when not sharded."""
    sharding = getattr(dp_model, "_sharding", None)
    if sharding is None:
        return None
    import torch.distributed as dist

    leaves = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    count = torch.tensor([len(split_sizes(leaves[0].shape[0], size)) if leaves else 1])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=sharding.group)
    return int(count)


def split_sizes(n: int, size: int) -> list[int]:
    """The sizes of the physical batches of a logical batch of ``n`` examples at a cap of
    ``size`` (Note [Near-equal physical batches]); ``[0]`` for an empty one."""
    pieces = max(1, math.ceil(n / size))
    base, extra = divmod(n, pieces)
    return [base + 1] * extra + [base] * (pieces - extra)


def split_batch(batch, size: int, pieces: int | None = None) -> list:
    """Split every tensor of a collated batch along dim 0 into the near-equal pieces of
    ``split_sizes`` (Note [Near-equal physical batches]), then empty pieces up to ``pieces``
    (Note [Every rank runs as many physical batches])."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    if not leaves:
        return [batch]
    sizes = split_sizes(leaves[0].shape[0], size)
    starts = [0]
    for length in sizes + [0] * ((pieces or 0) - len(sizes)):
        starts.append(starts[-1] + length)
    return [torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t, a=a, b=b: t[a:b], batch) for a, b in zip(starts, starts[1:])]
