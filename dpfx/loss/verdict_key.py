"""The loss verdicts' cache keyed by the trace's records, the loss check's steady state: a step
whose recorded loss is one already proven reuses the verdict without rebuilding its program, and
reads a token mean's count where the loss's own kernel left it.

    for x, y in loader:
        F.cross_entropy(dp(x), y).backward()   # step 1: replayed and proven (loss/check.py);
                                               # later steps: one lookup by the trace's records

# Note [The steady-state key]
``loss/backward.py`` proves a loss from its *program* (the recorded calls it depends on,
renumbered, with the batch written as a symbol) and caches the verdict by the program's
structure. Building that key walks the calls on every step. The steady-state key is made from
what the trace already holds, with no walk: every record of the forward's trace as recorded
(each call's function, argument structure, constants by value, which earlier record or which
external tensor each tensor argument is, the user's line), the loss's place among them, and for
each external tensor its dim 0 as a multiple of the batch, its other sizes, dtype, device and
whether it requires grad (a batch tensor of dpfx's loader as such, only where it is the loader's
own tensor; one user code computed from it has calls of its own, and the step takes the full
path). Two steps with equal keys record the same calls on the same kinds of tensors, so they
have the same program up to its Python numbers' values and the batch size: the program cache's
key is a function of this one and the batch size (it drops the records the loss does not need
and the numbers' values, and writes a size int that is a multiple of the batch as that
multiple), and the proof holds for every value of the batch symbol. A verdict proven where no
size int was a multiple of the batch read each as written, which is the call the user makes at
any batch size: it serves every batch size. One proven where some were (a vocabulary size at a
batch of one, ``logits.reshape(-1, V)``) may have read one of them as the batch size, a reading
another batch size would not make: it serves only the batch size it was proven at, where the
same records give the same program, the same size ints and so the same verdict as the full
path; a step at another batch size takes the full path. The key is finer than the program's:
a step that misses takes the full path, which proves or refuses as before. So a loss changed on
step 100 (a batch statistic added, another label tensor, the same calls on another line) is
checked on step 100. What is not in the key is checked on every step as before: the autograd
walk (loss/backward.py), a poisoned trace (two forwards, GradScaler), tensors written from
detached outputs (any such tensor sends every step down the full path), the empty batch. Only
verdicts whose scale needs no evaluation of the program are kept here (no Python number among
the normalizers, every normalizer a token count of Note [A token mean's count]); the others take
the full path every step. At most _CACHE_SIZE keys, least recently used dropped first.
(tests/loss/test_loss_check.py::test_steady_state_switch_to_a_leaking_loss_is_refused,
tests/loss/test_loss_check.py::test_steady_state_of_a_size_int_read_as_the_batch)

# Note [A token mean's count]
A token mean (``F.cross_entropy(logits, y)`` with ignored labels) divides by N, the count of
non-ignored labels; the per-example term removes it (Note [The per-example term] in
loss/check.py), so N is needed on every step. ``nll_loss`` computes it in its forward and saves
it on its autograd node (``total_weight``, the sum of the weights of the non-ignored targets,
the count without a weight), which is the value of the normalizer the check found inside that
call: for a mean ``cross_entropy`` or ``nll_loss`` without label smoothing, that call's only
division by a value of the batch is the one by total_weight, in torch's decomposition as in its
kernel. The count is read from the node the recorded call's result carries (``Trace.nodes``),
never searched for in the graph; when the verdict is first proven, the read value must equal
the evaluated normalizer, else the loss stays on the full path.
"""
from __future__ import annotations

import collections
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from dpfx.loss import replay as loss_replay

_CACHE_SIZE = 256
_NLL_NODES = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})
NLL_CALLS = {F.cross_entropy: inspect.signature(F.cross_entropy),
             F.nll_loss: inspect.signature(F.nll_loss)}
_MEAN = 1       # nll_loss's Reduction::Mean, as its node saves it
_TENSOR = object()

# key -> (verdict, for each normalizer the record whose node holds it, the batch size it serves
# or None for every one)
_STEADY: "collections.OrderedDict[Any, tuple]" = collections.OrderedDict()
counters = collections.Counter()     # "hit": steps that took the steady state


