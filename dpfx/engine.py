"""``make_private``: model, optimizer, Poisson loader and accountant, wired together.

    private = dpfx.make_private(model, optimizer, train_set, batch_size=256,
                                max_grad_norm=1.0, noise_multiplier=1.1)
    dp_model, optimizer, loader, accountant = private
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(dp_model(x), y).backward()
            optimizer.step()
        print(accountant.get_epsilon(1e-5))

or ``make_private_with_epsilon(..., target_epsilon=3.0, target_delta=1e-5, epochs=10)``, which
calibrates sigma for that budget first. Everything is derived from one place:

* sample rate q = batch_size / N (or ``sample_rate``), expected batch size D = round(q N);
* the loader is ``poisson_loader(dataset, q)``: round(1/q) steps per epoch, batch sizes vary and
  may be 0 (one compiled graph serves them all);
* ``dpfx.compile(model, expected_batch_size=D, ...)``;
* ``DPOptimizer`` records (sigma, q) in the accountant at every optimizer step, so epsilon
  counts exactly the steps taken; with ``ledger=path`` it first appends the step to a
  write-ahead privacy ledger, so that a crash loses no step (``privacy/ledger.py``).

With ``user_ids`` and ``max_examples_per_user`` the unit is the user: users are sampled, q and D
count users, and each user's summed gradient is clipped (Note [User-level sampling] in
loop/users.py).

Noise goes into the backward graph (fastest) unless the run needs it at the optimizer: virtual
batches (``max_physical_batch_size``), ``secure_mode``, or torch.distributed with more than one
rank (then each rank samples its shard: Note [Distributed Poisson sampling] in loop/data.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from dpfx.privacy import checkpoint as checkpoint_file
from dpfx.loop import fsdp
from dpfx import privacy
from dpfx.privacy import plan as privacy_plan
from dpfx import options
from dpfx.privacy import validate
from dpfx.api import DPModule, compile as dp_compile
from dpfx.loop.data import PoissonBatchSampler, expected_batch_size
from dpfx.loop.data import VirtualBatches
from dpfx.loop.samplers import BallsInBinsSampler, CyclicPoissonSampler, plan_loader
from dpfx.loop.users import group_by_user, user_loader
from dpfx.loop.optim import DPOptimizer
from dpfx.loop.ranks import rank_of, world_of
from dpfx.errors import OptionValueError


@dataclasses.dataclass
class PrivateTraining:
    """What ``make_private`` returns; unpacks as (model, optimizer, loader, accountant)."""
    model: DPModule
    optimizer: DPOptimizer
    loader: Any
    accountant: privacy.Accountant
    noise_multiplier: float
    sample_rate: float
    steps_per_epoch: int
    privacy_unit: str = "example"     # "user" with make_private(user_ids=...)

    def __iter__(self):
        return iter((self.model, self.optimizer, self.loader, self.accountant))


_LOADER_ARGS = ("num_workers", "pin_memory", "collate_fn", "worker_init_fn",
                "multiprocessing_context", "persistent_workers", "prefetch_factor", "timeout")


@options.renamed_keywords
def make_private(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 data: Dataset | DataLoader, *, max_grad_norm: float | dict,
                 noise_multiplier: float | None = None, batch_size: int | None = None,
                 sample_rate: float | None = None, target_epsilon: float | None = None,
                 target_delta: float | None = None, epochs: int | None = None,
                 accountant: str | privacy.Accountant = "pld", max_physical_batch_size: int | None = None,
                 secure_mode: bool = False, loss_reduction: str = "mean",
                 strategy: str = "auto", backend: str = "inductor", seed: int | None = None,
                 track_norms: bool = False, generator: torch.Generator | None = None,
                 process_group=None, ledger=None, loss=None, noise: str | None = None,
                 clipping: str | options.Clipping | None = None,
                 clipping_gamma: float | None = None,
                 target_unclipped_quantile: float | None = None, clip_lr: float | None = None,
                 count_noise_multiplier: float | None = None,
                 user_ids=None,
                 max_examples_per_user: int | None = None, mechanism=None,
                 sampler: str | None = None, **loader_kwargs) -> PrivateTraining:
    """Make a private training run out of a model, its optimizer and its data.

    ``data``: a map-style dataset, or a DataLoader whose dataset, batch size and loading options
    (workers, pinning, collate_fn) are reused; its own batching is replaced by Poisson sampling.
    Give exactly one of ``noise_multiplier`` or ``target_epsilon`` (with ``target_delta`` and
    ``epochs``), and one of ``batch_size`` (expected) or ``sample_rate``.
    ``ledger``: a file path for the write-ahead privacy ledger (``dpfx/privacy/ledger.py``): each step is
    on disk before its update, and a run made again with the same path counts every step the
    file holds, so a crash after the last checkpoint loses no epsilon.
    ``loss``: the loss function, captured with the model (``dpfx.compile(loss=...)``: train with
    ``dp_model.loss(x, y)``). ``clipping`` (a name or a ``dpfx.Clipping``), ``clipping_gamma``,
    ``target_unclipped_quantile``, ``clip_lr``, ``count_noise_multiplier``: as ``dpfx.compile``'s
    ("flat", "per_layer", "automatic" or "adaptive"; with a ``target_epsilon``, sigma is
    calibrated for the whole step and the gradient's share follows from
    ``count_noise_multiplier``).
    ``accountant``: "pld", "rdp", or a ``dpfx.privacy.Accountant`` to keep counting in (several
    runs over one dataset share one). ``noise``: where the noise is added ("graph" or
    "optimizer"); by default "optimizer" exactly when the run needs it (below).
    ``user_ids`` (one id per example) and ``max_examples_per_user`` (k): user-level DP (Note
    [User-level sampling] in loop/users.py): users are Poisson-sampled, ``batch_size`` is the
    expected number of users per step and q = batch_size / users, up to k examples per user
    come in (users, k, ...) batches with a (users, k) mask, each user's summed gradient is
    clipped, and epsilon is per user.
    ``mechanism``: the noise, "gaussian" (DP-SGD, the default), "bandmf", "bsr", "blt" or a
    ``dpfx.Mechanism`` with its bands or buffers: correlated noise across steps, which needs
    ``epochs`` (its strategy is built for the run's steps) and adds the noise at the optimizer.
    ``sampler``: "poisson" (the default for DP-SGD), "cyclic_poisson" (the default for the
    others) or "balls_in_bins" (Note [Noise mechanisms] in privacy/plan.py).
    """
    acc = accountant if isinstance(accountant, privacy.Accountant) \
        else validate.accountant(accountant)
    clip = options.clipping_option(clipping, clipping_gamma=clipping_gamma,
                                   target_unclipped_quantile=target_unclipped_quantile,
                                   clip_lr=clip_lr, count_noise_multiplier=count_noise_multiplier)
    validate.secure_sampling(secure_mode, generator)
    if isinstance(data, DataLoader):
        loader_kwargs = {**{k: getattr(data, k) for k in _LOADER_ARGS if hasattr(data, k)
                            and k not in ("prefetch_factor",)}, **loader_kwargs}
        if loader_kwargs.get("num_workers", 0) == 0:
            loader_kwargs.pop("persistent_workers", None)
            loader_kwargs.pop("timeout", None)
        if batch_size is None and sample_rate is None and user_ids is None:
            batch_size = data.batch_size        # examples: with user_ids, give users
        data = data.dataset
    n = len(data) if hasattr(data, "__len__") else None
    if not n:
        raise OptionValueError("data must be a non-empty map-style dataset (or a DataLoader "
                               "over one)")
    users = _users(user_ids, max_examples_per_user, n)
    units, unit = (n, "len(data)") if users is None else (len(users), "the number of users")
    if (batch_size is None) == (sample_rate is None):
        raise OptionValueError("give exactly one of batch_size (the expected batch size) or "
                               "sample_rate (its probability per example)" if users is None else
                               "give exactly one of batch_size (the expected number of users "
                               "per step) or sample_rate (each user's probability per step)")
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) \
                or not 0 < batch_size <= units:
            raise OptionValueError(f"batch_size must be an int in [1, {unit} = {units}], got "
                                   f"{batch_size!r}")
        sample_rate = batch_size / units
    if noise_multiplier is None and target_epsilon is not None \
            and (target_delta is None or epochs is None):
        raise OptionValueError("target_epsilon needs target_delta and epochs (the number of "
                               "passes the budget must cover)")
    if epochs is not None:
        validate.integer(epochs, "epochs", 1)
    plan = privacy_plan.make(
        sample_rate=sample_rate, noise_multiplier=noise_multiplier,
        target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs,
        accountant=acc.accountant if isinstance(acc, privacy.Accountant) else acc,
        mechanism=mechanism, sampler=sampler, steps_name="epochs")
    acc = plan.check_accountant(acc) if isinstance(acc, privacy.Accountant) else plan.accountant()
    q, noise_multiplier, steps_per_epoch = \
        plan.sample_rate, plan.noise_multiplier, plan.steps_per_epoch

    world = world_of(process_group)
    needs_optimizer = (max_physical_batch_size is not None or secure_mode or world > 1
                       or fsdp.units(module) or plan.strategy is not None)
    if noise is None:
        noise = "optimizer" if needs_optimizer else "graph"
    elif noise == "graph" and needs_optimizer:
        raise OptionValueError("noise='graph' cannot serve virtual batches, secure_mode, "
                               "several ranks or a correlated mechanism: they add the noise once "
                               "at the optimizer (noise='optimizer')")
    if users is not None:
        plan.check_poisson("users (user_ids=)")
    dp_model = dp_compile(module, max_grad_norm=max_grad_norm,
                          noise_multiplier=noise_multiplier, loss_reduction=loss_reduction,
                          expected_batch_size=expected_batch_size(units, q), seed=seed,
                          backend=backend, strategy=strategy, noise=noise,
                          track_norms=track_norms, loss=loss, clipping=clip)
    dp_optimizer = DPOptimizer(optimizer, dp_model, accountant=acc, sample_rate=q,
                               secure_mode=secure_mode, process_group=process_group,
                               ledger=ledger, **({} if plan.strategy is None
                                                 else {"mechanism": plan.strategy}))
    sampling = dict(steps=steps_per_epoch, generator=generator, secure_mode=secure_mode,
                    rank=rank_of(process_group) if world > 1 else 0, world_size=world)
    if users is not None:
        loader = user_loader(data, users, max_examples_per_user, q, **sampling, **loader_kwargs)
    else:
        loader = plan_loader(plan, data, **sampling, **loader_kwargs)
    if max_physical_batch_size is not None:
        loader = VirtualBatches(loader, max_physical_batch_size, dp_optimizer)
    return PrivateTraining(dp_model, dp_optimizer, loader, acc, noise_multiplier, q,
                           steps_per_epoch, "example" if users is None else "user")


def _users(user_ids, max_examples_per_user, n: int) -> list[torch.Tensor] | None:
    """Each user's example indices for user-level sampling, or None for example-level."""
    if user_ids is None and max_examples_per_user is None:
        return None
    if user_ids is None:
        raise OptionValueError("max_examples_per_user needs user_ids (one user id per example)")
    if max_examples_per_user is None:
        raise OptionValueError("user_ids needs max_examples_per_user (k: the most examples of "
                               "one user in one step, Note [User-level sampling] in "
                               "loop/users.py)")
    validate.integer(max_examples_per_user, "max_examples_per_user", 1)
    return group_by_user(user_ids, n)


@options.renamed_keywords
def make_private_with_epsilon(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              data: Dataset | DataLoader, *, target_epsilon: float,
                              target_delta: float, epochs: int, max_grad_norm: float | dict,
                              **kwargs) -> PrivateTraining:
    """``make_private`` with sigma calibrated so that ``epochs`` epochs spend ``target_epsilon``
    at ``target_delta`` (``dpfx.privacy.noise_multiplier``)."""
    return make_private(module, optimizer, data, max_grad_norm=max_grad_norm,
                        target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs,
                        **kwargs)


# Note [What a checkpoint restores]
# The model's parameters and buffers, the optimizer (the inner optimizer's state, the accountant's
# ledger, the step count and, with a seed, the generator of noise="optimizer"), the generator of
# the graph's noise when the model was compiled with ``seed``, and the generator of the Poisson
# sampler when one was given. A run saved between epochs and restored in a fresh process then
# continues bit for bit as if uninterrupted (tests/api/test_training_checkpoint.py). Without the noise
# generator's state a seeded run would restart its noise stream from the seed and add, after the
# restart, the very noise it added before it: noise an observer of both phases can subtract.
# Unseeded noise comes from the OS's CSPRNG and secure_mode's from os.urandom: those runs
# cannot be replayed, by design, and continue with fresh noise (so does a sampler without a
# generator). The privacy ledger (``make_private(ledger=)``) is not in the checkpoint: it is its
# own file, written ahead of every step, and may hold steps the checkpoint does not (Note
# [Write-ahead privacy ledger] in privacy/ledger.py).

def save_checkpoint(path, private: PrivateTraining | None = None, *, model=None, optimizer=None,
                    loader=None, **extra) -> None:
    """Save model parameters, optimizer state, the accountant's ledger and the seeded generators
    together, so that epsilon keeps counting after a restart (``load_checkpoint``). The file is
    replaced atomically: a save that fails or is killed leaves the previous checkpoint as it
    was (Note [Checkpoint files] in privacy/checkpoint.py). ``extra``: tensors, numbers, strings,
    None, and lists, tuples and str-keyed dicts of them."""
    model, optimizer, loader = _parts(private, model, optimizer, loader)
    if not isinstance(optimizer, DPOptimizer):
        raise TypeError("save_checkpoint needs the DPOptimizer, whose state holds the accountant")
    checkpoint_file.check_extra(extra)
    base = model._orig_mod if isinstance(model, DPModule) else model
    sharding = getattr(model, "_sharding", None)
    if sharding is not None:
        sharding.check_own_path(path)
    generators = {name: g.get_state() for name, g in _generators(model, loader).items()}
    checkpoint_file.write(path, {"model": base.state_dict(), "optimizer": optimizer.state_dict(),
                                 "generators": generators, "extra": extra})


def load_checkpoint(path, private: PrivateTraining | None = None, *, model=None,
                    optimizer=None, loader=None) -> dict:
    """Restore what ``save_checkpoint`` wrote into a freshly made run; returns ``extra``. A
    damaged, truncated or foreign file is a ValueError that says which; with a privacy ledger
    the accountant counts the larger of the checkpoint's and the ledger's steps."""
    model, optimizer, loader = _parts(private, model, optimizer, loader)
    state = checkpoint_file.read(path)
    if isinstance(optimizer, DPOptimizer):
        optimizer._check_loadable(state["optimizer"])       # another run's: refused, nothing lost
    base = model._orig_mod if isinstance(model, DPModule) else model
    base.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    saved = state.get("generators", {})
    for name, generator in _generators(model, loader).items():
        if name in saved:
            generator.set_state(saved[name])
    return state["extra"]


def _parts(private, model, optimizer, loader):
    if private is not None:
        return private.model, private.optimizer, private.loader
    return model, optimizer, loader


def _generators(model, loader) -> dict[str, torch.Generator]:
    """The seeded generators a bit-exact restart needs (Note [What a checkpoint restores])."""
    found = {}
    if isinstance(model, DPModule) and model._dpfx_backend._generator is not None:
        found["graph_noise"] = model._dpfx_backend._generator
    loader = loader.loader if isinstance(loader, VirtualBatches) else loader
    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, (PoissonBatchSampler, CyclicPoissonSampler, BallsInBinsSampler)) \
            and sampler.generator is not None:
        found["sampler"] = sampler.generator
    return found
