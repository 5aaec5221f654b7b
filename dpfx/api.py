"""``dpfx.compile``: the user's entry point, and the wrapper module it returns.

    dp_model = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.1)
    loss = F.cross_entropy(dp_model(x), y)
    loss.backward()        # every trainable p.grad is the DP-SGD gradient

# Note [Why the batch dim is marked unbacked]
Dynamo specializes sizes 0 and 1 of dynamic dims, which would mean three graphs (and three
compiles) for Poisson batches. ``mark_unbacked`` on dim 0 of every tensor input keeps the batch a
symbol that nothing specializes on, so one forward and one backward graph serve every batch size
including 0 and 1 (tests/test_inductor.py::test_batch_sizes_compile_once).

Every input is marked with the same ``shape_id``, so all of them share one symbol: ``(x, mask)``
is one batch of size u0, not two independent sizes u0 and u1 whose equality torch cannot decide
(``Eq(u1, u0)`` while tracing SDPA with a mask). dynamo adds a run-time check that the sizes agree.

The marks are attributes on the tensor (``_dynamo_unbacked_indices`` and friends), which dynamo's
guards read at call time. dpfx sets them just before the call and puts the tensor's attributes back
afterwards, so a caller's tensor leaves a dpfx call as it came (a later plain ``torch.compile``
would otherwise see dpfx's marks: tests/test_inputs.py).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import itertools
import logging
import os
import weakref
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from . import batch_branches
from .backend import DPBackend
from .config import DPConfig, warn_fixed_seed
from .errors import CaptureError, DPFXError, PrivacyError
from .hf_labels import hf_labels_loss
from . import loss_track
from .loss_track import TrackedTensor, check_inputs, track, untrack
from .modules import check_modules, norm_layers
from .release import (GradientLedger, after_accumulate, check_gradient, check_loop_inputs,
                      track_release)
from .traceable import swapped


class DPModule(torch.nn.Module):
    """A compiled private view of ``model``; it shares the model's parameters."""

    def __init__(self, model: torch.nn.Module, config: DPConfig):
        super().__init__()
        self._orig_mod = model
        backend = DPBackend(model, config)
        object.__setattr__(self, "_dpfx_backend", backend)
        # Note [Deciding a branch on the batch size] (batch_branches.py): one compiled entry per
        # set of decisions; a model that never branches on the batch has one.
        object.__setattr__(self, "_dpfx_entries", [])
        # noise="optimizer": the clipped sums of every backward accumulate here, not in p.grad
        # (Note [Clipped sums stay out of p.grad]).
        self.clipped_sums: dict[str, torch.Tensor] = {}
        self.examples = 0            # examples in the accumulated backward passes
        self._pending_examples = 0   # examples of forwards whose backward has not run yet
        # Note [Every gradient a parameter receives is dpfx's]
        self._grad_guards: dict[str, Any] = {}
        weakref.finalize(self, _remove_hooks, self._grad_guards)
        # Note [One release per accounted step] and Note [Only dpfx's gradients reach a private
        # step] in release.py
        self.releases = 0
        self._dpfx_optimizer = None      # a weakref to the DPOptimizer stepping this model
        self._ledger = GradientLedger()
        self._trainable_at_compile = [(n, p, p.requires_grad) for n, p in model.named_parameters()]
        # Note [The steady-state call]
        self._params = [p for _, p, _ in self._trainable_at_compile]
        self._param_ids = {id(p) for p in self._params}
        self._norm_layers = norm_layers(model)
        self._all_guarded = False
        self._compiles_seen = 0
        object.__setattr__(self, "_entry_by_batch", {})
        for name, p in model.named_parameters():
            if p.requires_grad:
                self._grad_guards["after_accumulate", name] = \
                    p.register_post_accumulate_grad_hook(
                        functools.partial(after_accumulate, weakref.ref(self), name))

    @property
    def norm_stats(self):
        """``dpfx.stats.NormStats`` when compiled with ``track_norms=True``, else None."""
        return self._dpfx_backend.norm_stats

    def reset_clipped_sums(self) -> None:
        self.clipped_sums.clear()
        self.examples = 0

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
    # the compiled forward (0.5 ms against 0.4 ms on the 2-core machine for the MLP).
    # What does not change between steps is read once: the parameters, their ids for the loss
    # check, the normalization layers the mixing check looks at, which batch size routes to
    # which compiled entry, whether every trainable parameter has its gradient guard. Those
    # caches are read again after any capture (``_after_capture``: a module added after compile
    # makes dynamo capture again, where the graph's own verifier sees it first, and a trainable
    # parameter added or replaced is refused there, backend.py). What only a capture reads is
    # set up only when dynamo captures (Note [Settings only a capture reads]); the swaps
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
    # outer compile is a no-op over dpfx's module (tests/test_trainer.py).
    @torch._dynamo.disable(reason="dpfx's module runs its own compiled graphs")
    def forward(self, *args, **kwargs):
        hf_loss = hf_labels_loss(self._orig_mod, kwargs)
        if hf_loss is not None:
            kwargs = hf_loss[0]
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
        if batch == 0:
            # An empty slice such as x[:, :-1].contiguous() keeps its parent's strides (an empty
            # tensor counts as contiguous), which would fail dynamo's stride guard and recompile.
            # Empty inputs carry no data: hand dynamo fresh row-major ones.
            args, kwargs = pytree.tree_map_only(torch.Tensor, _row_major_empty, (args, kwargs))
            tensors = _tensor_leaves(args, kwargs)
        config = self.dp_config
        training = torch.is_grad_enabled() and any(p.requires_grad for p in self._params)
        if training and batch == 0 and config.loss_reduction == "mean" \
                and config.expected_batch_size is None and config.noise == "graph":
            raise ValueError(
                "empty batch with loss_reduction='mean' and no expected_batch_size: the DP-SGD "
                "gradient would divide by 0. Pass expected_batch_size (Poisson sampling's q*N).")
        backend = self._dpfx_backend
        if training and backend.problems is None:
            check_modules(self._orig_mod, self._norm_layers)
            check_loop_inputs(self, tensors)
        backend.forward_ran = False
        entry = self._entry_for(batch)
        backend.decisions = entry.decisions
        capture = entry.capture
        capture.call = (tensors, batch, entry.decisions)
        # aot_autograd's runtime marks the inputs' dynamic dims on every call; a later plain
        # torch.compile of the caller's tensors must not see dpfx's batch dim there.
        propagated = [t.__dict__.get(_PROPAGATED) for t in tensors]
        try:
            with swapped():
                if _default_stance():
                    out = entry.compiled(*args, **kwargs)
                else:   # Note [Settings only a capture reads]: set up around the whole call
                    with _DynamoSettings(), _BatchMarked(tensors), \
                            batch_branches.deciding(batch, entry.decisions):
                        out = entry.compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if isinstance(e.inner_exception, DPFXError):
                raise e.inner_exception.with_traceback(None) from None
            if isinstance(e.inner_exception, GuardOnDataDependentSymNode):
                raise _symbolic_batch_error(e.inner_exception) from e
            raise
        except GuardOnDataDependentSymNode as e:
            raise _symbolic_batch_error(e) from e
        except torch._dynamo.exc.UserError as e:
            if "data-dependent" in str(e):
                raise _symbolic_batch_error(e) from e
            raise
        except torch._dynamo.exc.Unsupported as e:
            raise _graph_break_error(e) from e
        except torch._dynamo.exc.TorchRuntimeError as e:
            refusal = _refusal_while_capturing(e)
            if refusal is None:
                raise
            raise refusal from None
        finally:
            capture.call = None
            for t, mark in zip(tensors, propagated):
                if mark is None:
                    t.__dict__.pop(_PROPAGATED, None)
                else:
                    t.__dict__[_PROPAGATED] = mark
        if training and not backend.forward_ran:
            raise PrivacyError(
                "the forward did not run through dpfx's compiled graph (torch.compile fell back "
                "to eager); the gradients would not be private")
        if backend.compiles != self._compiles_seen:
            self._after_capture()
        if training:
            self.__dict__["_pending_examples"] = batch   # a plain int: skip Module.__setattr__
            if not self._all_guarded:
                self._guard_gradients()
            outputs = [out] if isinstance(out, torch.Tensor) else pytree.tree_leaves(out)
            track_release(self, outputs, tensors)
            # Note [The loss inside the proof] in loss_track.py
            out = track(out, backend, batch, self._param_ids, tensors)
        if hf_loss is not None and hf_loss[1] is not None:
            out["loss"] = hf_loss[1](out.logits)
        return out

    def _after_capture(self) -> None:
        """Note [The steady-state call]: what the steady state reads from caches is read again
        after every capture (a parameter or module added since compile makes dynamo capture)."""
        self._compiles_seen = self._dpfx_backend.compiles
        self._param_ids = {id(p) for p in self._orig_mod.parameters()}
        self._norm_layers = norm_layers(self._orig_mod)
        self._all_guarded = False

    def _entry_for(self, batch: int) -> "_Entry":
        """The compiled entry whose batch-size decisions hold at ``batch``, else a new one."""
        memo = self._entry_by_batch.get(batch)
        if memo is not None and len(memo[0].decisions) == memo[1]:
            return memo[0]
        entries = self._dpfx_entries
        for entry in entries:
            if batch_branches.holds(entry.decisions, batch):
                # Valid while the entry's decisions stay as they are (a capture appends to them).
                self._entry_by_batch[batch] = (entry, len(entry.decisions))
                return entry
        if len(entries) >= _MAX_ENTRIES:
            decided = "\n".join(f"    {d}" for e in entries for d in e.decisions)
            raise CaptureError(
                f"the model's code branches on the batch size in more ways than dpfx compiles "
                f"graphs for ({_MAX_ENTRIES}); batch size {batch} needs another. Decisions so "
                f"far:\n{decided}\nCompute those conditions from something other than the "
                f"batch size.")
        compiled, capture = _compile_entry(_own_entry(self._orig_mod), self._dpfx_backend)
        entry = _Entry([], compiled, capture)
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
    # refuses (Note [Only dpfx's gradients reach a private step] in release.py). A parameter the
    # model does not use is left alone.
    def _guard_gradients(self) -> None:
        backend = self._dpfx_backend
        if backend.graph_params is None:
            return
        for name, p in self._orig_mod.named_parameters():
            if p.requires_grad and name not in self._grad_guards:
                self._grad_guards[name] = p.register_hook(functools.partial(
                    check_gradient, weakref.ref(backend), name, weakref.ref(self), weakref.ref(p)))
        # Parameters trainable at compile are all there is to guard: check_loop_inputs refuses
        # any later change of requires_grad, and a parameter added later makes dynamo capture
        # again (then the walk runs again: _after_capture).
        self._all_guarded = True


