"""Following dpfx's outputs into the loss, and releasing gradients only for a verified loss.

    out = dp_model(x)          # a TrackedTensor in training mode (api.DPModule.forward)
    loss = F.cross_entropy(out, y)
    loss.backward()            # the loss is checked (loss/check.py), then the backward runs

# Note [The loss inside the proof]
In training mode DPModule.forward returns its tensor outputs as ``TrackedTensor`` (made with
``as_subclass``, which keeps autograd). Its ``__torch_function__`` runs every torch call as usual
and records it when a tracked tensor is among the arguments: the function, its other arguments
(tensors the loss reads, such as labels and masks, by reference; Python values as constants) and
the user's source line. Results are tracked in turn. ``Tensor.backward``, ``torch.autograd.backward``
and ``torch.autograd.grad`` on a tracked tensor first check the loss:

1. its autograd graph, from the loss down to dpfx's outputs, holds no custom autograd.Function
   (its backward could do anything), no torch.compile'd function, and no tensor requiring a
   gradient other than the model's own parameters (which invariant 4 in api.py watches);
2. the recorded calls, replayed with a symbolic batch, are a per-example sum
   (``loss_check.analyze``); the verdict is cached by the calls' structure (functions, constants,
   shapes with the batch written as a symbol), and a step whose trace records what an earlier
   one did finds it by the trace's records alone (Note [The steady-state key] in
   loss/steady.py);
3. the scalars applied after the batch reduction (the batch size written any way, a token count,
   a constant factor) are evaluated on the step's inputs and divided out of the backward's
   starting gradient (Note [The per-example term] in loss/check.py).

Only then does the backward run, inside each involved model's ``gate.proven()``: the backward
graph's runner asks the gate and refuses to run outside it (loss/gate.py), so a loss that escaped
the tracker (through a custom autograd.Function's output, ``.data``, a NumPy round trip) releases
nothing.

Not seen: computations on the labels outside the loss's calls on tracked tensors (a tensor computed
from the batch's labels alone is taken as per-example data, a Python number inside an example's
term as a constant), numbers taken out of tracked tensors (``.item()``, ``.tolist()``) and fed
back, and tensors computed from a tensor into which a detached value was written in place
(``buf += out.detach()``: a loss or a model input that reads ``buf`` itself is refused, ``buf * 2``
is a plain tensor).
"""
from __future__ import annotations

import collections
import contextlib
import linecache
import os
import sys
import warnings
import weakref
from typing import Any

import torch

import dpfx
import torch.utils._pytree as pytree

from dpfx.loss import check as loss_check, steady as loss_steady
from dpfx.errors import PrivacyError, DPFXWarning
from dpfx.loss.gate import (BACKWARD_CALLS, BACKWARD_KWARGS, BACKWARD_SIGNATURES,
                            SECOND_BACKWARD, TWO_FORWARDS, compiled_name, compiled_nodes)


class LossScaleWarning(DPFXWarning):
    """dpfx changed the scale of the loss's gradient (loss/check.py)."""


_GradientEdge = torch.autograd.graph.GradientEdge
_HOOKS = {torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook}
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
                                            # count (Note [A token mean's count] in loss_steady)
        self.poison: str | None = None
        self.released = False     # a loss of this forward's outputs was checked and released
        self.release = None       # the gate's record of this forward's release (loss/gate.py)

    def external(self, t: torch.Tensor) -> int:
        i = self._external_ids.get(id(t))
        if i is None:
            i = self._external_ids[id(t)] = len(self.externals)
            self.externals.append(t)
        return i


class TrackedTensor(torch.Tensor):
    """A tensor computed from dpfx's outputs; ``_dpfx`` is (trace, record, leaf)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in BACKWARD_CALLS:
            return _release(func, args, kwargs)
        if func in _HOOKS:
            raise PrivacyError(
                f"a gradient hook on a tensor computed from dpfx's outputs ({_where()}) could "
                f"change the gradient that reaches the model after the loss was checked. Put "
                f"that computation in the loss itself.")
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.__repr__:
                return func(args[0].as_subclass(torch.Tensor), *args[1:], **kwargs)
            result = func(*args, **kwargs)
        if func is torch.Tensor.__torch_function__:
            return result
        return _record(func, args, kwargs, result)


def track(out: Any, backend, batch: int, param_ids: set[int], inputs=(),
          release: dict | None = None) -> Any:
    """``out`` with its tensors tracked, as one trace. An output that is a fresh tensor of the
    compiled graph is retyped in place (``as_subclass`` would put an alias node into every
    backward); one that is also an input or a parameter (a forward that returns it) is wrapped
    as an alias, so the caller's own tensor keeps its type."""
    trace = Trace(backend, batch, param_ids)
    trace.release = release
    theirs = {id(t) for t in inputs}

    def wrap(t: torch.Tensor) -> torch.Tensor:
        trace.records.append((None, None, (tuple(t.shape[1:]), t.dtype, t.device), None))
        if type(t) is torch.Tensor and id(t) not in theirs and id(t) not in param_ids:
            t.__class__ = TrackedTensor
            tracked = t
        else:
            tracked = t.as_subclass(TrackedTensor)
        tracked._dpfx = (trace, len(trace.records) - 1, 0)
        with torch._C.DisableTorchFunctionSubclass():
            grad_fn = tracked.grad_fn
            if grad_fn is not None:
                trace.stop_nodes.append(grad_fn)
                # for Note [Terms on their own scales] in loss/check.py
                # (get_gradient_edge's own checks cost more than the rest of the wrapping)
                trace.outputs[len(trace.records) - 1] = (
                    tracked.detach(), _GradientEdge(grad_fn, tracked.output_nr))
            else:       # no gradient history (a mask, ids): a constant of each term
                trace.outputs[len(trace.records) - 1] = (tracked.detach(), None)
        return tracked

    if isinstance(out, torch.Tensor):
        return wrap(out)
    if _is_model_output(out):
        # A Hugging Face ModelOutput, made afresh by each call: its values are replaced in
        # place (its __setitem__ keeps the attributes in step), in the order pytree visits them.
        # Rebuilding it through pytree would run its dataclass constructor, tens of
        # microseconds a step.
        for key, value in list(out.items()):
            if isinstance(value, torch.Tensor):
                out[key] = wrap(value)
            elif isinstance(value, (list, tuple, dict)) or type(value) in pytree.SUPPORTED_NODES:
                out[key] = pytree.tree_map_only(torch.Tensor, wrap, value)
        return out
    return pytree.tree_map_only(torch.Tensor, wrap, out)


