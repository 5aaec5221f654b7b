"""User-level DP-SGD: Poisson-sample users, take up to k examples from each, clip each user's sum.

    private = dpfx.make_private(dpfx.per_user(model), optimizer, train_set, batch_size=64,
                                user_ids=author_of_each_example, max_examples_per_user=8,
                                max_grad_norm=1.0, noise_multiplier=1.0)
    for x, y, mask in private.loader:       # x: (U, 8, ...), y: (U, 8), mask: (U, 8); U varies
        out = private.model(x)              # (U, 8, classes): the model ran on (U * 8, ...) rows
        per_example = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none")
        loss = (per_example.view_as(mask) * mask).sum(1).mean()    # a sum per user, mean over users
        private.optimizer.zero_grad(); loss.backward(); private.optimizer.step()

Here epsilon is per user: it bounds what the run reveals about everything one user wrote, up to
k examples of it per step (Charles et al. 2024, "Fine-Tuning Large Language Models with
User-Level Differential Privacy", user-level sampling).

# Note [User-level sampling]
Each step Poisson-samples users, each with probability q = expected users per step / number of
users (``PoissonBatchSampler`` over user indices: its generator, secure mode and ranks as for
examples), and takes up to k = ``max_examples_per_user`` examples from every sampled user: all of
them when the user has k or fewer, else k drawn uniformly without replacement. The batch holds
the user in dim 0, so dpfx's unit of clipping, dim 0 of every input, is the user: its term of
the loss is the sum of its examples' masked losses, and its gradient, the sum of its examples'
gradients, is clipped to C as one (Note [The per-example term] in loss/check.py: the 1/U of a
mean over users is removed, a sum or mean over the user's own k slots stays). One user added or
removed changes the noised sum by at most C, so the step is the sampled Gaussian mechanism with
q over users: the accountant counts q, and D, the divisor of the mean, is the expected number of
users round(q * users). The k examples' choice needs no secrecy: any rule that picks from the
user's own examples leaves the user's contribution bounded by C; it is drawn from the sampler's
generator (``secrets`` in secure mode) so that a seeded run replays it, and a checkpoint keeps
it. Under W ranks, rank r samples the users r, r + W, ... (in order of first appearance in
``user_ids``) with all the examples they bring, so the ranks' users are together one Poisson
sample of all users (Note [Distributed Poisson sampling] in loop/data.py, over users).
(tests/loop/test_users.py::test_one_added_user_moves_the_release_by_at_most_C_over_D,
::test_two_ranks_partition_the_users_and_release_the_union)

# Note [A user's batch layout]
A batch of U users is the dataset's collated examples with every tensor reshaped from (U * k,
...) to (U, k, ...), user u's slots in row u, and a float32 mask (U, k): 1 for a real example, 0
for padding. A user with fewer than k examples fills its other slots with copies of its own
first chosen example, so padding never carries another user's data, and stays finite through
any model (zeros can make a softmax over an all-masked row NaN, and NaN times a mask of 0 is
NaN); the loss must multiply by the mask. The mask is appended to a collated tuple or list
(``x, y, mask``); any other collated batch (a tensor, a dict) comes as ``(batch, mask)``.
Non-tensor leaves (a list of strings) keep their U * k entries flat. An empty batch keeps the
trailing shapes, (0, k, ...), and one compiled graph serves every U, 0 included (dim 0 is
symbolic; k is fixed; a captured loss compiles U = 0 apart, as it does for examples). The
batch's tensors are tracked like ``poisson_loader``'s, so ``view_as(mask)`` in the loss keeps U
symbolic; with a mask from elsewhere write ``.view(-1, k)``.

# Note [The model sees U * k rows]
``per_user(model)`` flattens every tensor input from (U, k, ...) to (U * k, ...), runs the
model, and views every tensor output back to (U, k, ...). The merged dim U * k is a batch dim
with k rows per unit (dpfx/graph/README.md, "Merged batch dims"): ops that read across the rows
of one user are proven per user and accepted, ops that read across users are refused with a
PrivacyError. The wrapper registers the model as its child ``module``, so parameter names gain
the prefix ``module.`` (per-layer clipping bounds are keyed so); the parameters are the model's.
"""
from __future__ import annotations

import collections.abc
import secrets
from typing import Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch.utils.data import Dataset, IterableDataset, default_collate

