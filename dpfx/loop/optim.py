"""``DPOptimizer``: the optimizer side of a private run.

    dp_model = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.1,
                            expected_batch_size=256, noise="optimizer")
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp_model,
                           accountant=dpfx.privacy.Accountant(), sample_rate=256 / 60000)
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(dp_model(x), y).backward()
        opt.step()                       # noise once, divide by D, step, count epsilon

It wraps any ``torch.optim.Optimizer`` (its ``param_groups`` and ``state`` are the inner
optimizer's, so LR schedulers work) and does, at ``step()``:

* ``noise="graph"`` models: p.grad is already private (the backward graph noised it); step and
  record the step in the accountant.
* ``noise="optimizer"`` models: the backward passes left sum_i clip(g_i) in
  ``dp_model.clipped_sums``. ``step()`` adds N(0, (sigma * S)^2) once (torch's generator, or the
  CSPRNG with ``secure_mode``), all-reduces across ranks when distributed (Note [Noise once
  across ranks]), divides by D, writes p.grad and steps. p.grad is None between the backward and
  ``step()``; the inner optimizer's step pre-hooks see the noised p.grad, so post-processing of
  the release (``clip_grad_norm_``) goes there (Note [Only dpfx's gradients reach a private
  step] in loss/gate.py).
* with ``mechanism=`` (a correlated-noise strategy, dpfx.privacy.strategies; noise="optimizer"):
  the noise of step t is sigma * S * w_t, w = C^{-1} z over fresh N(0, I) draws z_t, from a state
  of earlier noise only (loop/correlated.py, Note [Correlated noise where it is drawn]); the
  state goes into ``state_dict()``, and step n + 1 of an n-step strategy is refused.
  ``check_noise_every=N`` checks the releases against the dense C^{-1} (Note [Checking the
  releases] in loop/correlated.py). Every step sets ``noise_variance``, the variance of each
  coordinate of the noise in p.grad, (sigma * S / D)^2 times Var(w_t) (1 for Gaussian noise), and
  the inner optimizer's ``dp_noise_variance`` when it has one (a bias-corrected Adam reads it).
* with ``ledger=`` (a path or a ``dpfx.privacy.ledger.PrivacyLedger``): before either of the above
  touches the parameters, the step is appended to the privacy ledger and fsynced, so a restart
  counts it (Note [Write-ahead privacy ledger] in privacy/ledger.py).

The noise is drawn by a ``StepNoise`` (loop/step_noise.py: the generator or the CSPRNG, the
correlation state) and written into p.grad by a ``GradWriter`` (loop/grads.py: one process,
replicated ranks, shards, and the adaptive count); this class holds the step, the accounting
and the checkpoint.

# Note [Virtual batches]
A logical batch too big for memory runs as several physical batches. ``signal_skip_step()``
(which ``virtual_batches`` calls for every physical batch but the last) turns the next
``step()`` and ``zero_grad()`` into no-ops, so the clipped sums of all physical batches add up
and the noise is added once, for the logical batch. Since the graph undoes the mean over each
physical batch before clipping, the sum is independent of how the batch is split: with sigma = 0
it equals the one-big-batch step (tests/loop/test_engine.py).

# Note [Noise once across ranks]
With torch.distributed initialized (world size W > 1), rank 0 adds N(0, (sigma * S)^2) to its
clipped sum before one all-reduce (SUM) of all parameters flattened together; other ranks add
nothing. Every rank then holds the same noisy sum and takes the same step. The alternative,
N(0, (sigma * S)^2 / W) on every rank, gives the same distribution only if every rank's
generator is independent and honest; with one noising rank the guarantee does not depend on the
other ranks' generators. As in every DP-SGD deployment, the ranks are trusted with the data.

# Note [A dead peer]
A rank that dies, or hangs, strands the others in the step's all-reduce. gloo notices a closed
connection at once; a silent peer (and NCCL, without its async error handling) is noticed only
when the process group's timeout expires, so ``init_process_group(timeout=)`` is the bound on
the wait. The backend's error becomes a ``dpfx.PeerError`` that says which step failed, that
this rank did not take it, and how to resume. Rank 0 recorded the step in its privacy ledger
before the all-reduce (its noise was drawn), so the restarted run counts it
(tests/privacy/test_faults.py).
"""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from dpfx.backend import DPBackend
from dpfx.errors import DPFXWarning, PrivacyError
from dpfx.privacy.ledger import PrivacyLedger, check_same_run, reconcile
from dpfx.loop.correlated import check_mechanism, check_resume
from dpfx.loop.grads import GradWriter, noise_std
from dpfx.privacy import Accountant, validate
from dpfx.loop.ranks import check_same_model, rank_of, world_of
from dpfx.loop.checks import BatchSizes
from dpfx.loop.step_noise import StepNoise
from dpfx.loss.gate import warn_at_caller