# Note [The batch's own tensors are followed too]
# The loss reads more than the model's outputs: labels, masks, example weights, a teacher's
# logits. A statistic of the batch computed from them before they meet an output (class weights
# from the batch's label histogram, targets centered by the batch's mean) couples examples just
# as a statistic of the outputs does, and so does a model input computed from the whole batch
# (inputs standardized by the batch's mean). dpfx's loader (``PoissonLoader``, what
# ``poisson_loader`` and ``make_private`` return) therefore yields its batches' tensors tracked
# (``track_batch``, one data trace per batch): the calls user code makes on them are recorded
# like the calls on the outputs, the loss check replays them with the loss, the loader's own
# tensors standing for per-example data with the batch in dim 0, and ``check_inputs`` proves, at
# the forward, that every model input computed from them keeps examples apart. The first
# ``_DATA_CALLS`` calls of a batch are followed; the results of later ones (a teacher network run
# on the batch) are plain tensors, taken as per-example data like the tensors of any other
# loader. (tests/loss/test_loss_corpus.py::test_batch_statistics_of_the_labels_are_refused)
_DATA_CALLS = 64


def track_batch(batch: Any) -> Any:
    """``batch`` (a loader's collated batch) with its tensors tracked, as one data trace: the
    calls user code makes on them before the loss (a class histogram of the labels, targets
    centered by the batch mean) are recorded and replayed with the loss (Note [The batch's own
    tensors are followed too])."""
    trace = Trace(None, None, set(), data=True)

    def wrap(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, TrackedTensor) or not t.dim():
            return t
        trace.records.append((None, None, (tuple(t.shape), t.dtype, t.device), "data"))
        trace.leaves.append(t)
        tracked = t.as_subclass(TrackedTensor)
        tracked._dpfx = (trace, len(trace.records) - 1, 0)
        return tracked

    return pytree.tree_map_only(torch.Tensor, wrap, batch)


def origin(t: torch.Tensor):
    """The record that made ``t`` where dpfx's tracking made it (a batch of dpfx's loader, or a
    tensor computed from one), else None."""
    tracked = t.__dict__.get("_dpfx")
    if tracked is None:
        return None
    trace, record, _ = tracked
    return trace.records[record]


def untrack(tree: Any) -> Any:
    """``tree`` with tracked batch tensors as plain tensors (the model's inputs)."""
    return pytree.tree_map_only(TrackedTensor, lambda t: t.as_subclass(torch.Tensor), tree)


def _is_model_output(out: Any) -> bool:
    return isinstance(out, dict) and any(
        c.__name__ == "ModelOutput" and c.__module__.startswith("transformers.")
        for c in type(out).__mro__)


