"""The compiled call: one call of a compiled module through dpfx's compiled entries.

    call = CompiledCall(model, backend, loss_fn, trainable, guards, PendingBlocks(None), None)
    out = call.run((x,), {}, None)    # what dp_model(x) returns
    loss = call.run((x,), {}, [y])    # dp_model.loss(x, y): the model with its captured loss

Each call checks its inputs (one batch in dim 0, row-major, no input requiring grad), picks the
compiled entry whose batch-size decisions hold at its batch (Note [Deciding a branch on the
batch size] in capture/batch_branches.py), pads the batch to its bucket and cuts the outputs
back (Note [Padded rows contribute zero] in passes/clip_noise.py), turns dynamo's errors into
dpfx's, and hands the outputs to the release gate and the loss tracking.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from dpfx import blocks as blocks_mod
from dpfx.block_install import PendingBlocks
from dpfx.capture import batch_branches, swaps as capture_swaps
from dpfx.capture.entry import (BatchMarked, CaptureSettings, DynamoSettings, compile_entry,
                                default_stance, own_entry, steady_swaps)
from dpfx.capture.errors import (graph_break_error, input_shape_error, refusal_while_capturing,
                                 symbolic_batch_error)
from dpfx.capture.modules import check_modules, norm_layers
from dpfx.errors import CaptureError, DPFXError
from dpfx.grad_guards import GradientGuards
from dpfx.loop.checks import BatchSizes, check_loop_inputs
from dpfx.loss.captured import TARGETS, captured, loss_entry
from dpfx.loss.trace import WRITTEN
from dpfx.loss.track import TrackedTensor, check_inputs, is_model_output, track, untrack


class CompiledCall:
    """The call path of one compiled module: its compiled entries, the caches the steady state
    reads (Note [The steady-state call]) and its blocks until the first call installs them."""

    def __init__(self, model: torch.nn.Module, backend, loss_fn, trainable_at_compile: list,
                 guards: GradientGuards, blocks: PendingBlocks, sharding):
        self.model = model
        self.backend = backend
        self.loss_fn = loss_fn
        # (name, parameter, requires_grad) at compile: check_loop_inputs refuses any change
        self.trainable_at_compile = trainable_at_compile
        self.trainable_flags = [trainable for _, _, trainable in trainable_at_compile]
        self.guards = guards
        self.blocks = blocks    # Note [Per-block private graphs] in blocks/
        # Note [Sharded DP-SGD] in loop/fsdp.py: for a model sharded with fully_shard
        self.sharding = sharding
        # Note [Only dpfx's own forward calls a compiled block] (blocks/call.py)
        self.private_forward = blocks_mod.PrivateForward(blocks_mod.new_owner())
        # Note [Deciding a branch on the batch size] (capture/batch_branches.py): one compiled
        # entry per set of decisions; a model that never branches on the batch has one.
        self.entries: list[_Entry] = []
        self.loss_entries: list[_Entry] = []
        self._entry_by_batch: dict = {}
        # See Note [The steady-state call]
        self.params = [p for _, p, _ in trainable_at_compile]
        self.param_ids = {id(p) for p in self.params}
        self.norm_layers = norm_layers(model)
        self.compiles_seen = 0
        # Note [Batch sizes far from expected_batch_size] in loop/checks.py; with
        # noise="optimizer" a release is a logical step, whose size DPOptimizer observes
        config = backend.config
        self.batch_sizes = BatchSizes(config.expected_batch_size) if (
            config.loss_reduction == "mean" and config.expected_batch_size is not None
            and config.noise == "graph") else None

    # Note [The steady-state call]
    # Every training step pays for this method, and on a small model its Python is as long as
    # the compiled forward.
    # What does not change between steps is read once: the parameters, their ids for the loss
    # check, the normalization layers the mixing check looks at, which batch size routes to
    # which compiled entry, whether every trainable parameter has its gradient guard. Those
    # caches are read again after any capture (``_after_capture``: a module added after compile
    # makes dynamo capture again, where the graph's own verifier sees it first, and a trainable
    # parameter added or replaced is refused there, backend/inputs.py). What only a capture
    # reads is set up only when dynamo captures (Note [Settings only a capture reads] in
    # capture/entry.py); the swaps dynamo's guards check are a plain class with direct
    # assignments, not a generator context manager or config.patch. Everything that can differ
    # per call (inputs requiring grad, frozen parameters, a normalization layer switched to
    # training, the release hook, the output tracking) is still checked on every call.
    def run(self, args: tuple, kwargs: dict, targets: list | None,
            tensors: list[torch.Tensor] | None = None):
        """``tensors``: the tensor leaves of (args, kwargs, targets), where the caller has them."""
        if targets is not None:
            kwargs[TARGETS] = targets
        if tensors is None:
            tensors = tensor_leaves(args, kwargs)
        if any(isinstance(t, TrackedTensor) for t in tensors):
            # a batch of dpfx's loader: checked, then handed to dynamo as plain tensors
            if torch.is_grad_enabled():
                check_inputs(tensors)
            args, kwargs = untrack((args, kwargs))
            tensors = tensor_leaves(args, kwargs)
        elif WRITTEN and torch.is_grad_enabled():
            check_inputs(tensors)
        batch = check_batch(tensors)
        if not all(map(_CONTIGUOUS, tensors)):
            # See Note [Inputs enter row-major]
            args, kwargs = pytree.tree_map_only(torch.Tensor, _row_major, (args, kwargs))
            tensors = tensor_leaves(args, kwargs)
        if batch == 0:
            # An empty slice such as x[:, :-1].contiguous() keeps its parent's strides (an empty
            # tensor counts as contiguous), which would fail dynamo's stride guard and recompile.
            # Empty inputs carry no data: hand dynamo fresh row-major ones.
            args, kwargs = pytree.tree_map_only(torch.Tensor, _row_major_empty, (args, kwargs))
            tensors = tensor_leaves(args, kwargs)
        backend = self.backend
        config = backend.config
        # one pass over the parameters, for both questions (Note [The steady-state call])
        flags = list(map(_REQUIRES_GRAD, self.params)) if torch.is_grad_enabled() else None
        training = flags is not None and True in flags
        if training and batch == 0 and config.loss_reduction == "mean" \
                and config.expected_batch_size is None and config.noise == "graph":
            raise ValueError(
                "empty batch with loss_reduction='mean' and no expected_batch_size: the DP-SGD "
                "gradient would divide by 0. Pass expected_batch_size (Poisson sampling's q*N).")
        if training and backend.problems is None:
            check_modules(self.model, self.norm_layers)
            check_loop_inputs(config, self.trainable_at_compile, tensors,
                              flags == self.trainable_flags)
        if self.blocks.pending is not None:    # Note [Per-block private graphs] in blocks/
            return self.blocks.install_and_run(self, args, kwargs, targets)
        real = batch    # Note [Padded rows contribute zero] in passes/clip_noise.py
        batch = config.bucket_for(real)
        if batch != real:
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, functools.partial(_padded, rows=batch), (args, kwargs))
            tensors = tensor_leaves(args, kwargs)
        backend.gate.begin_forward()
        capturing = False
        entry = self._entry_for(batch, targets is not None)
        backend.decisions = entry.decisions
        capture = entry.capture
        capture.call = (tensors, batch, entry.decisions)
        # aot_autograd's runtime marks the inputs' dynamic dims on every call; a later plain
        # torch.compile of the caller's tensors must not see dpfx's batch dim there.
        propagated = [t.__dict__.get(_PROPAGATED) for t in tensors]
        sharding = self.sharding
        if sharding is not None:
            # Note [Sharded blocks] in loop/fsdp.py: a block's unit is gathered by its ops
            sharding.gather(blocks_empty=training and bool(self.blocks.installed))
        try:
            stance = default_stance()
            # Note [Only the swaps the guards read, between captures] in capture/swaps.py
            with (entry.swaps if stance else capture_swaps.ALL), self.private_forward, \
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
                self.model, args, {k: v for k, v in kwargs.items() if k != TARGETS}, e)
            if refusal is None:
                raise
            raise refusal from None
        finally:
            capture.call = None
            if capture.captures != entry.captures:      # dynamo captured in this call
                entry.captures = capture.captures
                entry.swaps = capture_swaps.ALL             # until this call is seen to succeed
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
        if training and self.batch_sizes is not None:
            self.batch_sizes.observe(real)
        if backend.compiles != self.compiles_seen:
            self._after_capture()
        if training:
            outputs = output_leaves(out)
            release = backend.gate.track(outputs, tensors)
            if targets is not None:
                return captured(out, backend)     # Note [The loss inside the graph]
            # Note [The loss inside the proof] in loss/track.py
            out = track(out, backend, real, self.param_ids, tensors, release)
        return out

    def _after_capture(self) -> None:
        """Note [The steady-state call]: what the steady state reads from caches is read again
        after every capture (a parameter or module added since compile makes dynamo capture)."""
        self.compiles_seen = self.backend.compiles
        self.param_ids = {id(p) for p in self.model.parameters()}
        self.norm_layers = norm_layers(self.model)

    def _entry_for(self, batch: int, with_loss: bool = False) -> "_Entry":
        """The compiled entry whose batch-size decisions hold at ``batch``, else a new one
        (``with_loss``: of the model with its loss, Note [The loss inside the graph])."""
        memo = self._entry_by_batch.get((batch, with_loss))
        if memo is not None and len(memo[0].decisions) == memo[1]:
            return memo[0]
        entries = self.loss_entries if with_loss else self.entries
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
        fn = loss_entry(self.model, self.loss_fn) if with_loss else own_entry(self.model)
        compiled, capture = compile_entry(fn, self.backend)
        entry = _Entry([], compiled, capture, fn)
        entries.append(entry)
        return entry


@dataclasses.dataclass
class _Entry:
    decisions: list          # batch_branches.Decision: the batch sizes this entry serves
    compiled: Any            # torch.compile of dpfx's own entry function
    capture: "CaptureSettings"   # dynamo's callback (capture/entry.py)
    fn: Any                  # the entry function (its code object is dynamo's cache key)
    swaps: capture_swaps.Swaps = capture_swaps.ALL   # what a steady-state call swaps
    captures: int = 0        # capture.captures when ``swaps`` was chosen


_MAX_ENTRIES = 8
_NOTHING = contextlib.nullcontext()
_PROPAGATED = "_dynamo_propagated_dynamic_indices"


def tensor_leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a call's arguments, in pytree's order. Tensors given directly as
    positional or keyword arguments (the common call) are read without pytree's walk."""
    leaves = [*args, *kwargs.values()]
    if all(type(a) in _PLAIN_LEAVES or isinstance(a, torch.Tensor) for a in leaves):
        return [t for t in leaves if isinstance(t, torch.Tensor)]
    return [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def output_leaves(out) -> list:
    """``pytree.tree_leaves(out)``, without the walk for a tensor, a tuple or list of tensors,
    or a Hugging Face ModelOutput of tensors (a dict subclass pytree flattens by its values)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if type(out) in (tuple, list) or (isinstance(out, dict) and is_model_output(out)):
        values = list(out.values()) if isinstance(out, dict) else list(out)
        if all(isinstance(v, torch.Tensor) for v in values):
            return values
    return pytree.tree_leaves(out)


# Python values that are pytree leaves themselves (a keyword such as use_cache=False)
_PLAIN_LEAVES = frozenset({bool, int, float, str, type(None)})
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_CONTIGUOUS = operator.methodcaller("is_contiguous")
_DIM = torch.Tensor.dim


def check_batch(tensors: list[torch.Tensor]) -> int:
    """The batch size of a call's tensor inputs, which all carry it in dim 0."""
    if not tensors:
        raise CaptureError("dpfx needs at least one tensor input with the batch in dim 0")
    if not all(map(_DIM, tensors)):
        raise CaptureError("every tensor input needs the batch in dim 0; got a 0-d tensor")
    batch = tensors[0].shape[0]
    if len(set(map(len, tensors))) != 1:     # len(t): its size in dim 0
        sizes = [tuple(t.shape) for t in tensors]
        raise ValueError(f"every tensor input needs the batch in dim 0 with the same size; got "
                         f"shapes {sizes}")
    return batch


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
