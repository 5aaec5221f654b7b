"""What the loss check follows: a trace of the calls made on dpfx's tensors, and their lines.

    trace = Trace(backend, batch, param_ids)    # one forward's outputs, or one loader batch
    trace.records.append((func, spec, descr, caller_site()))
    origin(t)                                   # the record that made a tracked tensor

``Tracked`` is the type of every tensor followed (its torch calls are ``TrackedTensor``'s, in
loss/track.py); ``WRITTEN`` holds the untracked tensors into which a detached value computed from
dpfx's outputs was written in place, which a loss or a model input may not read.
"""
from __future__ import annotations

import linecache
import os
import sys
import weakref
from typing import Any

import torch

import dpfx


_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(dpfx.__file__))


class Trace:
    """The calls recorded on one forward's outputs, or (``data``) on one batch of dpfx's loader."""

    def __init__(self, backend, batch: int | None, param_ids: set[int], data: bool = False):
        self.data = data
        self.leaves: list[torch.Tensor] = []    # a data trace's batch tensors, untracked
        self.backend = backend
        self.batch = batch
        self.param_ids = param_ids
        self.records: list[tuple] = []    # (func, spec, leaves, line); func None for an output
        self.externals: list[torch.Tensor] = []
        self._external_ids: dict[int, int] = {}
        self.stop_nodes: list = []        # autograd nodes of the tracked outputs
        self.outputs: dict[int, tuple] = {}   # record -> (value, autograd edge) of an output
        self.nodes: dict[int, Any] = {}     # record -> its result's grad_fn, for a token mean's
                                            # count (Note [A token mean's count] in
                                            # loss/verdict_key.py)
        self.poison: str | None = None
        self.released = False     # a loss of this forward's outputs was checked and released
        self.release = None       # the gate's record of this forward's release (loss/gate.py)

    def external(self, t: torch.Tensor) -> int:
        i = self._external_ids.get(id(t))
        if i is None:
            i = self._external_ids[id(t)] = len(self.externals)
            self.externals.append(t)
        return i


class Tracked(torch.Tensor):
    """The type of a tensor computed from dpfx's outputs or from a batch of its loader, with
    ``_dpfx`` = (trace, record, leaf). Every such tensor is a ``TrackedTensor`` (loss/track.py),
    which records its torch calls; the modules below the tracker recognize it by this type."""


class Output:
    """An output's place among a program's inputs (its value is read only when needed)."""
    __slots__ = ("trace", "record")

    def __init__(self, trace: Trace, record: int):
        self.trace, self.record = trace, record


def followed(t) -> bool:
    """A tracked tensor of a batch (Note [The batch's own tensors are followed too])."""
    return isinstance(t, Tracked) and t._dpfx[0].data


def origin(t: torch.Tensor):
    """The record that made ``t`` where dpfx's tracking made it (a batch of dpfx's loader, or a
    tensor computed from one), else None."""
    tracked = t.__dict__.get("_dpfx")
    if tracked is None:
        return None
    trace, record, _ = tracked
    return trace.records[record]


# Tensors dpfx does not follow into which a detached value computed from its outputs was written
# in place: a loss may not read them.
# Keyed by id: a tensor's ``==`` is elementwise, so a WeakSet's membership test cannot be used.
WRITTEN: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def was_written(t) -> bool:
    return isinstance(t, torch.Tensor) and WRITTEN.get(id(t)) is t


def caller_site():
    f, skipped = sys._getframe(1), _SKIPPED
    while f is not None:
        code = f.f_code
        skip = skipped.get(code)    # ``_skipped``, its common case in this frame
        if skip is None:
            skip = _skipped(code)
        if not skip:
            return code.co_filename, f.f_lineno
        f = f.f_back
    return None


def _skipped(code) -> bool:
    skip = _SKIPPED.get(code)
    if skip is None:
        skip = _SKIPPED[code] = code.co_filename.startswith(_SKIP_DIRS)
        if len(_SKIPPED) > 4096:
            _SKIPPED.clear()
    return skip


_SKIPPED: dict = {}     # code object -> in torch or dpfx (the frames caller_site walks past)


def caller_text() -> str:
    return site_text(caller_site())


def site_text(loc) -> str:
    if loc is None:
        return "in the loss"
    text = linecache.getline(loc[0], loc[1]).strip()
    return f"{os.path.basename(loc[0])}:{loc[1]}" + (f" `{text}`" if text else "")