def _record(func, args, kwargs, result):
    if isinstance(result, torch.Tensor):
        out_leaves, out_spec = [result], None
    elif isinstance(result, (tuple, list)) and any(isinstance(r, torch.Tensor) for r in result):
        out_leaves, out_spec = pytree.tree_flatten(result)
    else:
        return result
    leaves, spec = loss_check.flatten(args, kwargs)
    first = forward = None       # the first trace among the arguments, the first forward's
    forwards = 0
    for a in leaves:
        if isinstance(a, TrackedTensor):
            t = a._dpfx[0]
            first = first or t
            if not t.data and t is not forward:
                forward, forwards = forward or t, forwards + 1
    if first is None:
        return result
    trace = forward or first
    poison = None
    if forwards and func in loss_check.SCALING and _from_grad_scaler():
        poison = (
            "torch.amp.GradScaler.scale(loss): dpfx removes every scalar applied after the "
            "batch reduction from each example's term (its clipping bound C is for the unscaled "
            "gradient), so the release would not carry the scale that scaler.unscale_ then "
            "divides out, and every step would be 1/scale too small. dpfx clips and noises in "
            "float32: call loss.backward() on the unscaled loss and optimizer.step() without "
            "the scaler (bfloat16 autocast needs none).")
    elif forwards > 1:
        poison = TWO_FORWARDS
    if poison or trace.poison:
        poisoned = Trace(trace.backend, trace.batch, trace.param_ids)
        poisoned.poison = poison or trace.poison
        trace = poisoned
        index, descr = 0, None
    elif func in _IN_PLACE and isinstance(args[0], TrackedTensor) and _read_before(args[0]):
        raise PrivacyError(
            f"an in-place op ({_where()}) changes a value computed from dpfx's outputs that an "
            f"earlier op already read (or a view of it aliases): dpfx's check could not tell "
            f"the value each op saw. Write it out of place (`loss = loss * k`).")
    else:
        # a tracked tensor of another trace (a batch's, in a forward's call) is an external
        # whose own calls _program follows
        descr = tuple(("t", a._dpfx[1], a._dpfx[2])
                      if isinstance(a, TrackedTensor) and a._dpfx[0] is trace
                      else ("e", trace.external(a)) if isinstance(a, torch.Tensor)
                      else ("c", a) for a in leaves)
        index = len(trace.records)
        line = _caller()
        if _ARRANGING[0] and line is not None:
            line = (*line, ARRANGED)        # Note [A scale dpfx arranged]
        trace.records.append((func, spec, descr, line))
        if func in loss_steady.NLL_CALLS and isinstance(result, torch.Tensor):
            trace.nodes[index] = result.grad_fn
    wrapped = []
    for i, r in enumerate(out_leaves):
        if isinstance(r, torch.Tensor):
            if not isinstance(r, TrackedTensor) and _among(r, leaves):
                if not r.requires_grad:
                    # a detached value accumulated for logging (Trainer's ``tr_loss +=
                    # loss.detach()``): no gradient flows through it; a loss that later reads
                    # the tensor is refused (_verify)
                    _WRITTEN[id(r)] = r
                    wrapped.append(r)
                    continue
                raise PrivacyError(
                    f"an in-place op writes a value computed from dpfx's outputs into a tensor "
                    f"dpfx does not follow ({_where()}): the loss could use it unchecked. Write "
                    f"it out of place (`y = y + out`, not `y += out`).")
            if not isinstance(r, TrackedTensor):
                # a fresh result (not an argument): retyped in place; as_subclass would add an
                # alias node to the backward for every recorded call
                r.__class__ = TrackedTensor
            r._dpfx = (trace, index, i)
        wrapped.append(r)
    return wrapped[0] if out_spec is None else pytree.tree_unflatten(wrapped, out_spec)


def _among(r: torch.Tensor, leaves: list) -> bool:
    for a in leaves:
        if a is r:
            return True
    return False


_IN_PLACE = {torch.Tensor.__imul__, torch.Tensor.__itruediv__, torch.Tensor.mul_,
             torch.Tensor.div_, torch.Tensor.__iadd__, torch.Tensor.__isub__,
             torch.Tensor.add_, torch.Tensor.sub_}


def _read_before(t: TrackedTensor) -> bool:
    """Whether a recorded call already read the value ``t`` holds (an in-place op on it would
    then make the replay, which reads one value per record, disagree with what ran)."""
    trace, index, leaf = t._dpfx
    return any(d[0] == "t" and d[1] == index and d[2] == leaf
               for func, _, descr, _ in trace.records[index + 1:] if func is not None
               for d in descr)


# Tensors dpfx does not follow into which a detached value computed from its outputs was written
# in place: a loss may not read them.
# Keyed by id: a tensor's ``==`` is elementwise, so a WeakSet's membership test cannot be used.
_WRITTEN: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _was_written(t) -> bool:
    return isinstance(t, torch.Tensor) and _WRITTEN.get(id(t)) is t


# -- the check at backward --------------------------------------------------------------------------
def _release(func, args, kwargs):
    if func is torch.Tensor.backward and len(args) == 1 and kwargs.get("gradient") is None \
            and kwargs.keys() <= BACKWARD_KWARGS:
        # loss.backward(): the common call, without inspect's binding (Tensor.backward hands
        # its defaults on as keywords, so a test for no keywords never held)
        bound, single, losses, grads = None, True, [args[0]], [None]
        rest = {k: v for k, v in kwargs.items() if k != "gradient"}
    else:
        bound = BACKWARD_SIGNATURES[func].bind(*args, **kwargs)
        params = bound.arguments
        loss_name, grad_name = BACKWARD_CALLS[func]
        losses = params[loss_name]
        single = isinstance(losses, torch.Tensor)
        losses = [losses] if single else list(losses)
        grads = params.get(grad_name)
        grads = [None] * len(losses) if grads is None else [grads] if isinstance(
            grads, torch.Tensor) else list(grads)
    backends = []
    for i, loss in enumerate(losses):
        if isinstance(loss, TrackedTensor):
            factor = _verify(loss)
            if isinstance(factor, tuple):
                # Note [Terms on their own scales]: the backward starts at the outputs
                if func is torch.autograd.grad or len(losses) > 1 or (
                        grads[i] is not None and float(grads[i]) != 1.0):
                    raise PrivacyError(
                        "a loss whose terms' batch-dependent scales differ (a token mean plus "
                        "a mean over examples) is released with loss.backward() alone: call "
                        "backward on it, or put its terms on one scale (each per example).")
                edges, start = factor
                with loss._dpfx[0].backend.gate.proven(), \
                        torch._C.DisableTorchFunctionSubclass():
                    keep = {k: v for k, v in (bound.arguments if bound else rest).items()
                            if k in ("retain_graph", "create_graph", "inputs")}
                    return torch.autograd.backward(edges, start, **keep)
            if factor != 1.0:
                with torch._C.DisableTorchFunctionSubclass():
                    grads[i] = (torch.full((), factor, dtype=loss.dtype, device=loss.device)
                                if grads[i] is None else grads[i] * factor)
            backends.append(loss._dpfx[0].backend)
    with contextlib.ExitStack() as proven:
        for b in backends:
            proven.enter_context(b.gate.proven())
        if bound is None:
            with torch._C.DisableTorchFunctionSubclass():
                return func(args[0], grads[0], **rest)
        if any(g is not None for g in grads):
            params[grad_name] = grads[0] if single else grads
        with torch._C.DisableTorchFunctionSubclass():
            return func(*bound.args, **bound.kwargs)




