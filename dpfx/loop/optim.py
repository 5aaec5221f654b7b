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
import secrets

import torch
import torch.distributed as dist

from dpfx.backend import DPBackend
from dpfx.ops.noise import add_noise_keyed
from dpfx.errors import DPFXWarning, PrivacyError
from dpfx.privacy.ledger import PrivacyLedger, check_same_run, reconcile
from dpfx.loop.correlated import CorrelatedNoise, NoiseCheck, check_mechanism, check_resume
from dpfx.loop.noise import (add_gaussian_, gaussian, noise_generator, secure_gaussian,
                             secure_standard_normal)
from dpfx.privacy import Accountant, validate
from dpfx.loop.ranks import check_same_model, peer_error, rank_of, world_of
from dpfx.loop.release import BatchSizes
from dpfx.loss.gate import warn_at_caller

# Set once at construction: changing them later would make the noise, the divisor or the
# accountant disagree with the compiled model (Opacus users set optimizer.noise_multiplier).
_FIXED_SETTINGS = {"noise_multiplier", "max_grad_norm", "expected_batch_size", "loss_reduction",
                   "sample_rate", "secure_mode", "mechanism"}


class NoNoiseWarning(DPFXWarning):
    """A DPOptimizer with noise_multiplier=0: the steps are not private (epsilon is infinite)."""


class DPOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer: torch.optim.Optimizer, dp_model, *,
                 accountant: Accountant | None = None, sample_rate: float | None = None,
                 secure_mode: bool = False, process_group=None, ledger=None, mechanism=None,
                 check_noise_every: int | None = None):
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
        sample_rate = sample_rate if sample_rate is None else validate.sample_rate(sample_rate)
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
        self.world = world_of(process_group)
        if self.world > 1 and config.noise != "optimizer":
            raise ValueError("distributed training adds the noise once across ranks, at step(): "
                             "compile the model with dpfx.compile(..., noise='optimizer')")
        if self.world > 1 and config.loss_reduction == "mean" \
                and config.expected_batch_size is None:
            raise ValueError("distributed training needs expected_batch_size (the global "
                             "expected batch size q*N) to divide by")
        sharding = dp_model._sharding
        if sharding is not None:
            # Note [Sharded DP-SGD] in loop/fsdp.py: the optimizer holds the shards
            sharding.release()
            if self.world != sharding.world:
                raise ValueError(
                    f"the process group has {self.world} ranks and the model is sharded over "
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
        elif self.world > 1:
            check_same_model(dp_model._orig_mod, process_group)
        if dp_model.clipped_sums:
            raise ValueError("dp_model holds clipped sums of backward passes run before this "
                             "DPOptimizer existed; call dp_model.reset_clipped_sums() first, or "
                             "they would be stepped as part of its first step")
        self.original_optimizer = optimizer
        self.dp_model = dp_model
        self.accountant = accountant
        self.sample_rate = sample_rate
        self.secure_mode = secure_mode
        self.process_group = process_group
        self.mechanism = mechanism
        self.steps = 0
        self.noise_variance = None      # of each coordinate of the last step's p.grad
        self._divisor = None
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
        self._privatize = (lambda count: count) if self._noised_in_graph else \
            self._write_private_grads if sharding is None else self._write_sharded_grads
        self._skip_next = False
        self._open = False          # a logical step has started but not been taken
        self._named = [(n, p) for n, p in dp_model._orig_mod.named_parameters()
                       if p.requires_grad]
        self._generator = None
        if config.noise == "optimizer" and not secure_mode:
            seed = secrets.randbits(62) if config.seed is None else config.seed
            if sharding is not None and config.seed is not None:
                seed = sharding.seed(seed)
            device = self._named[0][1].device if self._named else torch.device("cpu")
            self._generator = noise_generator(device).manual_seed(seed)
        # See Note [Correlated noise where it is drawn]
        self._correlated = self._check = None
        if mechanism is not None and (sharding is not None or self.world <= 1
                                      or rank_of(process_group) == 0):
            recursion = mechanism.recursion()
            self._correlated = CorrelatedNoise(recursion, mechanism.steps, name=mechanism.name)
            if check_noise_every is not None:
                self._check = NoiseCheck(recursion, name=mechanism.name,
                                         window=self._correlated.window, every=check_noise_every)
        self._optimizer_step_pre_hooks = collections.OrderedDict()
        self._optimizer_step_post_hooks = collections.OrderedDict()
        self._gate = dp_model._dpfx_backend.gate
        # Note [One release per accounted step] in loss/gate.py: from now on a second backward
        # before step() is refused
        self._gate.attach(self, config.noise)
        # Note [Batch sizes far from expected_batch_size] in loop/release.py: with
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
        self._check_strategy_left()
        # Note [Only dpfx's gradients reach a private step] in loss/gate.py
        self._gate.ledger.check(self._named)
        self._write_ahead()     # Note [Write-ahead privacy ledger] in privacy/ledger.py
        examples, count = self.dp_model.examples, self._take_count()
        if self._batch_sizes is not None:
            self._batch_sizes.observe(examples)
        std, self._divisor = self._noise_std(), None   # of the bound this step clips to
        count = self._privatize(count)      # several ranks: the count goes with the sums
        self._adapt(count, examples)
        self._gate.close_step()
        self._set_noise_variance(std, examples)
        self.original_optimizer.step()
        self._gate.ledger.stepped()     # Note [Gradients kept across steps] in loss/gate.py
        self._open = False
        self.steps += 1
        self._account()
        return loss

    def _check_strategy_left(self) -> None:
        """A correlated-noise strategy for n steps releases n steps, refused before the ledger
        records step n + 1 (every rank refuses alike: they count the same steps)."""
        if self.mechanism is not None and self.steps >= self.mechanism.steps:
            raise PrivacyError(
                f"the '{self.mechanism.name}' strategy was built for {self.mechanism.steps} "
                f"steps and this is step {self.steps + 1}: its noise and its accounting end "
                f"there, and nothing was released. Build the strategy for the run's full number "
                f"of steps (its steps=), or start a new run with a new strategy and count both "
                f"runs' epsilon together")
        if self.mechanism is not None and self.privacy_ledger is not None and \
                self.privacy_ledger.steps != self.steps:
            raise PrivacyError(
                f"the privacy ledger records {self.privacy_ledger.steps} releases and this "
                f"optimizer is at step {self.steps} of the '{self.mechanism.name}' strategy: "
                f"release t of the strategy must be the ledger's record t + 1. Load the run's "
                f"checkpoint (dpfx.load_checkpoint) before stepping, or give a new run a new "
                f"ledger path")
        if self._correlated is not None and self._correlated.t != self.steps:
            raise PrivacyError(
                f"the correlated noise state of the '{self.mechanism.name}' strategy is at step "
                f"{self._correlated.t} and the optimizer at step {self.steps}: a release's noise "
                f"was drawn without its step being taken (an error inside step()). Resume from "
                f"the last checkpoint")

    def _set_noise_variance(self, std: float, examples: int) -> None:
        """The variance of each coordinate of the noise in this step's p.grad: (sigma S / D)^2,
        times Var(w_t) under a correlated-noise strategy; given to an inner optimizer that
        reads ``dp_noise_variance`` (a bias-corrected Adam) before it steps."""
        divisor = self._divisor
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

    def _adapt(self, count, examples: int) -> None:
        """noise="optimizer" under adaptive clipping: the logical batch's count of unclipped
        examples noised once, N(0, sigma_b^2), and the bound moved (Note [Adaptive clipping] in
        privacy/adaptive.py). After the gradient's release, which used the step's C_t."""
        if count is None:
            return
        state = self.dp_model.adaptive_clip
        count = count.detach().to(torch.float32).reshape(1).clone()
        self._add_noise(count, state.count_noise_multiplier)
        config = self.dp_model.dp_config
        state.released(float(count), config.expected_batch_size or examples)

    def _noise_std(self) -> float:
        """The gradient's noise std: sigma * S, or sigma_grad * C_t under adaptive clipping."""
        config = self.dp_model.dp_config
        state = self.dp_model.adaptive_clip
        if state is None:
            return config.noise_std
        return config.grad_noise_multiplier * state.bound

    def _max_grad_norm(self):
        bound = self.dp_model.dp_config.max_grad_norm
        return dict(bound) if isinstance(bound, tuple) else bound

    def _account(self) -> None:
        if self.accountant is not None:
            self.accountant.step(noise_multiplier=self.dp_model.dp_config.noise_multiplier,
                                 sample_rate=self.sample_rate)

    def _write_private_grads(self, count=None):
        """The noised, divided clipped sums into p.grad. Returns the adaptive count still to be
        noised (one process), or None when it went with the sums (several ranks)."""
        model, config = self.dp_model, self.dp_model.dp_config
        sums = model.clipped_sums
        if not self._named:
            return count
        if self.world <= 1 and self.mechanism is None and self._write_in_place(sums, config):
            model.reset_clipped_sums()
            return count
        device = self._named[0][1].device
        examples = model.examples
        # Several ranks: the example count (and under adaptive clipping the count of unclipped
        # examples, noised on rank 0) travel in the same buffer, one collective.
        tail = []
        if self.world > 1:
            tail = self._counts_to_send(count, examples, device)
        both = torch.cat([
            (sums[n] if n in sums else torch.zeros_like(p)).reshape(-1).to(torch.float32)
            for n, p in self._named] + tail)
        flat = both[:both.numel() - sum(t.numel() for t in tail)]
        if self.world <= 1 or rank_of(self.process_group) == 0:
            self._add_release_noise(flat, self._noise_std())
        if self.world > 1:
            try:
                dist.all_reduce(both, op=dist.ReduceOp.SUM, group=self.process_group)
            except RuntimeError as e:
                raise peer_error(self.steps, self.process_group, e) from e
            examples = int(both[-1].item())
            self._counts_received(both[-2] if len(tail) == 2 else None, examples)
            count = None
        flat /= self._denominator(examples)
        offset = 0
        for name, p in self._named:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).to(p.dtype).clone()
            self._gate.ledger.released(name, p)     # the inner step's pre-hooks may edit it
            offset += n
        model.reset_clipped_sums()
        return count

    # Note [Adaptive clipping over several ranks]
    # The count of unclipped examples is a sum over the global batch like the clipped sums: each
    # rank's raw centered count travels in the sums' collective, rank 0 adding the count's noise
    # N(0, sigma_b^2) once to its own (the same draw in every row of a reduce-scatter, so that
    # every rank receives the same noised total), and every rank moves the bound from that total
    # after the gradient's release: the ranks' bounds stay equal, and the count is noised once.
    # The gradient's noise is sigma_grad C_t, of the bound the step clipped to: the sharded step
    # receives the count with its sums, so it reads the std before the bound moves (noised at
    # C_{t+1}, a shrinking bound would leave the sums under-noised; tests/loop/test_noise_ranks.py).
    def _counts_to_send(self, count, examples: int, device) -> list:
        tail = []
        if self.dp_model.adaptive_clip is not None and not self._noised_in_graph:
            mine = torch.zeros(1, dtype=torch.float32, device=device) if count is None else \
                count.detach().to(device=device, dtype=torch.float32).reshape(1).clone()
            if rank_of(self.process_group) == 0:
                self._add_noise(mine, self.dp_model.adaptive_clip.count_noise_multiplier)
            tail.append(mine)
        tail.append(torch.tensor([float(examples)], device=device))
        return tail

    def _counts_received(self, noised_count, examples: int) -> None:
        if noised_count is not None:
            config = self.dp_model.dp_config
            self.dp_model.adaptive_clip.released(float(noised_count),
                                                 config.expected_batch_size or examples)

    # Note [The optimizer's noise added where the sums lie]
    # In one process on the CPU, each clipped sum is noised and divided in place by one call of
    # the noise kernel (one key, stream t for the t-th parameter, as the graph's release) and
    # becomes p.grad: no flat copy of the model's gradients, no second copy per parameter. HF
    # GPT-2 small (124M), B = 4, on a 2-core AMD EPYC: 4.86 s a step with the flat buffer and a
    # buffer of normals, 3.69 s with the normals added to the flat buffer in place, 3.40 s so,
    # level with the graph's noise (benchmarks/latest/optimizer_noise.md). Several ranks (one
    # collective over the flat buffer), sums that share storage, 16-bit sums, secure_mode and
    # GPUs keep the flat buffer.
    def _write_in_place(self, sums: dict, config) -> bool:
        if self.secure_mode or self._generator is None or self._generator.device.type != "cpu":
            return False
        tensors = []
        for n, p in self._named:
            t = sums.get(n)
            if t is None:
                t = torch.zeros(p.shape, dtype=torch.float32)
            if t.dtype != torch.float32 or t.device.type != "cpu" or p.device.type != "cpu" \
                    or p.dtype != torch.float32:
                return False
            tensors.append(t)
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        if len(storages) != len(tensors):
            return False
        divisor = self._denominator(self.dp_model.examples)    # may refuse: nothing changed yet
        std = self._noise_std()
        if std:
            add_noise_keyed(tensors, std, 1.0, divisor, self._generator)
        else:
            for t in tensors:
                t.div_(divisor)
        for (name, p), t in zip(self._named, tensors):
            p.grad = t
            self._gate.ledger.released(name, p)     # the inner step's pre-hooks may edit it
        return True

    def _write_sharded_grads(self, count=None):
        """Note [Sharded DP-SGD] in loop/fsdp.py: one reduce-scatter of the clipped sums; this rank
        noises and writes the coordinates it owns. The adaptive count goes with them (Note
        [Adaptive clipping over several ranks])."""
        model, sharding = self.dp_model, self.dp_model._sharding
        sharding.release()
        if not self._named:
            return count
        device = self._named[0][1].device
        std = self._noise_std()     # of C_t, the bound this step clipped to, before it moves
        tail = self._counts_to_send(count, model.examples, device)
        try:
            mine, counts = sharding.reduce_scatter(model.clipped_sums, torch.cat(tail), device)
        except RuntimeError as e:
            raise peer_error(self.steps, sharding.group, e) from e
        examples = int(round(float(counts[-1])))
        self._counts_received(counts[0] if len(tail) == 2 else None, examples)
        divisor = self._denominator(examples)
        if self.mechanism is not None:       # one state over this rank's coordinates
            flat = torch.cat([mine[name] for name in sharding.names])
            self._add_release_noise(flat, std)
            for name, part in zip(sharding.names, flat.split(
                    [mine[name].numel() for name in sharding.names])):
                mine[name] = part
        for name in sharding.names:          # this rank's coordinates, in one order on every rank
            if self.mechanism is None:
                self._add_noise(mine[name], std)
            mine[name] /= divisor
        sharding.write_grads(mine, self._gate.ledger)
        model.reset_clipped_sums()
        return None

    # Note [Correlated noise where it is drawn]
    # With a correlated-noise strategy (``mechanism=``) step t adds std * w_t, w_t = (C^{-1} z)_t,
    # to the clipped sum (loop/correlated.py), z_t drawn from the same sources as the Gaussian
    # noise (the generator's Philox stream, or secure_mode's CSPRNG). The state lives where the
    # noise is drawn: on rank 0 under replicated ranks (Note [Noise once across ranks]), so the
    # other ranks hold none; on every rank under sharding, over the coordinates the rank owns
    # (its padded shards end to end, Note [Sharded DP-SGD] in loop/fsdp.py), so it is sharded
    # like the gradients and each coordinate's noise sequence is drawn and correlated once.
    # The flat buffer is used (not the in-place kernel) since w_t is needed as a vector.
    def _add_release_noise(self, flat: torch.Tensor, std: float) -> None:
        if self.mechanism is None:
            self._add_noise(flat, std)
            return
        t = self._correlated.t
        z = secure_standard_normal(flat.numel()).to(flat.device) if self.secure_mode else \
            gaussian(flat.numel(), 1.0, self._generator, device=flat.device)
        if self._check is not None:
            self._check.before(t, z, flat)
        w = self._correlated.step(z)
        if std:
            flat.add_(w.to(flat.dtype), alpha=std)
        if self._check is not None:
            self._check.after(t, flat, std)

    def _add_noise(self, flat: torch.Tensor, std: float) -> None:
        if std == 0:
            return
        if self.secure_mode:
            flat += secure_gaussian(flat.numel(), std, device=flat.device)
        else:
            add_gaussian_(flat, std, self._generator)

    def _denominator(self, examples: int) -> float:
        self._divisor = self._divide_by(examples)
        return self._divisor

    def _divide_by(self, examples: int) -> float:
        config = self.dp_model.dp_config
        if config.loss_reduction == "sum":
            return 1.0
        if config.expected_batch_size is not None:
            return float(config.expected_batch_size)
        if examples == 0:
            raise ValueError("empty logical batch with loss_reduction='mean' and no "
                             "expected_batch_size: DP-SGD would divide by 0. Pass "
                             "expected_batch_size to dpfx.compile (Poisson sampling's q*N)")
        return float(examples)

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self._open:
            raise ValueError("a logical batch is half accumulated (virtual batches); save after "
                             "its step()")
        return {"optimizer": self.original_optimizer.state_dict(),
                "accountant": self.accountant.state_dict() if self.accountant else None,
                "steps": self.steps,
                "generator": None if self._generator is None or
                self.dp_model.dp_config.seed is None else self._generator.get_state(),
                "generator_device": None if self._generator is None else
                self._generator.device.type,
                "adaptive_clip": None if self.dp_model.adaptive_clip is None else
                self.dp_model.adaptive_clip.state_dict(),
                # Note [The correlation state is secret] in loop/correlated.py
                "mechanism": None if self.mechanism is None else self.mechanism.state_dict(),
                "correlated": None if self._correlated is None else
                self._correlated.state_dict(),
                "noise_check": None if self._check is None else self._check.state_dict()}

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
        if state.get("generator") is not None and self._generator is not None:
            self._generator.set_state(state["generator"])
        if self._correlated is not None:
            self._correlated.load_state_dict(state["correlated"], device=self._noise_device())
        if self._check is not None:
            self._check.load_state_dict(state["noise_check"])

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
        if state.get("generator") is not None and self._generator is not None and \
                kind != self._generator.device.type:
            raise ValueError(
                f"the checkpoint's noise generator ran on {kind} and this DPOptimizer's runs on "
                f"{self._generator.device.type}: its state cannot carry over, and seeding again "
                f"would repeat the noise of earlier steps. Resume on a {kind} device, or "
                f"compile without a seed (fresh noise from the OS).")
        if self.privacy_ledger is not None:
            saved = Accountant()
            saved.load_state_dict(state["accountant"])
            check_same_run(self.privacy_ledger, saved)
        check_resume(self.mechanism, state, holds_state=self._correlated is not None,
                     checked=self._check is not None, ledger=self.privacy_ledger)

    def _noise_device(self) -> torch.device:
        return self._named[0][1].device if self._named else torch.device("cpu")

