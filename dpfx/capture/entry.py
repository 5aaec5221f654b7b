"""How dynamo captures dpfx's entry: its own code object, the settings only a capture reads (the
heap frozen among them), and the one unbacked batch symbol on every input.

# Note [Why the batch dim is marked unbacked]
Dynamo specializes sizes 0 and 1 of dynamic dims, which would mean three graphs (and three
compiles) for Poisson batches. ``mark_unbacked`` on dim 0 of every tensor input keeps the batch a
symbol that nothing specializes on, so one forward and one backward graph serve every batch size
including 0 and 1 (tests/lower/test_inductor.py::test_batch_sizes_compile_once).

Every input is marked with the same ``shape_id``, so all of them share one symbol: ``(x, mask)``
is one batch of size u0, not two independent sizes u0 and u1 whose equality torch cannot decide
(``Eq(u1, u0)`` while tracing SDPA with a mask). dynamo adds a run-time check that the sizes agree.

The marks are attributes on the tensor (``_dynamo_unbacked_indices`` and friends), which dynamo's
guards read at call time. dpfx sets them just before the call and puts the tensor's attributes back
afterwards, so a caller's tensor leaves a dpfx call as it came (a later plain ``torch.compile``
would otherwise see dpfx's marks: tests/capture/test_inputs.py).
"""
from __future__ import annotations

import copy
import gc
import itertools
import logging
import re
import sys
import sysconfig
from typing import Any

import torch

from dpfx.capture import batch_branches
from dpfx.capture.errors import FAKE_TENSOR_LOG, NO_META_TRACEBACK
from dpfx.capture.swaps import ALL, Captured, Swaps


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
# (tests/capture/test_inputs.py::test_plain_compile_of_the_same_class_first).
_ENTRIES = itertools.count()


def own_entry(model: torch.nn.Module):
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
# (tests/capture/test_inputs.py::test_logging_inside_the_forward_across_captures,
# tests/hf/test_hf.py::test_bert_gradient_checkpointing_after_an_earlier_capture).
_LOGGER_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "log",
                   "warning_once", "info_once", "warning_advice")


# Note [Settings only a capture reads]
# Some of what a dpfx call sets up is read by dynamo only while it captures a frame: its
# recompile limit (a capture past 64 fails instead of falling back to eager), the Logger methods
# it skips (Note [Logging inside the forward]), nn.RNN capture (``allow_rnn``, for
# capture/swaps.py's LSTM), the unbacked batch mark on the inputs (``BatchMarked``), and the batch-size decisions
# (batch_branches.deciding). dynamo calls its callback only when a frame has no cached code whose
# guards pass, that is exactly when it captures; a steady-state call runs the cached code from
# C and never calls it. So dpfx wraps the callback of its own entry (``CaptureSettings``) and
# sets these up inside it, where they are in place for every capture and cost a steady-state
# step nothing (set up per call they cost tens of microseconds, several times that in a
# training loop, where the kernels between two calls evict the interpreter's caches). The
# wrapper carries dynamo's ``_torchdynamo_orig_backend`` chain, as dynamo's own wrappers do
# (eval_frame._callback_from_stance), so dynamo matches it to the entry's cached code. What
# dynamo checks in its guards on every call stays set up on every call: those of capture/swaps.py's
# swaps that the guards read (Note [Only the swaps the guards read, between captures]).
# A ``torch.compiler.set_stance`` other than the default may put a callback of its own in front
# (eager_then_compile builds a fresh one from the innermost backend at its second call, which
# the wrapper would not see); under any such stance the settings are set up around the whole
# call, as they were for every call before (tests/loop/test_loop_privacy.py::
# test_capture_settings_only_while_dynamo_captures).
def default_stance() -> bool:
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    return stance is not None and stance.stance == "default" and stance.backend is None


def compile_entry(fn, backend) -> tuple[Any, "CaptureSettings"]:
    """``torch.compile(fn, backend=backend, fullgraph=True)``, with dynamo's callback wrapped
    in the capture-time settings."""
    context = torch._dynamo.optimize(
        backend=torch._TorchCompileWrapper(backend, "default", None, None), nopython=True)
    capture = CaptureSettings(context.callback)
    context.callback = capture
    return context(fn), capture


class CaptureSettings:
    """dynamo's callback for a dpfx entry, run with the settings only a capture reads."""

    __slots__ = ("_callback", "_torchdynamo_orig_backend", "call", "captures")

    def __init__(self, callback):
        self._callback = callback
        # One step down dynamo's chain, as the CatchErrorsWrapper it stands for: a stance's own
        # callback reads the compiler two steps below the callback it is given.
        self._torchdynamo_orig_backend = getattr(callback, "_torchdynamo_orig_backend", callback)
        self.call = None    # (input tensors, batch size, decisions) of the call in progress
        self.captures = 0   # calls of the callback (dynamo's captures of the entry)

    def __call__(self, *args, **kwargs):
        self.captures += 1
        if self.call is None:
            # Not within DPModule.forward (nothing else calls the entry): dynamo with dpfx's
            # settings still, so that no capture ever runs without them.
            with HeapFrozen(), DynamoSettings(), Captured():
                return self._callback(*args, **kwargs)
        tensors, batch, decisions = self.call
        with HeapFrozen(), DynamoSettings(), Captured(), BatchMarked(tensors), \
                batch_branches.deciding(batch, decisions):
            return self._callback(*args, **kwargs)