_PRIVATE_SETTINGS = {f.name for f in dataclasses.fields(DPConfig)} | {"dp_config"}


@dataclasses.dataclass
class _Entry:
    decisions: list          # batch_branches.Decision: the batch sizes this entry serves
    compiled: Any            # torch.compile of dpfx's own entry function
    capture: "_CaptureSettings"   # dynamo's callback for it (Note [Settings only a capture reads])


_MAX_ENTRIES = 8
_PROPAGATED = "_dynamo_propagated_dynamic_indices"


def _remove_hooks(handles: dict) -> None:
    for handle in handles.values():
        handle.remove()


# Note [dpfx's own entry frame]
# dynamo keeps its compiled code per Python code object and does not tell backends apart when it
# looks a frame up. Compiled as ``torch.compile(model)``, the first frame dynamo traces is the
# model class's ``forward``: if a plain torch.compile of another instance of that class ran first
# (and broke its graph at a layer dpfx makes traceable, nn.LSTM), dynamo served dpfx's call from
# that entry, ran part of the model in the plain graph (gradients never clipped) and handed dpfx
# only the frame after the break. dpfx therefore compiles a function whose code object is its own:
# a copy made for each DPModule, which no other compile has seen, that calls the model. dynamo
# starts there and, with fullgraph=True, inlines everything below it into dpfx's one graph,
# consulting no other cache entry
# (tests/test_inputs.py::test_plain_compile_of_the_same_class_first).
_ENTRIES = itertools.count()