# Set once at construction: changing them later would make the noise, the divisor or the
# accountant disagree with the compiled model (Opacus users set optimizer.noise_multiplier).
_FIXED_SETTINGS = {"noise_multiplier", "max_grad_norm", "expected_batch_size", "loss_reduction",
                   "sample_rate", "secure_mode", "mechanism"}


class NoNoiseWarning(DPFXWarning):
    """A DPOptimizer with noise_multiplier=0: the steps are not private (epsilon is infinite)."""


def _check_and_bind(optimizer, dp_model, accountant, sample_rate, secure_mode: bool,
                    process_group, ledger, mechanism, check_noise_every) -> int:
    """The DPOptimizer's arguments checked against the compiled model, before anything is
    built; a sharded model's shards bound to the optimizer. Returns the world size."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, DPOptimizer):
        raise TypeError("optimizer is already a DPOptimizer")
    if not isinstance(getattr(dp_model, "_dpfx_backend", None), DPBackend):
        raise TypeError(f"dp_model must be what dpfx.compile returned, got "
                        f"{type(dp_model).__name__}")
    if accountant is not None and sample_rate is None:
        raise ValueError("sample_rate: the accountant needs the Poisson sample rate q of each "
                         "step (expected batch size / dataset size)")
    if sample_rate is not None:
        validate.sample_rate(sample_rate)
    if accountant is not None and not isinstance(accountant, Accountant):
        raise TypeError(f"accountant must be a dpfx.privacy.Accountant, got "
                        f"{type(accountant).__name__}")
    if ledger is not None and accountant is None:
        raise ValueError("ledger: the privacy ledger records the accountant's steps; give "
                         "an accountant too")
    config = dp_model.dp_config
    if secure_mode and config.noise != "optimizer":
        raise ValueError("secure_mode draws the noise outside the graph: compile the model "
                         "with dpfx.compile(..., noise='optimizer')")
    if secure_mode and config.seed is not None:
        raise ValueError("secure_mode refuses a fixed seed: noise that can be replayed can be "
                         "subtracted. Compile without seed=")
    check_mechanism(mechanism, config, check_noise_every)
    world = world_of(process_group)
    if world > 1 and config.noise != "optimizer":
        raise ValueError("distributed training adds the noise once across ranks, at step(): "
                         "compile the model with dpfx.compile(..., noise='optimizer')")
    if world > 1 and config.loss_reduction == "mean" \
            and config.expected_batch_size is None:
        raise ValueError("distributed training needs expected_batch_size (the global "
                         "expected batch size q*N) to divide by")
    sharding = dp_model._sharding
    if sharding is not None:
        # Note [Sharded DP-SGD] in loop/fsdp.py: the optimizer holds the shards
        sharding.release()
        if world != sharding.world:
            raise ValueError(
                f"the process group has {world} ranks and the model is sharded over "
                f"{sharding.world}: shard over every rank of the group (HSDP and sub-meshes "
                f"are not supported), or pass the mesh's group as process_group")
    trainable = {id(p): n for n, p in dp_model._orig_mod.named_parameters()
                 if p.requires_grad}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in trainable:
                raise ValueError(
                    "the optimizer updates a parameter that is not a trainable parameter of "
                    "dp_model; its gradient would not be private" + (
                        "" if sharding is None else ". With fully_shard, build the "
                        "optimizer after sharding, over the sharded model.parameters()"))
    if sharding is not None:
        sharding.bind([(n, p) for n, p in dp_model._orig_mod.named_parameters()
                       if p.requires_grad])
        if sharding.world > 1:
            sharding.check_same_structure()
    elif world > 1:
        check_same_model(dp_model._orig_mod, process_group)
    if dp_model.clipped_sums:
        raise ValueError("dp_model holds clipped sums of backward passes run before this "
                         "DPOptimizer existed; call dp_model.reset_clipped_sums() first, or "
                         "they would be stepped as part of its first step")
    return world


class DPOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer: torch.optim.Optimizer, dp_model, *,
                 accountant: Accountant | None = None, sample_rate: float | None = None,
                 secure_mode: bool = False, process_group=None, ledger=None, mechanism=None,
                 check_noise_every: int | None = None):
        self.world = _check_and_bind(optimizer, dp_model, accountant, sample_rate, secure_mode,
                                     process_group, ledger, mechanism, check_noise_every)
        config, sharding = dp_model.dp_config, dp_model._sharding
        self.original_optimizer = optimizer
        self.dp_model = dp_model
        self.accountant = accountant
        self.sample_rate = sample_rate
        self.secure_mode = secure_mode
        self.process_group = process_group
        self.mechanism = mechanism
        self.steps = 0
        self.noise_variance = None      # of each coordinate of the last step's p.grad
        # Note [Write-ahead privacy ledger] in privacy/ledger.py. Rank 0 keeps it: every rank takes the
        # same steps, and rank 0 adds the noise.
        self.privacy_ledger = None
        self._ledger_given = ledger is not None
        if ledger is not None and (self.world <= 1 or rank_of(process_group) == 0):
            self.privacy_ledger = ledger if isinstance(ledger, PrivacyLedger) \
                else PrivacyLedger(ledger)
            reconcile(self.privacy_ledger, accountant, self._max_grad_norm())
        self._share_count()
        # Where the noise is added, fixed with the compiled model: in its backward graph (p.grad
        # is private when step() runs) or here, once per logical step
        self._noised_in_graph = config.noise == "graph"
        self._skip_next = False
        self._open = False          # a logical step has started but not been taken
        self._named = [(n, p) for n, p in dp_model._orig_mod.named_parameters()
                       if p.requires_grad]
        # the noise drawn here (none under graph noise), and where it is written
        self._source = StepNoise(config, self._noise_device(), secure_mode=secure_mode,
                                sharding=sharding, mechanism=mechanism,
                                check_noise_every=check_noise_every,
                                draws=sharding is not None or self.world <= 1
                                or rank_of(process_group) == 0)
        self._grads = GradWriter(dp_model, self._named, self._source, dp_model._dpfx_backend.gate,
                                 world=self.world, process_group=process_group)
        self._privatize = (lambda count, steps: count) if self._noised_in_graph else \
            self._grads.replicated if sharding is None else self._grads.sharded
        self._optimizer_step_pre_hooks = collections.OrderedDict()
        self._optimizer_step_post_hooks = collections.OrderedDict()
        self._gate = dp_model._dpfx_backend.gate
        # Note [One release per accounted step] in loss/gate.py: from now on a second backward
        # before step() is refused
        self._gate.attach(self, config.noise)
        # Note [Batch sizes far from expected_batch_size] in loop/checks.py: with
        # noise="optimizer" the logical step is the release; on several ranks each sees a shard
        self._batch_sizes = BatchSizes(config.expected_batch_size) if (
            config.noise == "optimizer" and self.world <= 1 and config.loss_reduction == "mean"
            and config.expected_batch_size is not None) else None
        if config.noise_multiplier == 0:
            warn_at_caller(
                "noise_multiplier=0: no noise is added, so the steps are not differentially "
                "private and epsilon is infinite, whatever else the accountant reports. Use it "
                "to debug or to compare with non-private training only.", NoNoiseWarning)

    def __setattr__(self, name, value):
        if name in _FIXED_SETTINGS and "_gate" in self.__dict__:
            raise PrivacyError(
                f"'{name}' cannot change after the DPOptimizer is built: the compiled model's "
                f"noise and clipping and the accountant's record must agree. Compile the model "
                f"again with the new setting and build a new DPOptimizer.")
        super().__setattr__(name, value)

    # The inner optimizer's state, seen through this one (LR schedulers read param_groups).
    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.original_optimizer.param_groups = value

    @property
    def state(self):
        return self.original_optimizer.state

    @state.setter
    def state(self, value):
        self.original_optimizer.state = value

    @property
    def defaults(self):
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.original_optimizer.defaults = value

    # The noise source's state, read through the optimizer
    @property
    def _generator(self) -> torch.Generator | None:
        return self._source.generator

    @property
    def _correlated(self):
        return self._source.correlated

    @property
    def _check(self):
        return self._source.check

    def __repr__(self) -> str:
        return f"DPOptimizer({self.original_optimizer!r})"

    # The compiled model's settings, read-only here as on Opacus's DPOptimizer (_FIXED_SETTINGS).
    @property
    def noise_multiplier(self) -> float:
        return self.dp_model.dp_config.noise_multiplier

    @property
    def max_grad_norm(self):
        return self._max_grad_norm()

    @property
    def expected_batch_size(self) -> int | None:
        return self.dp_model.dp_config.expected_batch_size

    @property
    def loss_reduction(self) -> str:
        return self.dp_model.dp_config.loss_reduction

    # -- the step ----------------------------------------------------------------------------------
    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Make the next ``step()`` and ``zero_grad()`` no-ops (Note [Virtual batches])."""
        if do_skip and self._noised_in_graph:
            raise ValueError("virtual batches accumulate clipped sums across backward passes and "
                             "noise them once: compile the model with noise='optimizer'")
        self._skip_next = do_skip

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._open:
            return          # inside a logical batch: keep the clipped sums accumulating
        if self._gate.unstepped and self._noised_in_graph:
            self._write_ahead()
            self._account()     # a noisy release discarded unstepped still happened
        self._gate.close_step()
        self.original_optimizer.zero_grad(set_to_none)
        self.dp_model.reset_clipped_sums()

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._skip_next:
            self._skip_next = False
            self._open = True
            self._gate.close_step()
            return loss
        self._source.check_left(self.steps, self.privacy_ledger)
        # Note [Only dpfx's gradients reach a private step] in loss/gate.py
        self._gate.ledger.check(self._named)
        self._write_ahead()     # Note [Write-ahead privacy ledger] in privacy/ledger.py
        examples, count = self.dp_model.examples, self._take_count()
        if self._batch_sizes is not None:
            self._batch_sizes.observe(examples)
        std, self._grads.divisor = noise_std(self.dp_model), None   # of the bound it clips to
        count = self._privatize(count, self.steps)   # several ranks: the count goes with the sums
        self._grads.adapt(count, examples)
        self._gate.close_step()
        self._set_noise_variance(std, examples)
        self.original_optimizer.step()
        self._gate.ledger.stepped()     # Note [Gradients kept across steps] in loss/gate.py
        self._open = False
        self.steps += 1
        self._account()
        return loss

    def _set_noise_variance(self, std: float, examples: int) -> None:
        """The variance of each coordinate of the noise in this step's p.grad: (sigma S / D)^2,
        times Var(w_t) under a correlated-noise strategy; given to an inner optimizer that
        reads ``dp_noise_variance`` (a bias-corrected Adam) before it steps."""
        divisor = self._grads.divisor
        if divisor is None:             # noise="graph": the graph divided
            config = self.dp_model.dp_config
            divisor = 1.0 if config.loss_reduction == "sum" else float(
                config.expected_batch_size or examples or 1)
        variance = (std / divisor) ** 2
        if self.mechanism is not None:
            variance *= float(self.mechanism.noise_variance(self.steps))
        self.noise_variance = variance
        if hasattr(self.original_optimizer, "dp_noise_variance"):
            self.original_optimizer.dp_noise_variance = variance

    def _write_ahead(self) -> None:
        if self.privacy_ledger is not None:
            self.privacy_ledger.append(noise_multiplier=self.dp_model.dp_config.noise_multiplier,
                                       sample_rate=self.sample_rate,
                                       max_grad_norm=self._max_grad_norm())

    def _take_count(self):
        state = self.dp_model.adaptive_clip
        return None if state is None or self._noised_in_graph else state.take_count()

    def _max_grad_norm(self):
        bound = self.dp_model.dp_config.max_grad_norm
        return dict(bound) if isinstance(bound, tuple) else bound

    def _account(self) -> None:
        if self.accountant is not None:
            self.accountant.step(noise_multiplier=self.dp_model.dp_config.noise_multiplier,
                                 sample_rate=self.sample_rate)

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self._open:
            raise ValueError("a logical batch is half accumulated (virtual batches); save after "
                             "its step()")
        return {"optimizer": self.original_optimizer.state_dict(),
                "accountant": self.accountant.state_dict() if self.accountant else None,
                "steps": self.steps,
                "generator": None if self._source.generator is None or
                self.dp_model.dp_config.seed is None else self._source.generator.get_state(),
                "generator_device": None if self._source.generator is None else
                self._source.generator.device.type,
                "adaptive_clip": None if self.dp_model.adaptive_clip is None else
                self.dp_model.adaptive_clip.state_dict(),
                # Note [The correlation state is secret] in loop/correlated.py
                "mechanism": None if self.mechanism is None else self.mechanism.state_dict(),
                "correlated": None if self._source.correlated is None else
                self._source.correlated.state_dict(),
                "noise_check": None if self._source.check is None else
                self._source.check.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._check_loadable(state)
        self.original_optimizer.load_state_dict(state["optimizer"])
        if self.accountant is not None:
            self.accountant.load_state_dict(state["accountant"])
        if self.privacy_ledger is not None:     # steps released after the checkpoint count
            reconcile(self.privacy_ledger, self.accountant, self._max_grad_norm())
        self._share_count()
        if self.dp_model.adaptive_clip is not None:
            self.dp_model.adaptive_clip.load_state_dict(state["adaptive_clip"])
        self.steps = int(state.get("steps", 0))
        if state.get("generator") is not None and self._source.generator is not None:
            self._source.generator.set_state(state["generator"])
        if self._source.correlated is not None:
            self._source.correlated.load_state_dict(state["correlated"],
                                                    device=self._noise_device())
        if self._source.check is not None:
            self._source.check.load_state_dict(state["noise_check"])

    def _share_count(self) -> None:
        """Under torch.distributed, every rank's accountant takes rank 0's, which the privacy
        ledger brought level: a rank that resumed from an older checkpoint than the ledger
        would otherwise count fewer steps than were released (Note [Write-ahead privacy ledger]
        in privacy/ledger.py). Each rank must pass ``ledger=`` alike (rank 0 keeps the file)."""
        if self.world <= 1 or not self._ledger_given or self.accountant is None:
            return
        state = [self.accountant.state_dict()]
        src = dist.get_globalrank_of(self.process_group, 0) if self.process_group is not None \
            else 0
        dist.broadcast_object_list(state, src=src, group=self.process_group)
        self.accountant.load_state_dict(state[0])

    def _check_loadable(self, state: dict) -> None:
        """Refuse a state, before anything is loaded, that would stop epsilon counting on."""
        if not isinstance(state, dict) or "optimizer" not in state:
            raise ValueError("state must come from DPOptimizer.state_dict()")
        if (state.get("adaptive_clip") is None) != (self.dp_model.adaptive_clip is None):
            raise ValueError("the checkpoint and this model disagree on clipping='adaptive'; "
                             "compile the model with the checkpoint's clipping to resume it")
        if (state.get("accountant") is None) != (self.accountant is None):
            raise ValueError("the checkpoint and this DPOptimizer disagree on having an "
                             "accountant; epsilon would not keep counting")
        kind = state.get("generator_device") or "cpu"   # states saved before it was recorded
        if state.get("generator") is not None and self._source.generator is not None and \
                kind != self._source.generator.device.type:
            raise ValueError(
                f"the checkpoint's noise generator ran on {kind} and this DPOptimizer's runs on "
                f"{self._source.generator.device.type}: its state cannot carry over, and seeding "
                f"again would repeat the noise of earlier steps. Resume on a {kind} device, or "
                f"compile without a seed (fresh noise from the OS).")
        if self.privacy_ledger is not None:
            saved = Accountant()
            saved.load_state_dict(state["accountant"])
            check_same_run(self.privacy_ledger, saved)
        check_resume(self.mechanism, state, holds_state=self._source.correlated is not None,
                     checked=self._source.check is not None, ledger=self.privacy_ledger)

    def _noise_device(self) -> torch.device:
        return self._named[0][1].device if self._named else torch.device("cpu")