# Note [The heap frozen during a capture]
# Python's cyclic collector runs a full collection (every tracked object of the process, 500k or
# more once torch, sympy and a model are loaded) when the objects surviving its younger
# collections reach a quarter of those the last full one kept. A capture makes that many: a
# warm first step (dynamo's trace, aot_autograd's joint trace and partition, dpfx's passes, the
# proof and the self-check; Inductor's cache serving the kernels) of a small MLP makes a full
# collection of the whole heap, a third of its time. While
# dpfx captures, the objects that existed before it are frozen (``gc.freeze``: moved to the
# permanent generation, which no collection reads), and put back in the oldest generation
# after (``gc.unfreeze``): a collection during the capture reads only what the capture made.
# The warm first step then makes none. Nothing is lost: reference counting still frees
# everything; cyclic garbage among the frozen objects is collected by the first full collection
# after the capture. A cold compile's collections read mostly what it made, so they stay (as long
# with the heap frozen, at the same peak RSS). Freezing again after each full collection of the
# capture, or no full collection during it, would keep the cyclic garbage made early in the
# compile until it ends, at a higher peak RSS (BENCHMARKS.md, "Levers in the code").
# The heap is left alone where the process froze objects itself (``gc.get_freeze_count()``:
# unfreezing would hand back the process's objects too), where the collector is off, inside
# another capture, and on the collectors whose heap is not the generational one of CPython
# 3.10-3.13 (the free-threaded build; 3.14's incremental collector).
# (tests/capture/test_inputs.py::test_heap_frozen_only_during_a_capture)
_GENERATIONAL_GC = sys.version_info < (3, 14) and not sysconfig.get_config_var("Py_GIL_DISABLED")


class HeapFrozen:
    """The process's tracked objects out of the cyclic collector's reach while a capture runs
    (Note [The heap frozen during a capture])."""

    __slots__ = ("_froze",)
    _depth = 0

    def __enter__(self):
        self._froze = (_GENERATIONAL_GC and HeapFrozen._depth == 0 and gc.isenabled()
                       and gc.get_freeze_count() == 0)
        HeapFrozen._depth += 1
        if self._froze:
            gc.freeze()
        return self

    def __exit__(self, *exc):
        HeapFrozen._depth -= 1
        if self._froze:
            gc.unfreeze()
        return False


def steady_swaps(fn, args: tuple, kwargs: dict) -> Swaps:
    """The swaps for steady-state calls of dpfx's entry ``fn``, right after a call (``args``,
    ``kwargs``) in which dynamo captured it: those that the guards of its cached graphs name,
    if with only them in place one of those graphs still passes its guards for this call; else
    all (Note [Only the swaps the guards read, between captures] in capture/swaps.py)."""
    names = names_guards_read(fn.__code__)
    if names is None:
        return ALL
    swaps = Swaps(names)
    return swaps if swaps.names != ALL.names and _guards_pass(fn, args, kwargs, swaps) else ALL


def _guards_pass(fn, args: tuple, kwargs: dict, swaps: Swaps) -> bool:
    """Whether the guards of one of ``fn``'s cached graphs pass for ``fn(*args, **kwargs)`` with
    only ``swaps`` in place (dynamo evaluates them on the frame's arguments and closure)."""
    code = fn.__code__
    if code.co_argcount or code.co_kwonlyargcount or code.co_flags & 0xC != 0xC:
        return False        # not dpfx's fn(*args, **kwargs)
    frame = {code.co_varnames[0]: tuple(args), code.co_varnames[1]: dict(kwargs)}
    frame.update(zip(code.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))
    try:
        entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code)
        with swaps:
            return any(entry.guard_manager.check(frame) for entry in entries)
    except Exception:       # a torch without these internals: every swap, as before
        return False


def names_guards_read(code) -> set[str] | None:
    """Every name in the sources of the guards of ``code``'s cached graphs (``G['F'].linear``
    names ``linear``, ``L['x'].view.__func__`` names ``view``): a superset of the attributes they
    read. None where dynamo's guards cannot be read so (Note [Only the swaps the guards read,
    between captures] in capture/swaps.py)."""
    try:
        entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code)
        sources = [m for entry in entries
                   for m in _GUARD_SOURCE.findall(str(entry.guard_manager))]
    except Exception:       # a torch without these internals: every swap, as before
        return None
    if not sources:
        return None
    return set(_NAME.findall(" ".join(sources)))


_GUARD_SOURCE = re.compile(r"source=(.*?), accessed_by=")
_NAME = re.compile(r"[A-Za-z_]\w*")


# dynamo's settings while it captures a dpfx entry (Note [Settings only a capture reads]).
class DynamoSettings:
    __slots__ = ("_old",)

    def __enter__(self):
        config = torch._dynamo.config
        self._old = (config.recompile_limit, config.fail_on_recompile_limit_hit,
                     config.ignore_logging_functions, config.allow_rnn)
        config.recompile_limit = 64
        config.fail_on_recompile_limit_hit = True
        config.ignore_logging_functions = _skipped_logging(self._old[2])
        config.allow_rnn = True
        FAKE_TENSOR_LOG.addFilter(NO_META_TRACEBACK)     # Note [An op that fails on the
                                                          # fake inputs] in capture/errors.py
        return self

    def __exit__(self, *exc):
        config = torch._dynamo.config
        (config.recompile_limit, config.fail_on_recompile_limit_hit,
         config.ignore_logging_functions, config.allow_rnn) = self._old
        FAKE_TENSOR_LOG.removeFilter(NO_META_TRACEBACK)
        return False




def _skipped_logging(current: set) -> set:
    """dynamo's skipped logging functions with the Logger methods ``logging.Logger`` has now
    (Note [Logging inside the forward])."""
    methods = {getattr(logging.Logger, name) for name in _LOGGER_METHODS
               if hasattr(logging.Logger, name)}
    return set(current) | methods


BATCH_SHAPE_ID = "dpfx_batch"


class BatchMarked:
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