from dpfx.loop.data import PoissonBatchSampler, PoissonLoader, _empty_like_batch
from dpfx.privacy import validate

__all__ = ["UserBatchSampler", "user_loader", "group_by_user", "per_user", "PerUser"]


def group_by_user(user_ids, num_examples: int) -> list[torch.Tensor]:
    """The example indices of each user, users in order of first appearance: ``user_ids`` holds
    one hashable id per example (a sequence, or a 1-D tensor)."""
    if isinstance(user_ids, torch.Tensor):
        if user_ids.dim() != 1:
            raise ValueError(f"user_ids must be 1-D, one id per example, got shape "
                             f"{tuple(user_ids.shape)}")
        user_ids = user_ids.tolist()
    if isinstance(user_ids, (str, bytes)) or not hasattr(user_ids, "__len__"):
        raise ValueError(f"user_ids must be a sequence or a tensor of one id per example, got "
                         f"{type(user_ids).__name__}")
    if len(user_ids) != num_examples:
        raise ValueError(f"user_ids must hold one id per example: {len(user_ids)} ids for "
                         f"{num_examples} examples")
    groups: dict = {}
    for i, uid in enumerate(user_ids):
        if not isinstance(uid, collections.abc.Hashable):
            raise ValueError(f"user id {uid!r} of example {i} is not hashable")
        groups.setdefault(uid, []).append(i)
    return [torch.tensor(v, dtype=torch.int64) for v in groups.values()]


class UserBatchSampler(PoissonBatchSampler):
    """``steps`` batches of slots ``(example index, real)``, ``k`` per sampled user, each user in
    each batch with probability ``sample_rate`` (Note [User-level sampling]). ``users``: each
    user's example indices (``group_by_user``). ``rank`` of ``world_size`` samples the users r,
    r + W, ... (Note [Distributed Poisson sampling] in loop/data.py, over users)."""

    def __init__(self, users: Sequence[torch.Tensor], max_examples_per_user: int,
                 sample_rate: float, steps: int | None = None,
                 generator: torch.Generator | None = None, rank: int = 0, world_size: int = 1,
                 secure_mode: bool = False):
        self.users = list(users)
        if any(len(u) == 0 for u in self.users):
            raise ValueError("every user must hold at least one example")
        self.max_examples_per_user = validate.integer(max_examples_per_user,
                                                      "max_examples_per_user", 1)
        super().__init__(len(self.users), sample_rate, steps=steps, generator=generator,
                         rank=rank, world_size=world_size, secure_mode=secure_mode)

    def __iter__(self) -> Iterator[list[tuple[int, bool]]]:
        g = self.pass_generator()
        for _ in range(self.steps):
            sampled = self.indices[self.draw(g)].tolist()
            yield [slot for u in sampled for slot in self.slots(self.users[u], g)]

    def slots(self, examples: torch.Tensor, g: torch.Generator | None) -> list[tuple[int, bool]]:
        """One user's k slots: its chosen examples, then copies of the first marked padding."""
        k = self.max_examples_per_user
        if len(examples) > k:
            pick = torch.randperm(len(examples), generator=g)[:k] if g is not None \
                else torch.tensor(secrets.SystemRandom().sample(range(len(examples)), k))
            examples = examples[pick]
        chosen = examples.tolist()
        return [(i, True) for i in chosen] + [(chosen[0], False)] * (k - len(chosen))


