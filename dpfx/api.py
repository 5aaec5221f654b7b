"""``dpfx.compile``: the user's entry point, and the wrapper module it returns.

    dp_model = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.1)
    loss = F.cross_entropy(dp_model(x), y)
    loss.backward()        # every trainable p.grad is the DP-SGD gradient

"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import warnings
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from dpfx.capture import batch_branches, traceable
from dpfx.loop import fsdp
from dpfx.loop.fsdp import BlocksFallbackWarning
from dpfx import blocks as blocks_mod
from dpfx.backend import DPBackend
from dpfx.capture.entry import (BatchMarked, CaptureSettings, DynamoSettings, compile_entry,
                                default_stance, own_entry, steady_swaps)
from dpfx.capture.errors import (graph_break_error, input_shape_error, refusal_while_capturing,
                                 symbolic_batch_error)
from dpfx.config import DPConfig, check_loss, warn_fixed_seed
from dpfx import options
from dpfx.errors import CaptureError, DPFXError, OptionError, PrivacyError
from dpfx.loss.hf_labels import hf_labels_loss
from dpfx.loss.captured import TARGETS, captured, loss_entry
from dpfx.loss import track as loss_track
from dpfx.loss.track import TrackedTensor, check_inputs, track, untrack
from dpfx.capture.modules import check_modules, norm_layers
from dpfx.loss.gate import ReleaseGate
from dpfx.loop.release import BatchSizes, check_loop_inputs, warn_if_plain_trainer


class DPModule(torch.nn.Module):
    """A compiled private view of ``model``; it shares the model's parameters."""

    def __init__(self, model: torch.nn.Module, config: DPConfig, loss=None, blocks=None):
        super().__init__()
        self._orig_mod = model
        # the release state of this model has one owner (loss/gate.py)
        backend = DPBackend(model, config, ReleaseGate(warn_if_plain_trainer))
        object.__setattr__(self, "_dpfx_backend", backend)
        # Note [Sharded DP-SGD] in loop/fsdp.py: set by compile() for a model sharded with fully_shard
        object.__setattr__(self, "_sharding", None)
        # Note [Deciding a branch on the batch size] (capture/batch_branches.py): one compiled entry per
        # set of decisions; a model that never branches on the batch has one.
        object.__setattr__(self, "_dpfx_entries", [])
        object.__setattr__(self, "_dpfx_loss_entries", [])
        object.__setattr__(self, "_loss_fn", loss)
        object.__setattr__(self, "_blocks_pending", blocks)   # compiled at the first call
        # See Note [A sharded model gets blocks by default]: compile() sets it where it chose them
        object.__setattr__(self, "_blocks_chosen", False)
        object.__setattr__(self, "_blocks", [])
        # Note [Only dpfx's own forward calls a compiled block] (blocks/call.py)
        object.__setattr__(self, "_private_forward",
                           blocks_mod.PrivateForward(blocks_mod.new_owner()))
        # See Note [Every gradient a parameter receives is dpfx's]
        self._grad_guards: dict[str, Any] = {}
        weakref.finalize(self, _remove_hooks, self._grad_guards)
        self._trainable_at_compile = [(n, p, p.requires_grad) for n, p in model.named_parameters()]
        # See Note [The steady-state call]
        self._params = [p for _, p, _ in self._trainable_at_compile]
        self._trainable_flags = [trainable for _, _, trainable in self._trainable_at_compile]
        self._param_ids = {id(p) for p in self._params}
        self._norm_layers = norm_layers(model)
        self._all_guarded = False
        self._compiles_seen = 0
        # Note [Batch sizes far from expected_batch_size] in loop/release.py; with
        # noise="optimizer" a release is a logical step, whose size DPOptimizer observes
        self._batch_sizes = BatchSizes(config.expected_batch_size) if (
            config.loss_reduction == "mean" and config.expected_batch_size is not None
            and config.noise == "graph") else None
        object.__setattr__(self, "_entry_by_batch", {})
        # Note [The model passed to dpfx.compile] in loss/gate.py
        backend.gate.own((n, p) for n, p, trainable in self._trainable_at_compile if trainable)
        # Note [A parameter's hooks are one frame each] in loss/gate.py
        for name, p in model.named_parameters():
            if p.requires_grad:
                self._grad_guards["after_accumulate", name] = \
                    p.register_post_accumulate_grad_hook(functools.partial(
                        backend.gate.accumulated, name, config.noise))

    def _detach_from_model(self) -> None:
        """Take this module's gradient hooks off the model's parameters, for a module compiled
        again over the same model that replaces this one (``DPTrainer`` resuming with a new
        noise multiplier); this module must not be called afterwards."""
        _remove_hooks(self._grad_guards)

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

    # Note [The steady-state call]
    # Every training step pays for this method, and on a small model its Python is as long as
    # the compiled forward.
    # What does not change between steps is read once: the parameters, their ids for the loss
    # check, the normalization layers the mixing check looks at, which batch size routes to
    # which compiled entry, whether every trainable parameter has its gradient guard. Those
    # caches are read again after any capture (``_after_capture``: a module added after compile
    # makes dynamo capture again, where the graph's own verifier sees it first, and a trainable
    # parameter added or replaced is refused there, backend/inputs.py). What only a capture reads is
    # set up only when dynamo captures (Note [Settings only a capture reads] in capture/entry.py); the swaps
    # dynamo's guards check are a plain class with direct assignments, not a generator context
    # manager or config.patch. Everything that can differ per call (inputs
    # requiring grad, frozen parameters, a normalization layer switched to training, the
    # release hook, the output tracking) is still checked on every call.
    #
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
        out = self._run(args, kwargs, None)
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
        batch in dim 0. Call ``backward()`` on the result (or on a positive multiple of it)."""
        if self._loss_fn is None:
            raise ValueError("dp_model.loss(...) needs the loss function: dpfx.compile(model, "
                             "loss=fn, ...), fn(output, *targets) -> the loss")
        if isinstance(inputs, dict):
            args, kwargs = (), dict(inputs)
        elif isinstance(inputs, (tuple, list)):
            args, kwargs = tuple(inputs), {}
        else:
            args, kwargs = (inputs,), {}
        targets = list(targets)
        # in the order _run's own reading of (args, kwargs + the targets) gives them
        tensors = _tensor_leaves(args, kwargs) + _tensor_leaves(tuple(targets), {})
        if _check_batch(tensors):
            return self._run(args, kwargs, targets, tensors)
        return self._empty_loss(args, kwargs, targets)

    def _empty_loss(self, args: tuple, kwargs: dict, targets: list) -> torch.Tensor:
        """Note [An empty batch and the captured loss] in loss/captured.py."""
        out = untrack(self._run(args, kwargs, None))
        with torch.no_grad():
            value = self._loss_fn(out, *targets)
        leaves = [t for t in pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if not leaves:
            return value
        zero = sum(t.sum() * 0.0 for t in leaves)
        return captured(zero + (value.to(zero.dtype) - zero.detach()), self._dpfx_backend)

    def _run(self, args: tuple, kwargs: dict, targets: list | None,
             tensors: list[torch.Tensor] | None = None):
        """``tensors``: the tensor leaves of (args, kwargs, targets), where the caller has them."""
        if targets is not None:
            kwargs[TARGETS] = targets
        if tensors is None:
            tensors = _tensor_leaves(args, kwargs)
        if any(isinstance(t, TrackedTensor) for t in tensors):
            # a batch of dpfx's loader: checked, then handed to dynamo as plain tensors
            if torch.is_grad_enabled():
                check_inputs(tensors)
            args, kwargs = untrack((args, kwargs))
            tensors = _tensor_leaves(args, kwargs)
        elif loss_track._WRITTEN and torch.is_grad_enabled():
            check_inputs(tensors)
        batch = _check_batch(tensors)
        if not all(t.is_contiguous() for t in tensors):
            # See Note [Inputs enter row-major]
            args, kwargs = pytree.tree_map_only(torch.Tensor, _row_major, (args, kwargs))
            tensors = _tensor_leaves(args, kwargs)
        if batch == 0:
            # An empty slice such as x[:, :-1].contiguous() keeps its parent's strides (an empty
            # tensor counts as contiguous), which would fail dynamo's stride guard and recompile.
            # Empty inputs carry no data: hand dynamo fresh row-major ones.
            args, kwargs = pytree.tree_map_only(torch.Tensor, _row_major_empty, (args, kwargs))
            tensors = _tensor_leaves(args, kwargs)
        config = self.dp_config
        # one pass over the parameters, for both questions (Note [The steady-state call])
        flags = [p.requires_grad for p in self._params] if torch.is_grad_enabled() else None
        training = flags is not None and True in flags
        if training and batch == 0 and config.loss_reduction == "mean" \
                and config.expected_batch_size is None and config.noise == "graph":
            raise ValueError(
                "empty batch with loss_reduction='mean' and no expected_batch_size: the DP-SGD "
                "gradient would divide by 0. Pass expected_batch_size (Poisson sampling's q*N).")
        backend = self._dpfx_backend
        if training and backend.problems is None:
            check_modules(self._orig_mod, self._norm_layers)
            check_loop_inputs(self, tensors, flags)
        if self._blocks_pending is not None:    # Note [Per-block private graphs] in blocks/
            return self._run_with_new_blocks(args, kwargs, targets, tensors)
        real = batch    # Note [Padded rows contribute zero] in passes/clip_noise.py
        batch = config.bucket_for(real)
        if batch != real:
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, functools.partial(_padded, rows=batch), (args, kwargs))
            tensors = _tensor_leaves(args, kwargs)
        backend.gate.begin_forward()
        capturing = False
        entry = self._entry_for(batch, targets is not None)
        backend.decisions = entry.decisions
        capture = entry.capture
        capture.call = (tensors, batch, entry.decisions)
        # aot_autograd's runtime marks the inputs' dynamic dims on every call; a later plain
        # torch.compile of the caller's tensors must not see dpfx's batch dim there.
        propagated = [t.__dict__.get(_PROPAGATED) for t in tensors]
        sharding = self._sharding
        if sharding is not None:
            # Note [Sharded blocks] in loop/fsdp.py: a block's unit is gathered by its ops
            sharding.gather(blocks_empty=training and bool(self._blocks))
        try:
            stance = default_stance()
            # Note [Only the swaps the guards read, between captures] in capture/traceable.py
            with (entry.swaps if stance else traceable.ALL), self._private_forward, \
                    (sharding.hooks_off() if sharding is not None else _NOTHING):
                if stance:
                    out = entry.compiled(*args, **kwargs)
                else:   # Note [Settings only a capture reads] in capture/entry.py
                    with DynamoSettings(), BatchMarked(tensors), \
                            batch_branches.deciding(batch, entry.decisions):
                        out = entry.compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if isinstance(e.inner_exception, DPFXError):
                raise e.inner_exception.with_traceback(None) from None
            if isinstance(e.inner_exception, GuardOnDataDependentSymNode):
                raise symbolic_batch_error(e.inner_exception) from e
            raise
        except GuardOnDataDependentSymNode as e:
            raise symbolic_batch_error(e) from e
        except torch._dynamo.exc.UserError as e:
            if "data-dependent" in str(e):
                raise symbolic_batch_error(e) from e
            raise
        except torch._dynamo.exc.Unsupported as e:
            raise graph_break_error(e) from e
        except torch._dynamo.exc.TorchRuntimeError as e:
            refusal = refusal_while_capturing(e) or input_shape_error(
                self._orig_mod, args, {k: v for k, v in kwargs.items() if k != TARGETS}, e)
            if refusal is None:
                raise
            raise refusal from None
        finally:
            capture.call = None
            if capture.captures != entry.captures:      # dynamo captured in this call
                entry.captures = capture.captures
                entry.swaps = traceable.ALL             # until this call is seen to succeed
                capturing = True
            for t, mark in zip(tensors, propagated):
                if mark is None:
                    t.__dict__.pop(_PROPAGATED, None)
                else:
                    t.__dict__[_PROPAGATED] = mark
        if capturing:
            entry.swaps = steady_swaps(entry.fn, args, kwargs)
        if sharding is not None and not training:
            sharding.release()      # nothing will read the gathered parameters again
        if batch != real:
            out = pytree.tree_map_only(torch.Tensor, functools.partial(
                _real_rows, rows=batch, real=real), out)
        backend.gate.end_forward(training, real)
        if training and self._batch_sizes is not None:
            self._batch_sizes.observe(real)
        if backend.compiles != self._compiles_seen:
            self._after_capture()
        if training:
            if not self._all_guarded:
                self._guard_gradients()
            outputs = [out] if isinstance(out, torch.Tensor) else pytree.tree_leaves(out)
            release = backend.gate.track(outputs, tensors)
            if targets is not None:
                return captured(out, backend)     # Note [The loss inside the graph]
            # Note [The loss inside the proof] in loss/track.py
            out = track(out, backend, real, self._param_ids, tensors, release)
        return out

    def _run_with_new_blocks(self, args, kwargs, targets, tensors):
        """The first call with ``blocks=``: the blocks compiled and installed, then the call;
        if either fails, the model's blocks are put back as they were."""
        pending = self._blocks_pending
        plain = {k: v for k, v in kwargs.items() if k != TARGETS}
        sharding = self._sharding
        if sharding is None:
            installed = blocks_mod.prepare(self._orig_mod, pending, args, plain, self.dp_config,
                                           owner=self._private_forward.token)
        else:       # Note [Sharded blocks] in loop/fsdp.py
            sharding.gather()
            try:
                with sharding.hooks_off():
                    installed = blocks_mod.prepare(
                        self._orig_mod, pending, args, plain, self.dp_config,
                        places=lambda chosen: sharding.place_blocks(self._orig_mod, chosen),
                        owner=self._private_forward.token)
            except CaptureError as refused:
                sharding.places.clear()
                if not self._blocks_chosen:
                    raise
                # See Note [A sharded model gets blocks by default]
                warnings.warn(BlocksFallbackWarning(
                    f"dpfx: the model's fully_shard units could not be compiled as blocks "
                    f"({refused}); it trains as one private graph, which holds every parameter "
                    f"unsharded during the step (the memory of the whole model on each rank). "
                    f"Pass blocks=False to choose that and silence this warning."), stacklevel=4)
                object.__setattr__(self, "_blocks_pending", None)
                object.__setattr__(self, "_blocks_chosen", False)
                return self._run(args, kwargs,
                                 targets if targets is None else kwargs.pop(TARGETS), None)
            except BaseException:
                sharding.places.clear()
                raise
            self._dpfx_backend.released_elsewhere = {
                name for place in sharding.places.values() for name, _ in place.trainable}
        object.__setattr__(self, "_blocks_pending", None)
        object.__setattr__(self, "_blocks", installed)
        try:
            return self._run(args, kwargs, targets if targets is None else kwargs.pop(TARGETS),
                             None)
        except BaseException:
            for block in installed:
                blocks_mod.uninstall(block)
            object.__setattr__(self, "_blocks_pending", pending)
            object.__setattr__(self, "_blocks", [])
            if sharding is not None:
                sharding.places.clear()
                self._dpfx_backend.released_elsewhere = set()
            raise

    def _after_capture(self) -> None:
        """Note [The steady-state call]: what the steady state reads from caches is read again
        after every capture (a parameter or module added since compile makes dynamo capture)."""
        self._compiles_seen = self._dpfx_backend.compiles
        self._param_ids = {id(p) for p in self._orig_mod.parameters()}
        self._norm_layers = norm_layers(self._orig_mod)
        self._all_guarded = False

    def _entry_for(self, batch: int, with_loss: bool = False) -> "_Entry":
        """The compiled entry whose batch-size decisions hold at ``batch``, else a new one
        (``with_loss``: of the model with its loss, Note [The loss inside the graph])."""
        memo = self._entry_by_batch.get((batch, with_loss))
        if memo is not None and len(memo[0].decisions) == memo[1]:
            return memo[0]
        entries = self._dpfx_loss_entries if with_loss else self._dpfx_entries
        for entry in entries:
            if batch_branches.holds(entry.decisions, batch):
                # Valid while the entry's decisions stay as they are (a capture appends to them).
                self._entry_by_batch[batch, with_loss] = (entry, len(entry.decisions))
                return entry
        if len(entries) >= _MAX_ENTRIES:
            decided = "\n".join(f"    {d}" for e in entries for d in e.decisions)
            raise CaptureError(
                f"the model's code branches on the batch size in more ways than dpfx compiles "
                f"graphs for ({_MAX_ENTRIES}); batch size {batch} needs another. Decisions so "
                f"far:\n{decided}\nCompute those conditions from something other than the "
                f"batch size.")
        fn = loss_entry(self._orig_mod, self._loss_fn) if with_loss else \
            own_entry(self._orig_mod)
        compiled, capture = compile_entry(fn, self._dpfx_backend)
        entry = _Entry([], compiled, capture, fn)
        entries.append(entry)
        return entry

    # Note [Every gradient a parameter receives is dpfx's]
    # The graph proof covers the graph; what reaches p.grad is autograd's sum of every
    # contribution to the parameter's gradient in that backward. After the first training
    # forward, every trainable parameter gets a tensor hook, which autograd calls with that total
    # before accumulating it:
    # - a parameter the graph does not read (used by the loss or another module outside the
    #   compiled forward, or by code dynamo ran outside dpfx's graph) must get no gradient at all;
    # - in a backward that ran dpfx's graph, a parameter the graph reads must get exactly the
    #   tensor dpfx's backward produced for it (identity: one contribution is passed through
    #   unchanged; a second one, such as a regularizer on the weight written in the loss, makes
    #   autograd pass a fresh sum).
    # Either failure raises a PrivacyError before that gradient is accumulated. A backward that
    # never ran dpfx's graph (plain autograd on the raw model) runs as it would without dpfx; the
    # post-accumulate-grad hook marks what it accumulated as plain, which DPOptimizer.step()
    # refuses (Note [Only dpfx's gradients reach a private step] in loss/gate.py). A parameter the
    # model does not use is left alone.
    def _guard_gradients(self) -> None:
        backend = self._dpfx_backend
        if backend.graph_params is None:
            return
        for name, p in self._orig_mod.named_parameters():
            if p.requires_grad and name not in self._grad_guards:
                self._grad_guards[name] = p.register_hook(functools.partial(
                    backend.gate.check_gradient, name, weakref.ref(p)))
        # Parameters trainable at compile are all there is to guard: check_loop_inputs refuses
        # any later change of requires_grad, and a parameter added later makes dynamo capture
        # again (then the walk runs again: _after_capture).
        self._all_guarded = True