def _per_term_release(verdict, inputs: list, scale) -> tuple:
    """The autograd edges of the outputs and the gradients that start the backward there, from
    the loss's checked program with each term on its own scale (Note [Terms on their own
    scales] in loss/check.py)."""
    values, edges, leaves = [], [], []
    with torch._C.DisableTorchFunctionSubclass():
        for v in inputs:
            if isinstance(v, _Output):
                value, edge = v.trace.outputs[v.record]
                if edge is not None:
                    value = value.detach().requires_grad_()
                    leaves.append(value)
                    edges.append(edge)
                values.append(value)
            elif isinstance(v, bool) or not isinstance(v, (int, float)):
                values.append(v.as_subclass(torch.Tensor) if isinstance(v, TrackedTensor) else v)
            else:
                values.append(torch.tensor(v, dtype=torch.int64 if isinstance(v, int)
                                           else torch.float64))
        with torch.enable_grad():
            loss = loss_check.scaled_terms(verdict, values, scale.ratios)
            grads = torch.autograd.grad(loss * scale.factor, leaves, allow_unused=True)
    kept = [(e, g) for e, g in zip(edges, grads) if g is not None]
    return [e for e, _ in kept], [g for _, g in kept]


def _verify(loss: TrackedTensor) -> float | tuple:
    trace, index, leaf = loss._dpfx
    if trace.release is not None and trace.release["released"]:
        raise PrivacyError(SECOND_BACKWARD)     # Note [One release per forward] in loss/gate.py
    if trace.poison:
        raise PrivacyError(trace.poison)
    _check_autograd(loss, trace)
    trace.released = True
    if trace.batch == 0:
        # No example, nothing to couple or to scale: the release is the noise alone (the graph's
        # clipped sums are empty), whatever the loss computes from the empty outputs.
        return 1.0
    reduction = trace.backend.config.loss_reduction
    # Note [The steady-state key] in loss/steady.py
    steady = None if _WRITTEN else loss_steady.key(trace, index, leaf,
                                                   [origin(t) for t in trace.externals])
    found = steady and loss_steady.lookup(steady, trace)
    if found:
        scale = loss_check.eval_scale(found[0], trace.batch, found[1], reduction)
        if type(scale) is tuple and not (scale[1] and not getattr(found[0], "warned", False)):
            return scale[0]
    program, key, inputs = _program(trace, index, leaf, full=False)
    if _WRITTEN and any(_was_written(v) for v in inputs):
        raise PrivacyError(
            f"the loss ({_line(_program(trace, index, leaf)[0]['lines'][-1])}) reads a tensor "
            f"into which a value computed from dpfx's outputs was written in place (`buf += "
            f"out.detach()`): it may carry other examples' outputs into this loss unchecked. "
            f"Compute the loss from the outputs and the batch's own tensors.")
    verdict = _lookup(key, program["candidates"])
    if verdict is None:
        program = _program(trace, index, leaf)[0]
        verdict, choice = _analyze(program, trace.batch)
        _store(key, choice, verdict)
    if isinstance(verdict, loss_check.LossRefused):
        raise _refusal(verdict, _program(trace, index, leaf)[0])
    values = loss_check.normalizer_values(verdict, trace.batch, inputs)
    scale = loss_check.eval_scale(verdict, trace.batch, values, reduction)
    if isinstance(scale, str):
        program = _program(trace, index, leaf)[0]
        raise PrivacyError(f"the loss ({_line(program['lines'][-1])}) cannot be made a sum of "
                           f"per-example terms: {scale}. Compute one per-example loss and take "
                           f"its mean or sum over dim 0.")
    if isinstance(scale, loss_check.PerTerm):
        return _per_term_release(verdict, inputs, scale)
    factor, changed = scale
    if changed and not getattr(verdict, "warned", False):
        verdict.warned = True
        program = _program(trace, index, leaf)[0]
        message = _scale_message(verdict, reduction, program)
        if message not in _WARNED and \
                not _arranged_scale(verdict, program["lines"], values, trace.batch, reduction):
            _WARNED.add(message)
            warnings.warn(message, LossScaleWarning, stacklevel=4)
    if steady:
        loss_steady.store(steady, verdict, program, values, trace)
    return factor


# The scale warnings given, by their text. A loss is warned of once per process: its verdict
# carries a flag too, but a batch size that keys the program apart (a batch of 1, whose rows
# cannot be told from a broadcast) or a step off the steady path analyzes it afresh.
_WARNED: set[str] = set()


def forget() -> None:
    """Drop every cached loss verdict, steady-state entry and given warning: the next loss is
    analyzed, and warned of, as in a new process."""
    _VERDICTS.clear()
    loss_steady._STEADY.clear()
    _WARNED.clear()


# The verdicts, by the program's structure: at most _CACHE_SIZE keys, least recently used
# dropped first; each key holds the verdicts of its choices of size ints (usually one).
_VERDICTS: "collections.OrderedDict[Any, list]" = collections.OrderedDict()
_CACHE_SIZE = 256


def _lookup(key, candidates: list):
    entries = _VERDICTS.get(key)
    if entries is None:
        return None
    _VERDICTS.move_to_end(key)
    for choice, verdict in entries:
        if _matches(choice, candidates):
            return verdict
    return None