def _own_entry(model: torch.nn.Module):
    def dpfx_forward(*args, **kwargs):
        return model(*args, **kwargs)

    dpfx_forward.__code__ = dpfx_forward.__code__.replace(
        co_name=f"dpfx_forward_{next(_ENTRIES)}")
    return dpfx_forward


# Note [Logging inside the forward]
# A logging.Logger call cannot be put in a graph, and dynamo breaks the graph on it, which dpfx must
# refuse. Hugging Face models log from their forward (GPT-2 and BERT with gradient checkpointing
# warn that use_cache is turned off), so while dpfx captures, dynamo skips the standard Logger
# methods and transformers' ``warning_once`` / ``info_once``: the message is not printed during
# the compiled run, and nothing else changes (a logging call returns None and computes nothing
# the model uses). Plain torch.compile calls outside dpfx keep dynamo's default. The methods are
# read from ``logging.Logger`` at every capture, not once per process: transformers adds its own
# when it is imported, which may be after dpfx captured another model
# (tests/test_inputs.py::test_logging_inside_the_forward_across_captures,
# tests/test_hf.py::test_bert_gradient_checkpointing_after_an_earlier_capture).
_LOGGER_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "log",
                   "warning_once", "info_once", "warning_advice")


# Note [Settings only a capture reads]
# Some of what a dpfx call sets up is read by dynamo only while it captures a frame: its
# recompile limit (a capture past 64 fails instead of falling back to eager), the Logger methods
# it skips (Note [Logging inside the forward]), nn.RNN capture (``allow_rnn``, for traceable.py's
# LSTM), the unbacked batch mark on the inputs (``_BatchMarked``), and the batch-size decisions
# (batch_branches.deciding). dynamo calls its callback only when a frame has no cached code whose
# guards pass, that is exactly when it captures; a steady-state call runs the cached code from
# C and never calls it. So dpfx wraps the callback of its own entry (``_CaptureSettings``) and
# sets these up inside it, where they are in place for every capture and cost a steady-state
# step nothing (they were 15-25 us per call on the 2-core machine, several times that in a
# training loop, where the kernels between two calls evict the interpreter's caches). The
# wrapper carries dynamo's ``_torchdynamo_orig_backend`` chain, as dynamo's own wrappers do
# (eval_frame._callback_from_stance), so dynamo matches it to the entry's cached code. What dynamo checks in its guards on every call stays set up on every call:
# traceable.py's swaps (the guards check the swapped functions' code).
# A ``torch.compiler.set_stance`` other than the default may put a callback of its own in front
# (eager_then_compile builds a fresh one from the innermost backend at its second call, which
# the wrapper would not see); under any such stance the settings are set up around the whole
# call, as they were for every call before (tests/test_loop_privacy.py::
# test_capture_settings_only_while_dynamo_captures).
def _default_stance() -> bool:
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    return stance is not None and stance.stance == "default" and stance.backend is None