_PRIVATE_SETTINGS = {f.name for f in dataclasses.fields(DPConfig)} | set(options.KEYWORDS) \
    | {"dp_config"}


@dataclasses.dataclass
class _Entry:
    decisions: list          # batch_branches.Decision: the batch sizes this entry serves
    compiled: Any            # torch.compile of dpfx's own entry function
    capture: "CaptureSettings"   # dynamo's callback (capture/entry.py)
    fn: Any                  # the entry function (its code object is dynamo's cache key)
    swaps: traceable.Swaps = traceable.ALL   # what a steady-state call swaps
    captures: int = 0        # capture.captures when ``swaps`` was chosen


_MAX_ENTRIES = 8
_NOTHING = contextlib.nullcontext()
_PROPAGATED = "_dynamo_propagated_dynamic_indices"


def _remove_hooks(handles: dict) -> None:
    for handle in handles.values():
        handle.remove()


def _tensor_leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        return list(args)
    return [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


# Note [Inputs enter row-major]
# A graph captured on a contiguous batch and called later with a strided one (``ids[:, :-1]``, a
# window of ``unfold``) passed dynamo's guards (the stride is a symbol) and then failed
# Inductor's stride assertion with the unbacked batch (torch 2.13). dpfx's graphs only ever see
# row-major inputs: a strided one is copied (the same values; ``contiguous`` is differentiable
# for an input that requires grad), a contiguous one costs a flag read.
# (tests/capture/test_inputs.py::test_strided_input_after_a_contiguous_one)
def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


def _row_major_empty(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with copies of its row 0 appended up to ``rows`` rows (Note [Padded rows contribute
    zero] in passes/clip_noise.py: the copies keep the forward in the range of real rows; the
    graph's mask, not their values, makes them contribute nothing)."""
    return torch.cat([t, t[:1].expand(rows - t.shape[0], *t.shape[1:])])


def _real_rows(t: torch.Tensor, rows: int, real: int) -> torch.Tensor:
    """An output of a padded batch as the caller sees it: its first ``real`` rows (outputs carry
    the batch in dim 0; one without a batch dim of ``rows`` is left as it is)."""
    return t[:real] if t.dim() and t.shape[0] == rows else t


def _check_batch(tensors: list[torch.Tensor]) -> int:
    if not tensors:
        raise CaptureError("dpfx needs at least one tensor input with the batch in dim 0")
    for t in tensors:
        if t.dim() == 0:
            raise CaptureError("every tensor input needs the batch in dim 0; got a 0-d tensor")
    batch = tensors[0].shape[0]
    if any(t.shape[0] != batch for t in tensors):
        sizes = [tuple(t.shape) for t in tensors]
        raise ValueError(f"every tensor input needs the batch in dim 0 with the same size; got "
                         f"shapes {sizes}")
    return batch


def compile(model: torch.nn.Module, *, max_grad_norm: float | dict[str, float],
            noise_multiplier: float, loss_reduction: str = "mean",
            expected_batch_size: int | None = None, seed: int | None = None,
            backend: str = "inductor", strategy: str = "auto", noise: str | None = None,
            track_norms: bool = False, self_check: bool | str = True,
            allow_input_grads: bool = False, loss=None,
            clipping: str | options.Clipping | None = None, clipping_gamma: float | None = None,
            target_quantile: float | None = None, clip_lr: float | None = None,
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
    at ``max_grad_norm`` and follows the ``target_quantile`` of the per-sample norms, moved
    after every step by C_t * exp(-clip_lr * (b_t - target_quantile)) with b_t the fraction of
    unclipped examples, released with noise std ``count_noise_multiplier`` (sigma_b, required
    when sigma > 0 and > sigma / 2); the gradient's noise multiplier becomes
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
                                   target_quantile=target_quantile, clip_lr=clip_lr,
                                   count_noise_multiplier=count_noise_multiplier)
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
        dp_model = _module_class(model)(model, config, loss, blocks)
    finally:
        sharding.release()
    object.__setattr__(dp_model, "_sharding", sharding)
    object.__setattr__(dp_model, "_blocks_chosen", chosen)
    return dp_model


# Note [A sharded model gets blocks by default]
# One private graph holds every parameter unsharded for the whole step: on a model sharded with
# fully_shard the default one-graph path gathered the model at the first op and held it to the
# reduce-scatter, so a rank's step peak was the whole model (3x plain FSDP's on 8 Linear(2048^2)
# units), and sharding saved no memory. Each FSDP unit other than the root is therefore a block
# by default (Note [Sharded blocks] in loop/fsdp.py): its parameters are gathered by its own ops
# only and its clipped sums reduce-scattered as soon as the clip factor is known, which holds
# about one unit at a time, as plain FSDP does. The gradients are the same either way (both are
# checked against the reference on the union of the ranks' batches). A unit that blocks cannot
# take (a layer shared across depth, arguments whose structure follows the batch) falls back to
# the one graph with a BlocksFallbackWarning naming what it costs; blocks=False asks for the one
# graph, and an explicit blocks= that fails is an error, as everywhere.
# (tests/loop/test_fsdp.py::test_a_sharded_model_compiles_its_units_as_blocks_by_default)


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