def _store(key, choice: tuple, verdict) -> None:
    entries = _VERDICTS.setdefault(key, [])
    entries.append((choice, verdict))
    del entries[:-8]
    _VERDICTS.move_to_end(key)
    while len(_VERDICTS) > _CACHE_SIZE:
        _VERDICTS.popitem(last=False)


def _program(trace: Trace, index: int, leaf: int, full: bool = True
             ) -> tuple[dict, tuple, list]:
    """The recorded calls the loss depends on, renumbered, with those of the batch tensors it
    reads (Note [The batch's own tensors are followed too]); a hashable key of their structure;
    the real values its placeholders stand for (outputs as None).

    Two kinds of Python numbers are not baked into the program (Note [Python numbers in the
    loss] in loss/check.py): a number that multiplies or divides a tensor becomes a scalar
    placeholder (its value is read on every step, and the key holds only its type), and an int
    in a size argument (``view``, ``reshape``, ``expand``, ...) that is a multiple k of the batch
    size is a candidate for ``k * B`` (the key holds ``k``). Without ``full``, only the key, the
    inputs and the candidates are made: what a step whose verdict is cached needs."""
    batch = trace.batch
    order = _calls_needed(trace, index)
    position = {(id(t), k): i for i, (t, k) in enumerate(order)}
    placeholders, inputs, calls, keys, lines, ext_pos = [], [], [], [], [], {}
    candidates = []                 # (call, leaf, value) of size ints that are multiples of B
    for t_rec, k in order:
        func, spec, leaves, line = t_rec.records[k]
        if func is None:
            shape, dtype, device = leaves
            if line == "data":      # a batch tensor of dpfx's loader
                placeholders.append(full and loss_check.Placeholder(
                    shape, dtype, device, False, is_data=True))
                inputs.append(t_rec.leaves[_leaf_index(t_rec, k)])
                keys.append(("data", loss_steady.dim0_key(inputs[-1], batch), shape[1:], dtype,
                             device))
            else:
                placeholders.append(full and loss_check.Placeholder(
                    (None, *shape), dtype, device, True))
                inputs.append(_Output(t_rec, k))
                keys.append(("out", shape, dtype, device))
            calls.append(("in", len(placeholders) - 1))
            lines.append(None)
            continue
        descr, key = [], []
        arith = func in loss_check.SCALING
        sizes = func in loss_check.SIZE_ARGS
        for pos, d in enumerate(leaves):
            if d[0] == "e" and _followed(t_rec.externals[d[1]]):
                ext = t_rec.externals[d[1]]
                d = ("t", ext._dpfx[1], ext._dpfx[2], ext._dpfx[0])
            if d[0] == "t":
                owner = d[3] if len(d) > 3 else t_rec
                descr.append(("r", position[(id(owner), d[1])], d[2]))
                key.append(descr[-1])
            elif func is torch.Tensor.__getitem__ and pos == 1 and \
                    (k_rows := _counts_the_rows(d, t_rec, batch)) is not None:
                # Note [An index that counts the rows] (loss/check.py)
                rows = t_rec.externals[d[1]] if d[0] == "e" else None
                descr.append(("a", k_rows, torch.int64 if rows is None else rows.dtype,
                              torch.device("cpu") if rows is None else rows.device))
                key.append(descr[-1])
            elif d[0] == "e":
                if (id(t_rec), d[1]) not in ext_pos:
                    t = t_rec.externals[d[1]]
                    placeholders.append(full and loss_check.Placeholder(
                        tuple(t.shape), t.dtype, t.device, False))
                    inputs.append(t)
                    ext_pos[(id(t_rec), d[1])] = len(placeholders) - 1
                    keys.append(("ext", loss_steady.dim0_key(t, batch), tuple(t.shape[1:]),
                                 t.dtype, t.device, t.requires_grad))
                descr.append(("p", ext_pos[(id(t_rec), d[1])]))
                key.append(descr[-1])
            elif arith and pos < 2 and loss_check.is_number(d[1]):
                placeholders.append(full and loss_check.Placeholder.scalar(d[1]))
                inputs.append(d[1])
                descr.append(("p", len(placeholders) - 1))
                key.append(("s", type(d[1]).__name__, len(placeholders) - 1))
            elif sizes and batch and type(d[1]) is int and d[1] > 0 and d[1] % batch == 0:
                descr.append(("k", d[1] // batch, d[1]))
                key.append(("kB", d[1] // batch))
                candidates.append((len(calls), pos, d[1]))
            else:
                descr.append(d)
                key.append(("c", _const_key(d[1])))
        calls.append((func, spec, tuple(descr)))
        keys.append((func, spec, tuple(key), _arranged(line)))
        lines.append(line)
    program = {"calls": calls, "placeholders": placeholders, "loss": (len(order) - 1, leaf),
               "lines": lines, "candidates": candidates, "order": order}
    return program, (tuple(keys), position[(id(trace), index)], leaf), inputs


def _from_grad_scaler() -> bool:
    f = sys._getframe(3)
    for _ in range(4):
        if f is None:
            return False
        if f.f_code.co_name == "scale" and f.f_code.co_filename.endswith("grad_scaler.py"):
            return True
        f = f.f_back
    return False


class _Output:
    """An output's place among a program's inputs (its value is read only when needed)."""
    __slots__ = ("trace", "record")

    def __init__(self, trace: Trace, record: int):
        self.trace, self.record = trace, record


def _followed(t) -> bool:
    """A tracked tensor of a batch (Note [The batch's own tensors are followed too])."""
    return isinstance(t, TrackedTensor) and t._dpfx[0].data


def _leaf_index(trace: Trace, k: int) -> int:
    return sum(1 for r in trace.records[:k] if r[0] is None)


def _calls_needed(trace: Trace, index: int) -> list[tuple]:
    """(trace, record) pairs the record depends on, across traces, dependencies first."""
    order, done, stack = [], set(), [(trace, index, False)]
    while stack:
        t, k, expanded = stack.pop()
        node = (id(t), k)
        if node in done:
            continue
        if expanded:
            done.add(node)
            order.append((t, k))
            continue
        stack.append((t, k, True))
        func, _, leaves, _ = t.records[k]
        if func is None:
            continue
        for d in leaves:
            if d[0] == "t":
                stack.append((t, d[1], False))
            elif d[0] == "e" and _followed(t.externals[d[1]]):
                ext = t.externals[d[1]]
                stack.append((ext._dpfx[0], ext._dpfx[1], False))
    return order


def _analyze(program: dict, batch: int):
    """The verdict on ``program`` and which of its size ints it read as the batch size (Note
    [Python numbers in the loss] in loss/check.py)."""
    # A tensor whose dim 0 is a multiple of the batch size is per-example data; it is read as a
    # constant only when the loss cannot be replayed at all with it as per-example data (a
    # class-weight vector with as many entries as the batch has examples). A reading that
    # replays and is refused by the check is a finding: no constant reading is then tried.
    collisions = [j for j, ph in enumerate(program["placeholders"]) if not ph.is_output
                  and not ph.is_scalar and ph.shape and ph.shape[0] % batch == 0]
    first = None
    for not_batch in [frozenset()] + [frozenset({j}) for j in collisions[:_MAX_COLLISIONS]]:
        verdict, taken = _analyze_with(program, batch, not_batch)
        if not isinstance(verdict, loss_check.LossRefused):
            return verdict, _choice(program["candidates"], taken)
        first = first or verdict
        if not verdict.at_replay:
            break
    return first, _choice(program["candidates"], set())


_MAX_COLLISIONS = 4


def _choice(candidates: list, taken: set) -> tuple:
    """Which size ints a verdict read as the batch size, and the values of the others: a later
    step with the same key matches only if its other ints have the same values."""
    return tuple(None if (c[0], c[1]) in taken else c[2] for c in candidates)


def _matches(choice: tuple, candidates: list) -> bool:
    return all(fixed is None or fixed == c[2] for fixed, c in zip(choice, candidates))


def _analyze_with(program: dict, batch: int, not_batch: frozenset):
    try:
        gm, record_of, factors, taken = loss_check.replay(
            program["calls"], program["placeholders"], program["loss"], batch, not_batch)
        return loss_check.analyze(gm, program["placeholders"], record_of, factors), taken
    except loss_check.LossRefused as e:
        return e, set()
    except Exception as e:  # a shape error, an op fake tensors cannot run
        return _replay_refusal(e, program), set()


def _replay_refusal(e: Exception, program: dict) -> loss_check.LossRefused:
    call = getattr(e, "dpfx_call", None)
    func = program["calls"][call][0] if call is not None else None
    op = getattr(func, "__name__", "replay") if func is not None else "replay"
    if "data-dependent" in str(e) or "unbacked" in str(e) or type(e).__name__ in (
            "DynamicOutputShapeException", "DataDependentOutputException"):
        return loss_check.LossRefused(call, op, at_replay=True, reason=(
            "computes a value whose size or branch depends on the values of the whole batch "
            "(bincount, unique, nonzero, a Python `if` on a tensor, rows selected by a boolean "
            "mask): dpfx cannot prove it keeps examples apart, and over the batch's labels it "
            "usually does not (a class histogram). Compute per-example values only; constants "
            "such as class weights should come from the training set, not the batch. For rows "
            "selected by a mask (`loss[mask].mean()`, `x.masked_select(mask)`, "
            "`logits[mask]`), keep every row and mask it instead: `(loss * mask).sum() / "
            "mask.sum()`, or `ignore_index=` for token labels"))
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return loss_check.LossRefused(call, op, at_replay=True, reason=(
        f"could not be replayed with a symbolic batch size ({first}); a common cause is "
        f"the batch size written as a Python number in a way dpfx cannot follow (a loop "
        f"over examples, x.shape[0] in an index): write such losses with tensor ops over "
        f"dim 0 (reduction='none', then .mean() or .sum())"))


# -- the batch's tensors as model inputs ------------------------------------------------------
_ROWS: "collections.OrderedDict[Any, Any]" = collections.OrderedDict()


def check_inputs(tree: Any) -> None:
    """Each tracked batch tensor handed to the model that user code computed (not the loader's
    own tensor) keeps examples apart (``loss_check.analyze_rows``): an input standardized by the
    batch's mean, for one, would carry every example into every other's gradient, past the
    graph's proof. The same holds for an input computed from the outputs of a forward whose
    loss has not been released yet (features of the same batch, ``dp(out.detach())``); one
    computed from the outputs of a released forward (an earlier step's batch), or one into which
    such a value was written in place, is refused: those outputs were never made private, and
    they would carry another batch's examples into this step's gradients past clipping and
    noise."""
    for t in pytree.tree_leaves(tree):
        if not isinstance(t, TrackedTensor):
            if _WRITTEN and _was_written(t):
                raise PrivacyError(_EARLIER_OUTPUTS.format(where=_where()))
            continue
        trace, index, leaf = t._dpfx
        if not trace.data and (trace.released or trace.batch != (t.shape[0] if t.dim() else 0)):
            raise PrivacyError(_EARLIER_OUTPUTS.format(where=_where()))
        if trace.records[index][0] is None:
            continue
        if trace.data:
            trace.batch = t.shape[0] if t.dim() else 0
        if not trace.batch:
            continue
        program, key, _ = _program(trace, index, leaf)
        verdict = _ROWS.get(key)
        if verdict is None:
            verdict = _rows_verdict(program, trace.batch)
            _ROWS[key] = verdict
            while len(_ROWS) > _CACHE_SIZE:
                _ROWS.popitem(last=False)
        if verdict is not True:
            line = program["lines"][verdict.record] if verdict.record is not None else None
            raise PrivacyError(
                f"a model input couples examples: op {verdict.op} ({_line(line)}) {verdict.reason}. "
                f"dpfx's proof starts at the model's inputs; an input computed from the whole "
                f"batch (standardized by the batch's mean or std, mixed with other examples) "
                f"lets one example move every other example's gradient. Compute each example's "
                f"input from that example alone (statistics from the training set are fine).")


_EARLIER_OUTPUTS = (
    "a model input is computed from the outputs of an earlier step's forward, or from a tensor "
    "into which such a value was written in place ({where}): those outputs were never made "
    "private (only the clipped, noised gradient is), and they would let the examples of one "
    "batch move the gradients of another past clipping and noise. Compute the model's inputs "
    "from the batch's own data.")


def _rows_verdict(program: dict, batch: int):
    try:
        gm, record_of, factors, _ = loss_check.replay(
            program["calls"], program["placeholders"], program["loss"], batch)
        loss_check.analyze_rows(gm, program["placeholders"], record_of, factors)
        return True
    except loss_check.LossRefused as e:
        return e
    except Exception as e:
        return _replay_refusal(e, program)


def _check_autograd(loss: TrackedTensor, trace: Trace) -> None:
    # The walk stops at the tracked outputs' own autograd edges (node, output number): an
    # output retyped in place has the compiled function's node as its grad_fn, and another
    # output of that node (a weight the forward stored on a module) must still be found.
    stops = {(edge.node, edge.output_nr) for _, edge in trace.outputs.values()
             if edge is not None}
    with torch._C.DisableTorchFunctionSubclass():
        stack, seen = [(loss.grad_fn, loss.output_nr)], set()
    while stack:
        node, nr = stack.pop()
        if node is None or (node, nr) in stops or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction) and \
                node in compiled_nodes(trace.stop_nodes):
            raise PrivacyError(
                f"the loss ({_where()}) reads a tensor that dpfx's compiled forward produced "
                f"but did not return (a module attribute set during the forward, such as the "
                f"weight the deprecated nn.utils.weight_norm hook stores on its module): its "
                f"gradient enters dpfx's backward outside the checked outputs and may belong to "
                f"no example or to all of them. Compute the loss from the compiled module's "
                f"outputs only.")
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            raise PrivacyError(
                f"the loss ({_where()}) goes through a custom autograd.Function or a "
                f"torch.compile'd function ({type(node).__name__}): dpfx cannot check what its "
                f"backward does to each example's gradient. Write the loss with torch ops "
                f"outside torch.compile.")
        if type(node).__name__ == "AccumulateGrad":
            if id(node.variable) not in trace.param_ids:
                name = compiled_name(node.variable)
                if name is not None:
                    # Note [The model passed to dpfx.compile] in loss/gate.py
                    raise PrivacyError(
                        f"the loss ({_where()}) uses parameter '{name}' of the model given to "
                        f"dpfx.compile directly: the model itself was called, not the module "
                        f"dpfx.compile (or make_private) returned, so its gradient would be "
                        f"neither clipped nor noised. Call the returned model: dp_model, "
                        f"optimizer, loader, accountant = dpfx.make_private(model, ...); "
                        f"loss = fn(dp_model(x), y). Nothing was released.")
                raise PrivacyError(
                    f"the loss ({_where()}) uses a tensor that requires grad and is not a "
                    f"parameter of the dpfx-compiled model: its gradient would be neither "
                    f"clipped nor noised. Detach it, or make it a parameter of the model.")
            continue
        stack.extend(node.next_functions)


def _refusal(e: loss_check.LossRefused, program: dict) -> PrivacyError:
    line = program["lines"][e.record] if e.record is not None else program["lines"][-1]
    if e.at_replay and e.reason.startswith("could not be replayed"):
        return PrivacyError(
            f"dpfx cannot check the loss: op {e.op} ({_line(line)}) {e.reason}. Nothing was "
            f"released.")
    return PrivacyError(
        f"the loss couples examples: op {e.op} ({_line(line)}) {e.reason}. dpfx clips each "
        f"example's gradient of its own loss; a loss that mixes examples lets one example move "
        f"every other example's gradient. Compute one loss per example (reduction='none', "
        f"nothing that compares examples) and take its mean or sum over dim 0.")


# Note [A scale dpfx arranged]
# ``DPTrainer`` trains on the model's own ``labels=`` loss, which dpfx computes on the tracked
# outputs (loss/hf_labels.py): a causal LM's token mean divides by the batch's count of
# non-ignored tokens, and question answering halves the sum of two means. The check removes
# those scalars from each example's term as it removes any (Note [The per-example term] in
# loss/check.py), exactly and on every step; what DPTrainer documents and the user never wrote
# is not warned about. While ``arranging()`` is on (DPModule.forward around the labels= loss,
# when DPTrainer's step asked for it with ``arranged_by_trainer()``), each recorded call's line
# carries ``ARRANGED``; the program's key and the steady state's key hold it, so a loss the user
# writes with the same calls keeps a verdict, and a warning, of its own. In deciding whether the
# scale changed, a normalizer computed in an arranged call stands for what it replaces: a count
# for the batch size, a Python number for 1. Any other scalar still warns: a normalizer the user
# wrote, named at the line of the call that computed it (the token mean, not the last line of
# the loss: the warning once blamed accelerate's ``loss / gradient_accumulation_steps``, a
# division by 1), and a reduction other than ``loss_reduction``, named at the line of the
# term's reduction over the batch.
# (tests/hf/test_trainer_warnings.py)
ARRANGED = "arranged by dpfx"
_ARRANGING = [False]
_TRAINER_ARRANGES = [False]


@contextlib.contextmanager
def arranged_by_trainer():
    """``DPTrainer``'s step: the labels= loss dpfx computes is the trainer's arrangement."""
    before = _TRAINER_ARRANGES[0]
    _TRAINER_ARRANGES[0] = True
    try:
        yield
    finally:
        _TRAINER_ARRANGES[0] = before


@contextlib.contextmanager
def arranging():
    """Around dpfx's own labels= loss: its calls are recorded as arranged when a trainer step
    asked for it (Note [A scale dpfx arranged])."""
    before = _ARRANGING[0]
    _ARRANGING[0] = _TRAINER_ARRANGES[0]
    try:
        yield
    finally:
        _ARRANGING[0] = before


def _arranged(line) -> bool:
    return type(line) is tuple and len(line) > 2 and line[2] == ARRANGED


def _arranged_scale(verdict, lines: list, values: tuple, batch: int, reduction: str) -> bool:
    """Whether the scale changed only by normalizers computed in arranged calls, each standing
    for what it replaces (Note [A scale dpfx arranged])."""
    calls = verdict.normalizer_calls
    arranged = [c is not None and _arranged(lines[c]) for c in calls]
    if not any(arranged) or len(values) != len(calls):
        return False
    standing = tuple(
        (1.0 if i in verdict.scalar_normalizers else float(batch)) if mine else value
        for i, (mine, value) in enumerate(zip(arranged, values)))
    weights = verdict.weights
    try:
        scale = loss_check.eval_scale(verdict, batch, standing, reduction)
    finally:
        verdict.weights = weights
    return type(scale) is tuple and not scale[1]


def _scale_message(verdict, reduction: str, program: dict) -> str:
    lines = program["lines"]
    mine = sorted((i in verdict.scalar_normalizers, c)       # counts before Python numbers
                  for i, c in enumerate(verdict.normalizer_calls)
                  if c is not None and not _arranged(lines[c]))
    mine = [c for _, c in mine]
    if any(t.normalizers for t in verdict.terms):
        where = _line(lines[mine[0]] if mine else lines[-1])
        return (f"the loss ({where}) divides by a number computed from the whole batch (the "
                f"count of non-ignored tokens or mask entries): one example would change every "
                f"example's gradient. dpfx takes each example's gradient of its own sum over "
                f"its tokens instead (the loss value is unchanged)")
    terms = [c for c in verdict.term_calls if c is not None]
    where = _line(lines[terms[0]] if terms else lines[-1])
    return (f"the loss ({where}) is a {verdict.declared} over the batch, but dpfx was compiled "
            f"with loss_reduction={reduction!r}; dpfx takes each example's gradient of its own "
            f"loss, as with a {reduction} (pass loss_reduction={verdict.declared!r} to silence)")


def _caller():
    f = sys._getframe(1)
    while f is not None and _skipped(f.f_code):
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno) if f is not None else None


def _skipped(code) -> bool:
    skip = _SKIPPED.get(code)
    if skip is None:
        skip = _SKIPPED[code] = code.co_filename.startswith(_SKIP_DIRS)
        if len(_SKIPPED) > 4096:
            _SKIPPED.clear()
    return skip


_SKIPPED: dict = {}     # code object -> in torch or dpfx (the frames _caller walks past)


def _where() -> str:
    return _line(_caller())


def _line(loc) -> str:
    if loc is None:
        return "in the loss"
    text = linecache.getline(loc[0], loc[1]).strip()
    return f"{os.path.basename(loc[0])}:{loc[1]}" + (f" `{text}`" if text else "")


def _counts_the_rows(d: tuple, t_rec, batch: int) -> int | None:
    """k, where the leaf ``d`` (the first index of a ``__getitem__``: the one into dim 0) holds
    0, 1, ..., k * B - 1 and was built outside dpfx's tracking (``torch.arange(len(y))``,
    ``range(n)``); None otherwise."""
    if not batch:
        return None
    if d[0] == "c" and isinstance(d[1], range):
        r = d[1]
        n = len(r)
        return n // batch if r.start == 0 and r.step == 1 and n and n % batch == 0 else None
    if d[0] != "e":
        return None
    t = t_rec.externals[d[1]]
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.requires_grad or \
            t.dtype not in (torch.int64, torch.int32) or not t.numel() or \
            t.numel() % batch or t.device.type == "meta":
        return None
    n = t.numel()
    if not (int(t[0]) == 0 and int(t[-1]) == n - 1):
        return None
    return n // batch if torch.equal(t, torch.arange(n, dtype=t.dtype, device=t.device)) \
        else None


def _const_key(v):
    if isinstance(v, slice):
        return ("slice", v.start, v.stop, v.step)
    try:
        hash(v)
        return v
    except TypeError:
        return ("id", id(v))
