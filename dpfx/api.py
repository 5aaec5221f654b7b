"""``dpfx.compile``: the user's entry point, and the wrapper module it returns.

    dp_model = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.1)
    loss = F.cross_entropy(dp_model(x), y)
    loss.backward()        # every trainable p.grad is the DP-SGD gradient

``DPModule`` is the public surface: its forward and ``loss``, the release state it reports and
the settings it refuses to change. Its call runs through ``compiled_call.py``, its blocks are
installed by ``block_install.py`` and its parameters' gradients are checked by
``grad_guards.py``.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.utils._pytree as pytree

from dpfx.loop import fsdp
from dpfx import blocks as blocks_mod
from dpfx.backend import DPBackend
from dpfx.block_install import PendingBlocks
from dpfx.compiled_call import CompiledCall, check_batch, tensor_leaves
from dpfx.config import DPConfig, check_loss, warn_fixed_seed
from dpfx import options
from dpfx.errors import OptionError, PrivacyError
from dpfx.grad_guards import GradientGuards
from dpfx.loss.hf_labels import hf_labels_loss
from dpfx.loss.captured import captured
from dpfx.loss import track as loss_track
from dpfx.loss.track import untrack
from dpfx.loss.gate import ReleaseGate
from dpfx.loop.checks import warn_if_plain_trainer


class DPModule(torch.nn.Module):
    """A compiled private view of ``model``; it shares the model's parameters."""

    def __init__(self, model: torch.nn.Module, config: DPConfig, loss=None, blocks=None,
                 sharding=None, blocks_chosen: bool = False):
        """``sharding``: Note [Sharded DP-SGD] in loop/fsdp.py, for a model sharded with
        fully_shard; ``blocks_chosen``: compile() chose the blocks (See Note [A sharded model
        gets blocks by default])."""
        super().__init__()
        self._orig_mod = model
        # the release state of this model has one owner (loss/gate.py)
        backend = DPBackend(model, config, ReleaseGate(warn_if_plain_trainer))
        object.__setattr__(self, "_dpfx_backend", backend)
        trainable = [(n, p, p.requires_grad) for n, p in model.named_parameters()]
        # Note [The model passed to dpfx.compile] in loss/gate.py
        backend.gate.own((n, p) for n, p, requires_grad in trainable if requires_grad)
        # See Note [Every gradient a parameter receives is dpfx's] in grad_guards.py
        guards = GradientGuards(self, model, backend)
        object.__setattr__(self, "_guards", guards)
        object.__setattr__(self, "_call", CompiledCall(
            model, backend, loss, trainable, guards, PendingBlocks(blocks, blocks_chosen),
            sharding))

    def _detach_from_model(self) -> None:
        """Take this module's gradient hooks off the model's parameters, for a module compiled
        again over the same model that replaces this one (``DPTrainer`` resuming with a new
        noise multiplier); this module must not be called afterwards."""
        self._guards.remove()

    # what the loop (loop/optim.py, loop/grads.py) and the tests read of the call's state
    @property
    def _sharding(self):
        return self._call.sharding

    @property
    def _blocks(self) -> list:
        return self._call.blocks.installed

    @property
    def _blocks_pending(self):
        return self._call.blocks.pending

    @property
    def _private_forward(self):
        return self._call.private_forward

    @property
    def _dpfx_entries(self) -> list:
        return self._call.entries

    @property
    def _batch_sizes(self):
        return self._call.batch_sizes

    @property
    def norm_stats(self):
        """``dpfx.ops.norms.NormStats`` when compiled with ``track_norms=True``, else None."""
        return self._dpfx_backend.norm_stats

    @property
    def clipped_sums(self) -> dict[str, torch.Tensor]:
        """noise="optimizer": the clipped sums of the backward passes since the last step, per
        parameter (Note [Clipped sums stay out of p.grad] in loss/gate.py)."""
        return self._dpfx_backend.gate.clipped_sums

    @property
    def examples(self) -> int:
        """The examples whose clipped gradients are in ``clipped_sums``."""
        return self._dpfx_backend.gate.examples

    @property
    def releases(self) -> int:
        """Backward passes of dpfx's graph so far (Note [One release per accounted step] in
        loss/gate.py)."""
        return self._dpfx_backend.gate.releases

    def reset_clipped_sums(self) -> None:
        self._dpfx_backend.gate.reset_sums()
        if self._sharding is not None:
            self._sharding.reset()
        if self._dpfx_backend.adaptive_clip is not None:
            self._dpfx_backend.adaptive_clip.reset_count()

    @property
    def adaptive_clip(self):
        """clipping="adaptive": the ``dpfx.privacy.adaptive.AdaptiveClip`` that holds C_t
        (``.bound``; ``state_dict()`` for a checkpoint without a DPOptimizer); else None."""
        return self._dpfx_backend.adaptive_clip

    @property
    def dp_config(self) -> DPConfig:
        return self._dpfx_backend.config

    @property
    def compile_count(self) -> int:
        """Graphs handed to the inner compiler (a forward and a backward count two)."""
        return self._dpfx_backend.compiles

    def __setattr__(self, name: str, value) -> None:
        if name in _PRIVATE_SETTINGS:
            raise PrivacyError(
                f"'{name}' is a private setting, fixed when dpfx.compile built the graphs (which "
                f"clip and noise with it) and read by the optimizer and the accountant: setting "
                f"it afterwards would leave them disagreeing. Call dpfx.compile(model, "
                f"{name}=...) again (and build a new DPOptimizer).")
        super().__setattr__(name, value)

    # Note [torch.compile over a dpfx module]
    # The forward already runs dpfx's compiled graphs; dynamo tracing it from an outer
    # torch.compile (``torch.compile(dp_model)``, ``TrainingArguments(torch_compile=True)``)
    # would compile dpfx's own bookkeeping and call one compiled region from inside another.
    # ``torch._dynamo.disable`` makes the outer compile run it as it is (0.3 us a call): the
    # outer compile is a no-op over dpfx's module (tests/hf/test_trainer.py).
    @torch._dynamo.disable(reason="dpfx's module runs its own compiled graphs")
    def forward(self, *args, **kwargs):
        hf_loss = hf_labels_loss(self._orig_mod, kwargs)
        if hf_loss is not None:
            kwargs = hf_loss[0]
        out = self._call.run(args, kwargs, None)
        if hf_loss is not None and hf_loss[1] is not None:
            with loss_track.arranging():    # Note [A scale dpfx arranged] in loss/arranged.py
                out["loss"] = hf_loss[1](out)
        return out

    @torch._dynamo.disable(reason="dpfx's module runs its own compiled graphs")
    def loss(self, inputs, *targets) -> torch.Tensor:
        """``fn(model(inputs), *targets)`` for the ``fn`` given to ``dpfx.compile(model,
        loss=fn)``, as one compiled graph whose proof covers the loss (Note [The loss inside
        the graph] in loss/captured.py). ``inputs``: the model's input (a tensor), its positional
        inputs (a tuple or list), or its keyword inputs (a dict). Every target carries the
        batch in dim 0. Call ``backward()`` on the result (or on a nonzero multiple of it)."""
        if self._call.loss_fn is None:
            raise ValueError("dp_model.loss(...) needs the loss function: dpfx.compile(model, "
                             "loss=fn, ...), fn(output, *targets) -> the loss")
        if isinstance(inputs, dict):
            args, kwargs = (), dict(inputs)
        elif isinstance(inputs, (tuple, list)):
            args, kwargs = tuple(inputs), {}
        else:
            args, kwargs = (inputs,), {}
        targets = list(targets)
        # in the order the call's own reading of (args, kwargs + the targets) gives them
        tensors = tensor_leaves(args, kwargs) + tensor_leaves(tuple(targets), {})
        if check_batch(tensors):
            return self._call.run(args, kwargs, targets, tensors)
        return self._empty_loss(args, kwargs, targets)

    def _empty_loss(self, args: tuple, kwargs: dict, targets: list) -> torch.Tensor:
        """Note [An empty batch and the captured loss] in loss/captured.py."""
        out = untrack(self._call.run(args, kwargs, None))
        with torch.no_grad():
            value = self._call.loss_fn(out, *targets)
        leaves = [t for t in pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if not leaves:
            return value
        zero = sum(t.sum() * 0.0 for t in leaves)
        return captured(zero + (value.to(zero.dtype) - zero.detach()), self._dpfx_backend)


_PRIVATE_SETTINGS = {f.name for f in dataclasses.fields(DPConfig)} | set(options.KEYWORDS) \
    | {"dp_config"}


@options.renamed_keywords
def compile(model: torch.nn.Module, *, max_grad_norm: float | dict[str, float],
            noise_multiplier: float, loss_reduction: str = "mean",
            expected_batch_size: int | None = None, seed: int | None = None,
            backend: str = "inductor", strategy: str = "auto", noise: str | None = None,
            track_norms: bool = False, self_check: bool | str = True,
            allow_input_grads: bool = False, loss=None,
            clipping: str | options.Clipping | None = None, clipping_gamma: float | None = None,
            target_unclipped_quantile: float | None = None, clip_lr: float | None = None,
            count_noise_multiplier: float | None = None, blocks=None,
            batch_buckets=None) -> DPModule:
    """Compile ``model`` so that ``loss.backward()`` writes DP-SGD gradients into ``p.grad``.

    After ``loss.backward()`` on the mean (or, with loss_reduction="sum", the sum) over dim 0 of
    per-example losses, every trainable parameter gets
    ``p.grad = (sum_i clip_C(g_i)[p] + N(0, sigma^2 C^2)) / D`` with C = max_grad_norm,
    sigma = noise_multiplier, and D = expected_batch_size, else the batch size ("mean"), or 1
    ("sum"). The returned module shares ``model``'s parameters.

    ``strategy``: "materialize" builds per-sample gradients; "ghost" computes per-sample norms
    without them and the clipped sum as one weight-gradient product (where a rule has that form);
    "auto" picks per parameter by the rules' symbolic memory cost. All give the same gradients.

    ``max_grad_norm`` as a dict ``{name prefix: C}`` is per-layer clipping: each parameter is
    clipped with the group of its longest matching prefix ("" matches all), and the noise std is
    sigma * sqrt(sum C^2). ``clipping``: "flat" (one bound C; the default for a number),
    "per_layer" (the default for a dict), or "automatic": every example scaled by
    C / (||g|| + clipping_gamma) instead of clipped (Bu et al. 2022; with the number or the dict
    of bounds, per group), which bounds each example by C as well (Note [Clip functions] in
    config.py); or "adaptive" (Andrew et al. 2021): flat clipping to a bound C_t that starts
    at ``max_grad_norm`` and follows the ``target_unclipped_quantile`` of the per-sample
    norms, moved after every step by C_t * exp(-clip_lr * (b_t - target_unclipped_quantile))
    with b_t the fraction of unclipped examples, released with noise std
    ``count_noise_multiplier`` (sigma_b, required when sigma > 0 and > sigma / 2); the
    gradient's noise multiplier becomes
    (sigma^-2 - (2 sigma_b)^-2)^(-1/2), so the step costs what sigma costs (Note [Adaptive
    clipping] in privacy/adaptive.py; ``dp_model.adaptive_clip.bound`` is C_t). ``clipping``
    may be a ``dpfx.Clipping`` that holds these options (then none of the loose keywords);
    a keyword left None takes ``dpfx.Clipping``'s default (options.py).
    ``noise="optimizer"``: the backward leaves ``sum_i clip(g_i)`` in
    ``dp_model.clipped_sums`` (p.grad stays None) and ``dpfx.DPOptimizer`` adds the noise and
    divides once per optimizer step (virtual batches, secure noise, distributed training).
    The default ``noise`` is "graph", or "optimizer" when torch.distributed is initialized with
    more than one rank (the noise is then added once across ranks: Note [Noise once across
    ranks] in loop/optim.py). ``track_norms``: record per-sample norms in ``dp_model.norm_stats``
    (not private: see ops/norms.py). ``self_check``: before a compiled graph first trains, run it on
    synthetic batches against dpfx's verified graph and check that examples stay independent
    (Note [Checking what Inductor generated] in lower/selfcheck/); on by default for Inductor, and
    skipped for compiled code that has passed it before in Inductor's cache directory (Note [A
    self-check is not repeated on code it has passed]); ``"always"`` runs it even then.
    ``allow_input_grads``: accept inputs that require grad; their gradients are not private
    (refused by default). ``loss``: ``fn(output, *targets)``, captured and proven with the model
    and called as ``dp_model.loss(inputs, *targets)``, with no check per step (Note [The loss
    inside the graph] in loss/captured.py); ``dp_model(x)`` keeps working beside it. ``seed`` is
    for tests: it warns (``dpfx.FixedSeedWarning``). ``blocks``: "auto", or module classes or
    names (None or False: one graph): each repeated block (a decoder layer) becomes a private
    graph compiled once for all identical blocks and called as one op (docs/blocks.md); only
    the returned module's forward calls them. The model's graph clips every
    parameter with one factor as before. ``batch_buckets``: increasing batch sizes, such as
    (64, 128, 256): each batch of B examples runs padded to the smallest bucket >= B with rows
    that contribute exactly zero (masked in the graph and proven so), and the outputs come back
    with B rows, so that Poisson batches compile a few shapes only (for CUDA graphs); a batch
    larger than the last bucket is an error, an empty one runs unpadded (Note [Padded rows
    contribute zero] in passes/clip_noise.py). Not with ``loss=`` yet.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"dpfx.compile expects an nn.Module, got {type(model).__name__}")
    check_loss(loss)
    if loss is not None and batch_buckets is not None:
        raise OptionError(
            "batch_buckets is not supported with loss= yet: the loss inside the graph would "
            "average over the padded rows too. Compute the loss outside the model on the output "
            "(loss = fn(dp_model(x), y); loss.backward()), which dpfx returns with the batch's "
            "real rows only, or drop batch_buckets.")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "dpfx.compile got a DistributedDataParallel module. DDP all-reduces every gradient "
            "as it is produced, which would average per-rank noise and bypass dpfx's single "
            "noising; compile the bare module (ddp.module) instead and step with "
            "dpfx.DPOptimizer, which all-reduces the clipped sums once and adds the noise once.")
    if noise is None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1
        noise = "optimizer" if distributed or fsdp.units(model) else "graph"
    clip = options.clipping_option(clipping, clipping_gamma=clipping_gamma,
                                   target_unclipped_quantile=target_unclipped_quantile,
                                   clip_lr=clip_lr, count_noise_multiplier=count_noise_multiplier)
    config = DPConfig(max_grad_norm, noise_multiplier, loss_reduction, expected_batch_size, seed,
                      backend, strategy, noise, track_norms, self_check,
                      allow_input_grads=allow_input_grads, clip=clip,
                      batch_buckets=batch_buckets)
    warn_fixed_seed(seed)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters (requires_grad=True)")
    config.check_params([n for n, p in model.named_parameters() if p.requires_grad])
    units = fsdp.units(model)
    chosen = False
    if blocks is None and units:    # See Note [A sharded model gets blocks by default]
        blocks = [n for n, m in model.named_modules() if n and any(m is u for u in units)] or None
        chosen = blocks is not None
    if blocks is False:     # one graph, said explicitly
        blocks = None
    if blocks is not None:
        blocks_mod.select(model, blocks)    # a bad option fails here, before any call
    if not units:
        return _module_class(model)(model, config, loss, blocks)
    # Note [Sharded DP-SGD] in loop/fsdp.py: the module is built over FSDP's unsharded parameters
    # (the objects its graph and gradient guards bind to), then the units go back to shards.
    if config.noise != "optimizer":
        raise ValueError("a model sharded with fully_shard is noised shard by shard at the "
                         "optimizer's step: compile it with noise='optimizer' and step it with "
                         "dpfx.DPOptimizer")
    sharding = fsdp.Sharding(model, units)
    sharding.gather()
    try:
        return _module_class(model)(model, config, loss, blocks, sharding, chosen)
    finally:
        sharding.release()


# Note [A sharded model gets blocks by default]
# One private graph holds every parameter unsharded for the whole step: on a model sharded with
# fully_shard the default one-graph path gathered the model at the first op and held it to the
# reduce-scatter, so a rank's step peak was the whole model (3x plain FSDP's on 8 Linear(2048^2)
# units), and sharding saved no memory. Each FSDP unit other than the root is therefore a block
# by default (Note [Sharded blocks] in loop/fsdp.py): its parameters are gathered by its own ops
# only and its clipped sums reduce-scattered as soon as the clip factor is known, which holds
# about one unit at a time, as plain FSDP does. The gradients are the same either way (both are
# checked against the reference on the union of the ranks' batches). A unit that blocks cannot
# take (a layer shared across depth, arguments whose structure follows the batch, a block output
# without the batch that receives a gradient: T5's position bias) falls back to the one graph
# with a BlocksFallbackWarning naming what it costs; blocks=False asks for the one graph, and an
# explicit blocks= that fails is an error, as everywhere.
# (tests/loop/test_fsdp.py::test_a_sharded_model_compiles_its_units_as_blocks_by_default,
# test_units_blocks_cannot_take_fall_back_to_one_graph_with_a_warning)


# Note [The wrapped model's signature]
# Tools read a module's forward signature to decide what to pass it: Hugging Face's Trainer keeps
# only the dataset columns the forward names (with ``*args, **kwargs`` it keeps none, and the
# batch arrives empty), and finds the label columns from the class's forward. Each compiled
# module is therefore an instance of its own subclass of DPModule whose ``forward`` carries the
# wrapped model's signature (``inspect.signature`` reads ``__signature__``); the call itself is
# DPModule.forward. (tests/hf/test_trainer.py)
def _module_class(model: torch.nn.Module) -> type:
    # a PEFT model forwards ``*args, **kwargs`` to its base model, whose signature Trainer reads
    named = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        signature = inspect.signature(named.forward)
    except (TypeError, ValueError):
        return DPModule
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = list(signature.parameters.values())
    if params and params[0].kind is inspect.Parameter.POSITIONAL_ONLY:
        self_param = self_param.replace(kind=inspect.Parameter.POSITIONAL_ONLY)

    def forward(self, *args, **kwargs):
        return DPModule.forward(self, *args, **kwargs)

    forward.__signature__ = signature.replace(parameters=[self_param, *params])
    forward.__doc__ = DPModule.forward.__doc__
    return type(DPModule.__name__, (DPModule,), {
        "forward": forward, "__module__": DPModule.__module__,
        "__qualname__": DPModule.__qualname__, "__doc__": DPModule.__doc__})