def _compile_entry(fn, backend) -> tuple[Any, "_CaptureSettings"]:
    """``torch.compile(fn, backend=backend, fullgraph=True)``, with dynamo's callback wrapped
    in the capture-time settings."""
    context = torch._dynamo.optimize(
        backend=torch._TorchCompileWrapper(backend, "default", None, None), nopython=True)
    capture = _CaptureSettings(context.callback)
    context.callback = capture
    return context(fn), capture


class _CaptureSettings:
    """dynamo's callback for a dpfx entry, run with the settings only a capture reads."""

    __slots__ = ("_callback", "_torchdynamo_orig_backend", "call")

    def __init__(self, callback):
        self._callback = callback
        # One step down dynamo's chain, as the CatchErrorsWrapper it stands for: a stance's own
        # callback reads the compiler two steps below the callback it is given.
        self._torchdynamo_orig_backend = getattr(callback, "_torchdynamo_orig_backend", callback)
        self.call = None    # (input tensors, batch size, decisions) of the call in progress

    def __call__(self, *args, **kwargs):
        if self.call is None:
            # Not within DPModule.forward (nothing else calls the entry): dynamo with dpfx's
            # settings still, so that no capture ever runs without them.
            with _DynamoSettings():
                return self._callback(*args, **kwargs)
        tensors, batch, decisions = self.call
        with _DynamoSettings(), _BatchMarked(tensors), \
                batch_branches.deciding(batch, decisions):
            return self._callback(*args, **kwargs)


# dynamo's settings while it captures a dpfx entry (Note [Settings only a capture reads]).
class _DynamoSettings:
    __slots__ = ("_old",)

    def __enter__(self):
        config = torch._dynamo.config
        self._old = (config.recompile_limit, config.fail_on_recompile_limit_hit,
                     config.ignore_logging_functions, config.allow_rnn)
        config.recompile_limit = 64
        config.fail_on_recompile_limit_hit = True
        config.ignore_logging_functions = _skipped_logging(self._old[2])
        config.allow_rnn = True
        return self

    def __exit__(self, *exc):
        config = torch._dynamo.config
        (config.recompile_limit, config.fail_on_recompile_limit_hit,
         config.ignore_logging_functions, config.allow_rnn) = self._old
        return False


def _skipped_logging(current: set) -> set:
    """dynamo's skipped logging functions with the Logger methods ``logging.Logger`` has now
    (Note [Logging inside the forward])."""
    methods = {getattr(logging.Logger, name) for name in _LOGGER_METHODS
               if hasattr(logging.Logger, name)}
    return set(current) | methods


