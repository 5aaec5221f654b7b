"""``DPTrainer``: ``transformers.Trainer`` training with DP-SGD, and what changes against it.

    trainer = dpfx.hf.DPTrainer(
        model=model, args=TrainingArguments(output_dir="out", per_device_train_batch_size=32,
                                            gradient_accumulation_steps=8, num_train_epochs=3),
        train_dataset=train, eval_dataset=test, data_collator=collator,
        target_epsilon=8.0, target_delta=1e-5, max_grad_norm=1.0)
    trainer.train()          # epsilon logged with the loss and in the final metrics

What changes against a plain Trainer, and nothing else (evaluation, logging, callbacks, LR
schedules, saving stay Trainer's):

- the model is ``dpfx.compile``'d (noise="optimizer") with the trainer's per-example clipping
  bound ``max_grad_norm`` and the noise multiplier of the run's privacy plan (given, or
  calibrated from ``target_epsilon`` over the run's optimizer steps: ``privacy/plan.py``);
- the training loader samples Poisson batches (``loop/samplers.plan_loader``, Trainer's collator
  and column filtering kept): each example joins a logical batch with probability
  q = (per-device batch size * gradient_accumulation_steps * processes) / N, so batch sizes
  vary, and may be 0;
- a logical batch runs as physical batches whose clipped sums accumulate, noised once (Note
  [Gradient accumulation is a virtual batch]);
- the optimizer Trainer builds is wrapped in ``dpfx.DPOptimizer`` holding the accountant, so
  Trainer's checkpoints (its ``optimizer.pt``) carry the accountant and resuming keeps
  counting; each checkpoint also gets ``dp_accountant.json``, and with checkpoints on every
  step is first written to the privacy ledger ``output_dir/privacy.ledger`` (hf/resume.py);
- with ``target_epsilon``, a resumed run noises the steps left of its plan so that all its
  steps together stay within the target, or refuses to train (Note [A resumed run keeps its
  budget] in hf/resume.py);
- ``epsilon`` (at ``delta``) is logged with the loss at every logging step, and with
  ``train_loss`` in the metrics ``train()`` logs and returns at its end;
- the model's own ``labels=`` loss is taken per example (loss/hf_labels.py), with every scalar
  applied after the batch reduction removed (Note [The per-example term] in loss/check.py).

``clipping=`` picks the clip function as ``dpfx.compile``'s does (a name or a ``dpfx.Clipping``;
or the keywords ``clipping_gamma``, ``target_unclipped_quantile``, ``clip_lr``,
``count_noise_multiplier``): under "adaptive" the bound C_t starts at ``max_grad_norm``, moves
after each optimizer step (the count of unclipped examples summed over the step's physical
batches and noised once, by ``DPOptimizer``), and is saved in Trainer's ``optimizer.pt`` and in
``dp_accountant.json``, so a resumed run continues from the checkpoint's C_t.

With ``user_column=`` (or ``user_ids=``) and ``max_examples_per_user=``, the unit is the user
(Note [DPTrainer at the user level] in hf/users.py). Launched on several processes (torchrun,
``accelerate launch``): Note [DPTrainer over several processes] in hf/ranks.py.

A plain ``Trainer`` given a ``dpfx.compile``'d model trains too (one release per optimizer
step), but samples shuffled fixed-size batches and accounts nothing: dpfx says so once
(``UnaccountedTrainingWarning``).

Note [Gradient accumulation is a virtual batch]
A logical batch runs as near-equal physical batches of at most ``per_device_train_batch_size``
examples (Note [Near-equal physical batches] in loop/data.py), whose clipped sums accumulate;
the noise is added once per optimizer step, and the accountant counts that step once
(``DPOptimizer.signal_skip_step``, as ``dpfx.VirtualBatches``). Trainer itself therefore runs
with ``gradient_accumulation_steps=1`` and without its own gradient clipping (the clip that
makes the step private is per example, inside dpfx's graph).
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch
from transformers import Trainer, TrainingArguments

from dpfx import options
from dpfx.privacy import plan as privacy_plan
from dpfx.privacy import validate
from dpfx.api import DPModule, compile as dp_compile
from dpfx.hf import resume
from dpfx.hf.ranks import broadcast_from_rank0, check_launch
from dpfx.hf.users import users_of, user_train_loader
from dpfx.loop import fsdp
from dpfx.loop.data import expected_batch_size
from dpfx.loop.samplers import plan_loader
from dpfx.config import DPConfig
from dpfx.errors import OptionValueError, PrivacyError
from dpfx.loss.track import TrackedTensor, arranged_by_trainer, track_batch, untrack
from dpfx.loop.data import agreed_pieces, split_batch
from dpfx.loop.optim import DPOptimizer
from dpfx.loop.users import PerUser, per_user


class DPTrainer(Trainer):
    """``transformers.Trainer`` that trains with DP-SGD (see the module's docstring).

    ``max_grad_norm``: the per-example clipping bound C (TrainingArguments' own max_grad_norm,
    a clip of the summed gradient, is turned off); under ``clipping="adaptive"`` its initial
    value C_0. ``clipping`` (a name or a ``dpfx.Clipping``), ``clipping_gamma``,
    ``target_unclipped_quantile``, ``clip_lr`` and ``count_noise_multiplier``: the clip function, as
    ``dpfx.compile``'s ("flat" by default, "per_layer" for a dict of bounds, "automatic":
    C / (||g|| + clipping_gamma), "adaptive": C_t follows the ``target_unclipped_quantile`` of the
    per-example norms at rate ``clip_lr``, the count noised with std
    ``count_noise_multiplier``, required with noise and above sigma / 2; it costs no epsilon
    beyond sigma's: docs/options.md); every option is checked before the model is touched.
    Give exactly one of ``noise_multiplier`` or ``target_epsilon``. ``target_delta`` (default 1/(10 N)) is the delta epsilon is reported
    at. ``accountant``: "pld" or "rdp". ``sampler_generator`` seeds the Poisson sampler (for
    tests and replayable runs; by default each run samples afresh). ``ledger``: the privacy
    ledger's path (Note [Write-ahead privacy ledger] in privacy/ledger.py); by default
    ``output_dir/privacy.ledger`` when Trainer saves checkpoints, so that a run killed between
    two checkpoints still counts every step it released when resumed. ``dp_kwargs`` go to
    ``dpfx.compile`` (backend, strategy, seed, self_check). Over several processes, see Note
    [DPTrainer over several processes] in hf/ranks.py. ``user_column`` (a train_dataset column
    naming each example's user) or ``user_ids`` (one id per example), with
    ``max_examples_per_user``: user-level DP, the batch sizes counting users (Note [DPTrainer at
    the user level] in hf/users.py). ``mechanism`` and ``sampler``: the noise and the sampling,
    as ``dpfx.make_private``'s (Note [Noise mechanisms] in privacy/plan.py); a correlated
    mechanism is built for the planned steps (``max_steps``, or ``num_train_epochs``)."""

    accounts_privacy = True     # a Trainer that counts epsilon (loop/checks.py)

    @options.renamed_keywords
    def __init__(self, model=None, args: TrainingArguments | None = None, *,
                 max_grad_norm: float = 1.0, noise_multiplier: float | None = None,
                 target_epsilon: float | None = None, target_delta: float | None = None,
                 accountant: str = "pld", secure_mode: bool = False,
                 sampler_generator: torch.Generator | None = None,
                 ledger: str | bool | None = True, dp_kwargs: dict | None = None,
                 user_column: str | None = None, user_ids=None,
                 max_examples_per_user: int | None = None,
                 clipping: str | options.Clipping | None = None,
                 clipping_gamma: float | None = None,
                 target_unclipped_quantile: float | None = None, clip_lr: float | None = None,
                 count_noise_multiplier: float | None = None,
                 mechanism=None, sampler: str | None = None, **kwargs):
        if model is None:
            raise OptionValueError("DPTrainer needs the model (model_init is not supported: "
                                   "the compiled model and the accountant are made once)")
        if isinstance(model, DPModule):
            raise OptionValueError("DPTrainer compiles the model itself: pass the model, not "
                                   "the dpfx.compile'd module")
        train = kwargs.get("train_dataset")
        if train is None or not hasattr(train, "__len__") or len(train) == 0:
            raise OptionValueError("DPTrainer needs a non-empty map-style train_dataset: "
                                   "Poisson sampling draws each example independently")
        misplaced = sorted({"user_ids", "user_column", "max_examples_per_user",
                            *options.KEYWORDS} & set(dp_kwargs or {}))
        if misplaced:
            raise OptionValueError(f"pass {', '.join(misplaced)} to DPTrainer itself, not in "
                                   f"dp_kwargs (which go to dpfx.compile)")
        clip = options.clipping_option(clipping, clipping_gamma=clipping_gamma,
                                       target_unclipped_quantile=target_unclipped_quantile,
                                       clip_lr=clip_lr, count_noise_multiplier=count_noise_multiplier)
        # Note [DPTrainer at the user level] in hf/users.py
        self.users = users_of(model, train, user_ids, user_column, max_examples_per_user)
        self.user_column = user_column
        self.max_examples_per_user = max_examples_per_user
        self.privacy_unit = "example" if self.users is None else "user"
        args = args if args is not None else TrainingArguments(output_dir="trainer_output")
        # Note [DPTrainer over several processes] in hf/ranks.py
        self.world = check_launch(model, args)
        self.rank = args.process_index if self.world > 1 else 0
        n = len(train) if self.users is None else len(self.users)
        physical = args.per_device_train_batch_size
        logical = physical * args.gradient_accumulation_steps * self.world
        if logical > n:
            raise OptionValueError(f"the expected logical batch ({physical} x "
                                   f"{args.gradient_accumulation_steps} accumulation steps x "
                                   f"{self.world} processes = {logical}) exceeds the {n} "
                                   f"training {self.privacy_unit}s")
        self.delta = validate.delta(target_delta if target_delta is not None
                                    else 1 / (10 * n), "target_delta")
        self.sample_rate = validate.sample_rate(logical / n)
        self.physical_batch_size = physical
        self.plan = privacy_plan.make(
            sample_rate=self.sample_rate, noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon, target_delta=self.delta,
            steps=args.max_steps if args.max_steps > 0 else None,
            epochs=None if args.max_steps > 0 else args.num_train_epochs,
            accountant=accountant, mechanism=mechanism, sampler=sampler,
            steps_name="max_steps or num_train_epochs")
        self.steps_per_epoch = self.plan.steps_per_epoch     # a pass of the plan's sampler
        if self.users is not None or self.world > 1:
            self.plan.check_poisson("users" if self.users is not None else "their shards")
        self.target_epsilon = target_epsilon
        self.noise_multiplier = self.plan.noise_multiplier
        # the clipping validated as dpfx.compile will, before the model is broadcast,
        # checkpointed or compiled (every clip function trains on every path)
        DPConfig(max_grad_norm, self.noise_multiplier, clip=clip)
        validate.secure_sampling(secure_mode, sampler_generator)
        self.secure_mode = secure_mode
        self.sampler_generator = sampler_generator   # mixed with the rank by the sampler
        self.accountant = self.plan.accountant()
        checkpointing = _checkpointing_fields(args)
        if self.world > 1 and not fsdp.units(model):
            broadcast_from_rank0(model, args.device)
        if any(getattr(args, f) for f in checkpointing):
            # enabled on the user's model before compiling (dynamo captures the checkpointed
            # forward; the wrappers have no such method), and turned off for Trainer
            _enable_checkpointing(model.module if isinstance(model, PerUser) else model, args)
        self._compile_settings = dict(max_grad_norm=max_grad_norm,
                                      expected_batch_size=expected_batch_size(n, self.sample_rate),
                                      noise="optimizer", clipping=clip, **(dp_kwargs or {}))
        dp_model = dp_compile(model if self.users is None else per_user(model),
                              noise_multiplier=self.noise_multiplier, **self._compile_settings)
        if ledger is True:
            ledger = os.path.join(args.output_dir, resume.LEDGER_FILE) \
                if args.save_strategy != "no" else None
        self.ledger = ledger or None
        # See Note [Gradient accumulation is a virtual batch]
        args = dataclasses.replace(args, gradient_accumulation_steps=1, max_grad_norm=0.0,
                                   **{f: False for f in checkpointing})
        super().__init__(model=dp_model, args=args, **kwargs)
        self.dp_optimizer: DPOptimizer | None = None
        self.add_callback(resume.CheckpointAccountant(self))

    def planned_steps(self, args: TrainingArguments | None = None) -> int:
        """The optimizer steps the run will take (Trainer's own count)."""
        args = args or self.args
        if args.max_steps > 0:
            return args.max_steps
        return math.ceil(args.num_train_epochs * self.steps_per_epoch)

    def get_epsilon(self) -> float:
        """Epsilon at ``delta`` of the optimizer steps taken so far."""
        return self.accountant.get_epsilon(self.delta)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """Trainer's ``train``, with the noise of the steps left fitted to what the run has
        spent (Note [A resumed run keeps its budget] in hf/resume.py)."""
        if resume_from_checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            # Trainer's own rule; it raises where there is none
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True
        sigma = resume.noise_for_resume(self, resume_from_checkpoint or None)
        if sigma != self.noise_multiplier:
            self._compile_again(sigma)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _compile_again(self, sigma: float) -> None:
        """The model compiled with noise multiplier ``sigma`` in place of the current one."""
        old = self.model
        self.model = dp_compile(old._orig_mod, noise_multiplier=sigma, **self._compile_settings)
        old._detach_from_model()
        self.model_wrapped = self.callback_handler.model = self.model
        self.noise_multiplier = sigma
        if self.dp_optimizer is not None:      # a later train() of this trainer: wrap anew
            if self.dp_optimizer.privacy_ledger is not None:
                self.dp_optimizer.privacy_ledger.close()
            self.optimizer = self.dp_optimizer.original_optimizer
            self.dp_optimizer = None

    # -- the parts of Trainer that change -----------------------------------------------------
    def get_train_dataloader(self):
        """Poisson batches over the training set, with Trainer's collator and column filtering
        (not passed through accelerate, whose rebuilt loader would sample fixed-size batches)."""
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets
            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        if self.users is not None:      # Note [DPTrainer at the user level] in hf/users.py
            return user_train_loader(
                dataset, self.users, self.max_examples_per_user, self.sample_rate,
                collate_fn=collator, column=self.user_column, steps=self.steps_per_epoch,
                secure_mode=self.secure_mode, generator=self.sampler_generator, rank=self.rank,
                world_size=self.world, num_workers=self.args.dataloader_num_workers)
        return plan_loader(self.plan, dataset, steps=self.steps_per_epoch,
                           secure_mode=self.secure_mode, collate_fn=collator,
                           generator=self.sampler_generator, rank=self.rank,
                           world_size=self.world, num_workers=self.args.dataloader_num_workers)

    def _wrap_model(self, model, training=True, dataloader=None):
        """Over several processes, the compiled model prepared as for evaluation (device
        placement, autocast), never wrapped in DDP: dpfx's step reduces across the ranks
        (Note [DPTrainer over several processes] in hf/ranks.py)."""
        if training and self.world > 1 and model is self.model:
            return self.accelerator.prepare_model(model, evaluation_mode=True)
        return super()._wrap_model(model, training, dataloader)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if not isinstance(optimizer, DPOptimizer):
            if self.ledger is not None:
                os.makedirs(os.path.dirname(os.path.abspath(self.ledger)), exist_ok=True)
            mechanism = {} if self.plan.strategy is None else {"mechanism": self.plan.strategy}
            self.dp_optimizer = DPOptimizer(optimizer, self.model, accountant=self.accountant,
                                            sample_rate=self.sample_rate,
                                            secure_mode=self.secure_mode, ledger=self.ledger,
                                            **mechanism)
            self.optimizer = self.dp_optimizer
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One logical batch: its physical batches' backwards accumulate clipped sums; Trainer's
        optimizer step after this call noises them once (Note [Gradient accumulation is a
        virtual batch]). Trainer's ``num_items_in_batch`` (the batch's token count) is not
        passed on: dpfx removes that normalizer from every example's term anyway."""
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise PrivacyError("DPTrainer's model was wrapped in DistributedDataParallel, whose "
                               "all-reduce would average the clipped sums and the noise; "
                               "dpfx reduces across ranks itself (Note [DPTrainer over several "
                               "processes] in hf/ranks.py)")
        tracked = any(isinstance(t, TrackedTensor) for t in torch.utils._pytree.tree_leaves(inputs))
        plain = untrack(inputs) if tracked else inputs
        chunks = split_batch(plain, self.physical_batch_size,
                             agreed_pieces(self.model, plain, self.physical_batch_size))
        total, examples = None, 0
        for i, chunk in enumerate(chunks):
            if i:
                # the previous physical batch's step, skipped: the logical step stays open
                self.dp_optimizer.signal_skip_step(True)
                self.dp_optimizer.step()
            size = _batch_size(chunk)
            with arranged_by_trainer():     # Note [A scale dpfx arranged] in loss/arranged.py
                loss = super().training_step(model, track_batch(chunk) if tracked else chunk)
            loss = loss.as_subclass(torch.Tensor) if isinstance(loss, TrackedTensor) else loss
            if size:
                total = loss * size if total is None else total + loss * size
                examples += size
        if total is None:
            return torch.zeros((), device=self.args.device)
        return total / examples

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """At the user level, evaluation batches hold examples, not users: the user's model
        runs them, as Trainer's would (no gradient is released there)."""
        if self.users is not None and isinstance(model, DPModule):
            model = model._orig_mod.module
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def log(self, logs: dict, *args, **kwargs) -> None:
        """Epsilon beside the loss of every logging step and beside ``train_loss`` in the
        metrics at the end of ``train()`` (the dict ``train()`` returns), so that a run shorter
        than ``logging_steps`` reports it too."""
        if "loss" in logs or "train_loss" in logs:
            logs["epsilon"] = self.get_epsilon()
            # Trainer's norm of the summed gradient before its own clip, which DPTrainer turns
            # off: not computed (0) and not what a DP run clips
            logs.pop("grad_norm", None)
        super().log(logs, *args, **kwargs)

    # -- checkpoints: hf/resume.py -------------------------------------------------------------
    def _save(self, output_dir=None, state_dict=None):
        with resume.users_model(self):
            super()._save(output_dir, state_dict=None)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        with resume.users_model(self):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        resume.restore_accountant(self.accountant, checkpoint)


def _checkpointing_fields(args) -> list[str]:
    """TrainingArguments' switches of activation (gradient) checkpointing, by version."""
    names = {f.name for f in dataclasses.fields(args)}
    return [f for f in ("activation_checkpointing", "gradient_checkpointing") if f in names]


def _enable_checkpointing(model, args) -> None:
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None)
                  or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={k: v for k, v in kwargs.items()
                                             if k not in ("every_n_layers", "offload")} or None,
            every_n_layers=kwargs.get("every_n_layers", 1), offload=kwargs.get("offload", False))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


def _batch_size(batch) -> int:
    for t in torch.utils._pytree.tree_leaves(batch):
        if isinstance(t, torch.Tensor) and t.dim():
            return t.shape[0]
    return 0