class UserSlots(Dataset):
    """``dataset`` addressed by slots: ``(index, real)`` -> ``(dataset[index], real)``."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, slot):
        index, real = slot
        return self.dataset[index], real


class UserCollate:
    """Collates k slots per user into (U, k, ...) tensors and the (U, k) mask (Note [A user's
    batch layout]). A module-level class, so DataLoader workers can unpickle it."""

    def __init__(self, example, max_examples_per_user: int, collate_fn: Callable = default_collate):
        self.collate_fn = collate_fn
        self.k = max_examples_per_user
        self.empty = _empty_like_batch(collate_fn([example]))

    def __call__(self, slots):
        if not slots:
            batch = pytree.tree_map_only(
                torch.Tensor, lambda t: t.reshape(0, self.k, *t.shape[1:]),
                _empty_like_batch(self.empty))
            return _with_mask(batch, torch.zeros(0, self.k))
        rows = len(slots)
        batch = self.collate_fn([example for example, _ in slots])

        def by_user(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 0 or t.shape[0] != rows:
                raise ValueError(f"user-level batches need every collated tensor to hold the "
                                 f"examples in dim 0: {rows} examples, a tensor of shape "
                                 f"{tuple(t.shape)}")
            return t.unflatten(0, (rows // self.k, self.k))

        mask = torch.tensor([float(real) for _, real in slots]).view(-1, self.k)
        return _with_mask(pytree.tree_map_only(torch.Tensor, by_user, batch), mask)


def _with_mask(batch, mask: torch.Tensor):
    if isinstance(batch, tuple):
        return (*batch, mask)
    if isinstance(batch, list):
        return [*batch, mask]
    return batch, mask


def user_loader(dataset: Dataset, users: Sequence[torch.Tensor], max_examples_per_user: int,
                sample_rate: float, *, steps: int | None = None,
                generator: torch.Generator | None = None, rank: int = 0, world_size: int = 1,
                secure_mode: bool = False, **dataloader_kwargs) -> PoissonLoader:
    """A DataLoader of user-level batches (``UserBatchSampler``, Note [A user's batch layout]);
    ``users`` from ``group_by_user``. Keyword arguments as ``poisson_loader``'s."""
    clash = [k for k in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
             if k in dataloader_kwargs]
    if clash:
        raise ValueError(f"the user-level loader chooses batches itself; do not pass "
                         f"{', '.join(clash)}")
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") \
            or len(dataset) == 0:
        raise ValueError("user-level sampling needs a non-empty map-style dataset")
    collate_fn = dataloader_kwargs.pop("collate_fn", None) or default_collate
    sampler = UserBatchSampler(users, max_examples_per_user, sample_rate, steps=steps,
                               generator=generator, rank=rank, world_size=world_size,
                               secure_mode=secure_mode)
    return PoissonLoader(UserSlots(dataset), batch_sampler=sampler,
                         collate_fn=UserCollate(dataset[0], sampler.max_examples_per_user,
                                                collate_fn), **dataloader_kwargs)


class PerUser(torch.nn.Module):
    """Runs ``module`` on (U * k, ...) rows of (U, k, ...) inputs (Note [The model sees U * k
    rows]). To Hugging Face's tools it shows the model's ``config`` and, as ``get_base_model``,
    the model (a PEFT model's base model): Trainer reads the forward's signature from it, and
    dpfx the head whose ``labels=`` loss it computes (loss/hf_labels.py, ``flattens_users``)."""

    flattens_users = True

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    @property
    def config(self):
        return self.module.config      # AttributeError where the model has none

    def get_base_model(self) -> torch.nn.Module:
        module = self.module
        return module.get_base_model() if hasattr(module, "get_base_model") else module

    def forward(self, *args, **kwargs):
        tensors = []
        _map_tensors(lambda t: tensors.append(t) or t, (args, kwargs))
        if not tensors or any(t.dim() < 2 for t in tensors):
            raise ValueError("per_user's inputs are (users, k, ...) tensors: every tensor input "
                             "needs a users dim and a k dim")
        users, k = tensors[0].shape[:2]
        args, kwargs = _map_tensors(lambda t: t.flatten(0, 1), (args, kwargs))
        out = self.module(*args, **kwargs)
        return _map_tensors(lambda t: t.unflatten(0, (users, k)), out)


def _map_tensors(fn: Callable, value):
    """``value`` with ``fn`` applied to every tensor in its tuples, lists and dicts. Not torch's
    pytree: dynamo guards on its registry of node types, which grows while a run compiles, and
    every growth would recompile the model."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):        # namedtuple
        return type(value)(*(_map_tensors(fn, v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(fn, v) for v in value)
    if isinstance(value, dict):
        items = {k: _map_tensors(fn, v) for k, v in value.items()}
        return items if type(value) is dict else type(value)(**items)  # a ModelOutput
    return value


def per_user(model: torch.nn.Module) -> PerUser:
    """``model``, written for single examples, run on user-level batches: (U, k, ...) inputs
    in, (U, k, ...) outputs out (Note [The model sees U * k rows])."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"per_user wraps an nn.Module, got {type(model).__name__}")
    return PerUser(model)