def _graph_break_error(e: Exception) -> CaptureError:
    """The graph break as the user needs it: what dynamo could not trace, why (for an exception
    raised while tracing, the exception itself), and where in the user's code."""
    lines = str(e).splitlines()

    def field(name: str) -> str:
        return next((line.split(":", 1)[1].strip() for line in lines
                     if line.strip().startswith(name + ":")), "")

    what = lines[0].strip() if lines else type(e).__name__
    why = field("Developer debug context") if what == "Observed exception" else field("Explanation")
    where = []
    if "from user code:" in lines:
        for line in lines[lines.index("from user code:") + 1:]:
            if not line.strip():
                break
            if not set(line.strip()) <= {"^", "~"}:
                where.append("    " + line.strip())
    hint = ""
    if what.startswith("Attempted to call function marked as skipped") and (
            "pack_padded_sequence" in why or "pad_packed_sequence" in why):
        hint = (" Call nn.utils.rnn.pack_padded_sequence / pad_packed_sequence through the module "
                "(a name imported with `from torch.nn.utils.rnn import ...` is torch's own, which "
                "dynamo cannot trace; dpfx swaps the module's attribute during capture).")
    return CaptureError(
        f"the model's forward could not be captured as one graph (a graph break): {what}"
        + (f": {why.rstrip('.')}" if why else "") + "."
        + ("\n  in the model's code:\n" + "\n".join(where) + "\n" if where else " ")
        + "dpfx never runs part of a model outside its private graph; rewrite that construct."
        + hint)


# Note [Refusals raised while capturing]
# A stand-in of traceable.py that finds an op mixing examples (torch.roll over the batch) raises a
# PrivacyError while dynamo runs it on fake tensors; dynamo wraps it in a TorchRuntimeError (the
# PrivacyError is in its exception chain). The PrivacyError is raised again, with the model's
# lines that led to it.
# (tests/test_loop_privacy.py::test_batch_mixing_norms_and_roll)
def _refusal_while_capturing(e: Exception) -> DPFXError | None:
    todo, seen = [e], set()
    while todo:
        cause = todo.pop()
        if cause is None or id(cause) in seen:
            continue
        seen.add(id(cause))
        if isinstance(cause, DPFXError):
            text = str(e)
            where = text.split("from user code:", 1)[1].split("\n\n", 1)[0] \
                if "from user code:" in text else ""
            lines, own = [], False
            for line in where.splitlines():
                if line.strip().startswith("File "):
                    own = f"{os.sep}dpfx{os.sep}" in line      # dpfx's own frames are noise
                if line.strip() and not set(line.strip()) <= {"^", "~"} and not own:
                    lines.append("    " + line.strip())
            return type(cause)(str(cause) + ("\n  in the model's code:\n" + "\n".join(lines)
                                             if lines else ""))
        todo += [cause.__cause__, cause.__context__]
    return None


BATCH_SHAPE_ID = "dpfx_batch"


class _BatchMarked:
    """Dim 0 of every tensor is the one unbacked batch symbol while the compiled call runs."""

    __slots__ = ("_tensors", "_saved")

    def __init__(self, tensors: list[torch.Tensor]):
        self._tensors = tensors

    def __enter__(self):
        # Shallow copies: mark_unbacked adds to an existing mark set in place.
        self._saved = [(t, {k: copy.copy(v) for k, v in t.__dict__.items()})
                       for t in self._tensors]
        try:
            for t in self._tensors:
                torch._dynamo.decorators.mark_unbacked(t, 0, shape_id=BATCH_SHAPE_ID)
        except BaseException:
            self.__exit__()          # the caller's tensors leave as they came
            raise
        return self

    def __exit__(self, *exc):
        for t, attrs in self._saved:
            for key in [k for k in t.__dict__ if k not in attrs]:
                delattr(t, key)
            t.__dict__.update(attrs)
        return False


