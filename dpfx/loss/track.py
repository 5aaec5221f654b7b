"""Following dpfx's outputs into the loss: every torch call on them recorded, at the user's line.

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
   gradient: not the model's own parameters either (Note [Every gradient a parameter receives
   is dpfx's] in grad_guards.py), nor any other;
2. the recorded calls, replayed with a symbolic batch, are a per-example sum
   (``loss_check.analyze``); the verdict is cached by the calls' structure (functions, constants,
   shapes with the batch written as a symbol), and a step whose trace records what an earlier
   one did finds it by the trace's records alone (Note [The steady-state key] in
   loss/verdict_key.py);
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

import sys
from typing import Any

import torch
import torch.utils._pytree as pytree

from dpfx.errors import PrivacyError
from dpfx.loss import (check as loss_check, replay as loss_replay,
                       verdict_key as loss_verdict_key)
from dpfx.loss.arranged import ARRANGED, ARRANGING
from dpfx.loss.backward import release
from dpfx.loss.gate import BACKWARD_CALLS, TWO_FORWARDS
from dpfx.loss.trace import Trace, Tracked, caller_site, caller_text
from dpfx.loss.trace import WRITTEN as _WRITTEN
# The tracker's surface for dpfx.api, dpfx.hf and dpfx.trl, which import these from here with
# it: the input check at the forward, and the context managers of an arranged scale.
from dpfx.loss.arranged import arranged_by_trainer, arranging  # noqa: F401
from dpfx.loss.inputs import check_inputs  # noqa: F401

_GradientEdge = torch.autograd.graph.GradientEdge
_HOOKS = {torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook}


class TrackedTensor(Tracked):
    """A tensor computed from dpfx's outputs; ``_dpfx`` is (trace, record, leaf)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in BACKWARD_CALLS:
            return release(func, args, kwargs)
        if func in _HOOKS:
            raise PrivacyError(
                f"a gradient hook on a tensor computed from dpfx's outputs ({caller_text()}) could "
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
                # for Note [Terms on their own scales] in loss/scale.py
                # (get_gradient_edge's own checks cost more than the rest of the wrapping)
                trace.outputs[len(trace.records) - 1] = (
                    tracked.detach(), _GradientEdge(grad_fn, tracked.output_nr))
            else:       # no gradient history (a mask, ids): a constant of each term
                trace.outputs[len(trace.records) - 1] = (tracked.detach(), None)
        return tracked

    if isinstance(out, torch.Tensor):
        return wrap(out)
    if is_model_output(out):
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


def untrack(tree: Any) -> Any:
    """``tree`` with tracked batch tensors as plain tensors (the model's inputs)."""
    return pytree.tree_map_only(TrackedTensor, lambda t: t.as_subclass(torch.Tensor), tree)


def is_model_output(out: Any) -> bool:
    """Whether ``out`` is a Hugging Face ModelOutput (a dict subclass; read once per type)."""
    kind = type(out)
    found = _MODEL_OUTPUTS.get(kind)
    if found is None:
        found = _MODEL_OUTPUTS[kind] = issubclass(kind, dict) and any(
            c.__name__ == "ModelOutput" and c.__module__.startswith("transformers.")
            for c in kind.__mro__)
    return found


_MODEL_OUTPUTS: dict[type, bool] = {}    # type -> a Hugging Face ModelOutput (a dict)?


def _record(func, args, kwargs, result):
    if isinstance(result, torch.Tensor):
        out_leaves, out_spec = [result], None
    elif type(result) is torch.Size:     # ``out.shape``: a tuple of ints, nothing to follow
        return result
    elif isinstance(result, (tuple, list)) and any(isinstance(r, torch.Tensor) for r in result):
        out_leaves, out_spec = pytree.tree_flatten(result)
    else:
        return result
    leaves, spec = loss_replay.flatten(args, kwargs)
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
    if forwards and func in loss_replay.SCALING and _from_grad_scaler():
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
            f"an in-place op ({caller_text()}) changes a value computed from dpfx's outputs "
            f"that an earlier op already read (or a view of it aliases): dpfx's check could not tell "
            f"the value each op saw. Write it out of place (`loss = loss * k`).")
    else:
        # a tracked tensor of another trace (a batch's, in a forward's call) is an external
        # whose own calls build_program follows
        descr = tuple([("t", a._dpfx[1], a._dpfx[2])
                       if isinstance(a, TrackedTensor) and a._dpfx[0] is trace
                       else ("e", trace.external(a)) if isinstance(a, torch.Tensor)
                       else ("c", a) for a in leaves])
        index = len(trace.records)
        line = caller_site()
        if ARRANGING[0] and line is not None:
            line = (*line, ARRANGED)        # Note [A scale dpfx arranged]
        trace.records.append((func, spec, descr, line))
        if func in loss_verdict_key.NLL_CALLS and isinstance(result, torch.Tensor):
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
                    f"dpfx does not follow ({caller_text()}): the loss could use it unchecked. "
                    f"Write it out of place (`y = y + out`, not `y += out`).")
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


def _from_grad_scaler() -> bool:
    f = sys._getframe(3)
    for _ in range(4):
        if f is None:
            return False
        if f.f_code.co_name == "scale" and f.f_code.co_filename.endswith("grad_scaler.py"):
            return True
        f = f.f_back
    return False
