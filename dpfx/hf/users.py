"""User-level DP in ``DPTrainer``: the user as the privacy unit of a Trainer run.

    trainer = dpfx.hf.DPTrainer(
        model=model, args=TrainingArguments(output_dir="out", per_device_train_batch_size=16),
        train_dataset=train,                      # a column "user_id" names each example's author
        user_column="user_id", max_examples_per_user=4,
        target_epsilon=8.0, max_grad_norm=1.0)   # epsilon per user

Note [DPTrainer at the user level]
The unit of make_private(user_ids=, max_examples_per_user=) (Note [User-level sampling] in
loop/users.py), inside Trainer's loop: users are Poisson-sampled with q = per-device batch *
accumulation steps * processes / number of users (the batch sizes count users), each sampled
user brings up to k examples in a (U, k, ...) batch, and the model runs under ``per_user`` (the
U * k rows flattened inside the graph, U the batch symbol). The loss stays the model's own
``labels=`` loss. For a causal or masked language model, or a token classifier, that loss is a
cross-entropy over every label token of the U * k rows, tokens labelled -100 ignored, divided
by their count: a scalar times the sum over users of each user's summed token losses. The
padding slots of a user with fewer than k examples copy the user's own first example (Note [A
user's batch layout]) and get every label set to -100 here, so they carry no label token: each
user's term is the sum over its real examples, clipped to C as one, and the count is removed as
any normalizer is (Note [The per-example term] in loss/check.py). Heads whose loss is not such a
token mean (a regression or multi-label classifier would count a -100 label as a value,
sequence-to-sequence models shift labels along a dim that is k here) are refused before the model
is changed. The accountant counts the user-level q; ``privacy_unit`` is "user". Evaluation and
prediction run the user's model on the evaluation set's examples, as Trainer would, without
dpfx's graph (no gradient is released there).
(tests/hf/test_trainer_users.py)
"""
from __future__ import annotations

import collections.abc

import torch

from dpfx.loop.data import PoissonLoader
from dpfx.loop.users import UserBatchSampler, UserCollate, UserSlots, group_by_user
from dpfx.errors import OptionValueError
from dpfx.loss.hf_labels import CAUSAL_HEADS, TOKEN_HEADS
from dpfx.privacy import validate


def users_of(model, train, user_ids, user_column: str | None,
             max_examples_per_user) -> list[torch.Tensor] | None:
    """Each user's example indices in ``train`` for a user-level run, or None for an
    example-level one (none of the three options given). The options are checked and the
    model's head refused where its loss is not a token mean, before the model is touched."""
    if user_column is None and user_ids is None and max_examples_per_user is None:
        return None
    ids = user_ids_of(train, user_ids, user_column, max_examples_per_user)
    validate.integer(max_examples_per_user, "max_examples_per_user", 1)
    check_user_head(model)
    return group_by_user(ids, len(train))


def user_ids_of(train, user_ids, user_column: str | None, max_examples_per_user) -> list:
    """Each example's user id, from ``user_ids`` or the train set's ``user_column``."""
    if max_examples_per_user is None:
        raise OptionValueError("DPTrainer(user_column= or user_ids=) needs "
                               "max_examples_per_user (k: the most examples of one user in one "
                               "step)")
    if (user_ids is None) == (user_column is None):
        raise OptionValueError("DPTrainer at the user level takes exactly one of user_column "
                               "(the train_dataset column naming each example's user) or "
                               "user_ids (one id per example)")
    if user_ids is not None:
        return user_ids
    names = getattr(train, "column_names", None)
    if names is not None:                               # a datasets.Dataset
        if user_column not in names:
            raise OptionValueError(f"DPTrainer(user_column={user_column!r}): the train_dataset "
                                   f"has no such column (its columns: {list(names)}). Add a "
                                   f"column naming each example's user, or pass user_ids= with "
                                   f"one id per example")
        return list(train[user_column])
    ids = []
    for i in range(len(train)):
        example = train[i]
        if not isinstance(example, collections.abc.Mapping) or user_column not in example:
            have = list(example) if isinstance(example, collections.abc.Mapping) \
                else type(example).__name__
            raise OptionValueError(f"DPTrainer(user_column={user_column!r}): example {i} of "
                                   f"the train_dataset has no such column (it holds {have}). Add "
                                   f"a column naming each example's user, or pass user_ids= with "
                                   f"one id per example")
        ids.append(example[user_column])
    return ids


def check_user_head(model: torch.nn.Module) -> None:
    """Refuses a model whose ``labels=`` loss is not a token mean over the rows (Note [DPTrainer
    at the user level])."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    if not name.endswith(CAUSAL_HEADS + TOKEN_HEADS):
        raise ValueError(
            f"DPTrainer(max_examples_per_user=...) trains causal and masked language models and "
            f"token classifiers at the user level, whose labels= loss ignores the -100 labels "
            f"of a user's padding slots; {name} is none of them. Train it with "
            f"dpfx.make_private(dpfx.per_user(model), ..., user_ids=, max_examples_per_user=) "
            f"and a per-user loss of your own (docs/users.md)")


class _WithoutColumn:
    """Trainer's collator, each example's ``column`` left out first (the model does not take
    the user id). A module-level class, so DataLoader workers can unpickle it."""

    def __init__(self, collate_fn, column: str | None):
        self.collate_fn, self.column = collate_fn, column

    def __call__(self, features):
        if self.column is not None:
            features = [{k: v for k, v in f.items() if k != self.column}
                        if isinstance(f, collections.abc.Mapping) else f for f in features]
        batch = self.collate_fn(features)
        if not isinstance(batch, collections.abc.Mapping):
            raise ValueError(f"DPTrainer at the user level needs the data collator to return a "
                             f"dict of tensors (the model's keyword inputs), got "
                             f"{type(batch).__name__}")
        return dict(batch)


class _UserLabels:
    """The (U, k, ...) batch of ``UserCollate`` with every label of a padding slot set to -100,
    the mask dropped (Note [DPTrainer at the user level])."""

    def __init__(self, collate: UserCollate):
        self.collate = collate

    def __call__(self, slots):
        batch, mask = self.collate(slots)
        labels = batch.get("labels")
        if not isinstance(labels, torch.Tensor):
            raise ValueError("DPTrainer at the user level trains on the model's own labels= loss: "
                             "the collated batch has no 'labels' tensor (use a collator that "
                             "makes them, such as DataCollatorForLanguageModeling)")
        padding = (mask == 0).view(*mask.shape, *[1] * (labels.dim() - 2))
        batch["labels"] = labels.masked_fill(padding, -100)
        return batch


def user_train_loader(dataset, users, max_examples_per_user: int, sample_rate: float, *,
                      collate_fn, column: str | None, steps: int, secure_mode: bool,
                      generator, rank: int, world_size: int, num_workers: int) -> PoissonLoader:
    """Trainer's training loader at the user level: dicts of (U, k, ...) tensors, tracked."""
    sampler = UserBatchSampler(users, max_examples_per_user, sample_rate, steps=steps,
                               generator=generator, rank=rank, world_size=world_size,
                               secure_mode=secure_mode)
    collate = UserCollate(dataset[0], sampler.max_examples_per_user,
                          _WithoutColumn(collate_fn, column))
    return PoissonLoader(UserSlots(dataset), batch_sampler=sampler,
                         collate_fn=_UserLabels(collate), num_workers=num_workers)


__all__ = ["user_ids_of", "check_user_head", "user_train_loader", "group_by_user"]