def _tensor_leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        return list(args)
    return [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def _row_major_empty(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)


def _symbolic_batch_error(e: Exception) -> CaptureError:
    """What torch could not decide about the symbolic batch, where in the model's code, and the
    fix that applies (Note [Deciding a branch on the batch size] in batch_branches.py says
    which comparisons dpfx decides itself)."""
    chain, seen = [], e
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = getattr(seen, "inner_exception", None) or seen.__cause__ or seen.__context__
    guard = next((x for x in chain if hasattr(x, "dpfx_expr")), None)
    expr = str(guard.dpfx_expr) if guard is not None else \
        next((str(x).splitlines()[0] for x in chain
              if isinstance(x, GuardOnDataDependentSymNode)), str(e).splitlines()[0])
    stack = guard.dpfx_model_stack if guard is not None else []
    if not stack:
        stack = next((frames for x in chain if (frames := _user_code(str(x)))), [])
    if "Could not extract specialized integer" in expr or (
            guard is not None and not _is_condition(guard.dpfx_expr)):
        why = (f"the model's code needs the batch size as a Python number ({expr}): a loop over "
               f"the examples, a list with one entry per example, int(x.shape[0]). dpfx keeps "
               f"the batch symbolic so that one graph serves every batch size. Compute over the "
               f"whole batch with tensor ops instead.")
    else:
        why = (f"torch could not decide {expr} for a symbolic batch size. dpfx decides a "
               f"comparison of the batch size alone, at each call's size; this one also involves "
               f"a value computed from the data or another dynamic size. Make the condition "
               f"independent of the batch size, or file an issue with the expression and line.")
    where = "\n  in the model's code:\n" + "\n".join(f"    {f}" for f in stack) if stack else ""
    return CaptureError(f"the model cannot be captured with a symbolic batch size: {why}{where}")


def _is_condition(expr) -> bool:
    return bool(expr.is_Relational) or isinstance(expr, sympy.logic.boolalg.BooleanFunction)


def _user_code(message: str) -> list[str]:
    """The "from user code:" frames of a dynamo error message, one line each."""
    lines = message.splitlines()
    if "from user code:" not in lines:
        return []
    frames = []
    for line in lines[lines.index("from user code:") + 1:]:
        if not line.strip():
            break
        if line.strip().startswith("File ") and "/dpfx/" not in line:
            frames.append(line.strip())
        elif frames and not set(line.strip()) <= {"^", "~"} and not line.strip().startswith(
                "File "):
            frames[-1] += ": " + line.strip()
    return frames


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
            track_norms: bool = False, self_check: bool = True,
            allow_input_grads: bool = False) -> DPModule:
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
    sigma * sqrt(sum C^2). ``noise="optimizer"``: the backward leaves ``sum_i clip(g_i)`` in
    ``dp_model.clipped_sums`` (p.grad stays None) and ``dpfx.DPOptimizer`` adds the noise and
    divides once per optimizer step (virtual batches, secure noise, distributed training).
    The default ``noise`` is "graph", or "optimizer" when torch.distributed is initialized with
    more than one rank (the noise is then added once across ranks: Note [Noise once across
    ranks] in optim.py). ``track_norms``: record per-sample norms in ``dp_model.norm_stats``
    (not private: see stats.py). ``self_check``: before a compiled graph first trains, run it on
    synthetic batches against dpfx's verified graph and check that examples stay independent
    (Note [Checking what Inductor generated] in selfcheck.py); on by default for Inductor.
    ``allow_input_grads``: accept inputs that require grad; their gradients are not private
    (refused by default). ``seed`` is for tests: it warns (``dpfx.FixedSeedWarning``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"dpfx.compile expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "dpfx.compile got a DistributedDataParallel module. DDP all-reduces every gradient "
            "as it is produced, which would average per-rank noise and bypass dpfx's single "
            "noising; compile the bare module (ddp.module) instead and step with "
            "dpfx.DPOptimizer, which all-reduces the clipped sums once and adds the noise once.")
    if noise is None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1
        noise = "optimizer" if distributed else "graph"
    config = DPConfig(max_grad_norm, noise_multiplier, loss_reduction, expected_batch_size, seed,
                      backend, strategy, noise, track_norms, self_check,
                      allow_input_grads=allow_input_grads)
    warn_fixed_seed(seed)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters (requires_grad=True)")
    config.check_params([n for n, p in model.named_parameters() if p.requires_grad])
    return _module_class(model)(model, config)


# Note [The wrapped model's signature]
# Tools read a module's forward signature to decide what to pass it: Hugging Face's Trainer keeps
# only the dataset columns the forward names (with ``*args, **kwargs`` it keeps none, and the
# batch arrives empty), and finds the label columns from the class's forward. Each compiled
# module is therefore an instance of its own subclass of DPModule whose ``forward`` carries the
# wrapped model's signature (``inspect.signature`` reads ``__signature__``); the call itself is
# DPModule.forward. (tests/test_trainer.py)
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