def key(trace, index: int, leaf: int, externals: list) -> tuple | None:
    """Note [The steady-state key]; None where the step must take the full path.
    ``externals``: for each tensor the loss read from outside the trace, None for a plain
    tensor, else the record of dpfx's loader that made it (loss/track.py's ``origin``)."""
    batch = trace.batch
    described = []
    for t, record in zip(trace.externals, externals):
        if record is None:
            described.append((dim0_key(t, batch), t.shape[1:], t.dtype, t.device,
                              t.requires_grad))
            continue
        func, _, leaves, _ = record
        if func is not None:    # computed from the batch: the full path follows its calls
            return None
        shape, dtype, device = leaves
        described.append(("data", dim0_key(shape, batch), shape[1:], dtype, device))
    return (tuple(trace.records), index, leaf, tuple(described))


def lookup(found: tuple, trace) -> tuple | None:
    """The verdict and this step's normalizer values, or None (take the full path)."""
    try:
        entry = _STEADY.get(found)
    except TypeError:           # a constant without a hash (a slice: `out[:, :-1]`)
        found = _hashable_key(found)
        entry = _STEADY.get(found) if found is not None else None
    if entry is None:
        return None
    verdict, sources, batch = entry
    if batch is not None and batch != trace.batch:
        return None
    values = tuple(_total_weight(trace.nodes.get(k)) for k in sources)
    if None in values:
        return None
    _STEADY.move_to_end(found)
    counters["hit"] += 1
    return verdict, values


def store(found: tuple, verdict, program: dict, values: tuple, trace) -> None:
    """Keep a verdict the full path proved and released, if its scale can be had without the
    program: every normalizer a token count of Note [A token mean's count] that equals its
    evaluated value ``values``; for this batch size only where a size int was a multiple of it."""
    if verdict.scalar_normalizers:
        return
    sources = []
    for call, value in zip(verdict.normalizer_calls, values):
        if call is None:
            return
        owner, k = program["order"][call]
        if owner is not trace or k in sources or not _mean_nll(*program["calls"][call]):
            return
        if _total_weight(trace.nodes.get(k)) != float(value):
            return
        sources.append(k)
    try:
        hash(found)
    except TypeError:
        found = _hashable_key(found)
        if found is None:
            return
    _STEADY[found] = (verdict, tuple(sources), trace.batch if program["candidates"] else None)
    _STEADY.move_to_end(found)
    while len(_STEADY) > _CACHE_SIZE:
        _STEADY.popitem(last=False)


def _mean_nll(func, spec, descr) -> bool:
    """A recorded ``cross_entropy`` or ``nll_loss`` with the mean over its targets and no label
    smoothing (Note [A token mean's count])."""
    signature = NLL_CALLS.get(func)
    if signature is None:
        return False
    args, kwargs = loss_replay.unflatten([d[1] if d[0] == "c" else _TENSOR for d in descr], spec)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return False
    bound.apply_defaults()
    a = bound.arguments
    return (a["reduction"] == "mean" and a["size_average"] is None and a["reduce"] is None
            and a.get("label_smoothing", 0.0) == 0.0)


def _total_weight(node) -> float | None:
    if node is None or type(node).__name__ not in _NLL_NODES or node._saved_reduction != _MEAN:
        return None
    return float(node._saved_total_weight)


def dim0_key(t, batch: int):
    """dim 0 (of a tensor or a shape) as a multiple of the batch where it is one (Note [Which
    inputs of the loss carry the batch] in loss/replay.py), so that one verdict serves every
    batch size."""
    shape = t.shape if isinstance(t, torch.Tensor) else t
    if len(shape) == 0:
        return ()
    n = shape[0]
    return ("kB", n // batch) if batch and n % batch == 0 else ("n", n) if batch else ("B=0", n)


def _hashable_key(found: tuple) -> tuple | None:
    """``found`` with its slices as tuples; None if another constant has no hash."""
    records = tuple((func, spec, tuple(("c", ("slice", d[1].start, d[1].stop, d[1].step))
                                       if d[0] == "c" and type(d[1]) is slice else d
                                       for d in descr), line) if func is not None else
                    (func, spec, descr, line) for func, spec, descr, line in found[0])
    found = (records, *found[1:])
    try:
        hash(found)
    except TypeError:
        return None
    return found
