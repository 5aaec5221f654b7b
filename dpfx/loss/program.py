"""The loss's program: the recorded calls a loss depends on, renumbered for replay, and its key.

    program, key, inputs = build_program(trace, index, leaf)
    loss_replay.replay(program["calls"], program["placeholders"], program["loss"], batch)

The calls are followed across traces (a forward's outputs and the loader's batch tensors, Note
[The batch's own tensors are followed too] in loss/track.py); the key is the calls' structure
(functions, constants, shapes with the batch as a symbol), what the verdict cache is keyed by.
"""
from __future__ import annotations

import torch

from dpfx.loss import replay as loss_replay, verdict_key as loss_verdict_key
from dpfx.loss.arranged import is_arranged
from dpfx.loss.trace import Output, Trace, followed


def build_program(trace: Trace, index: int, leaf: int, full: bool = True
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
                placeholders.append(full and loss_replay.Placeholder(
                    shape, dtype, device, False, is_data=True))
                inputs.append(t_rec.leaves[_leaf_index(t_rec, k)])
                keys.append(("data", loss_verdict_key.dim0_key(inputs[-1], batch), shape[1:], dtype,
                             device))
            else:
                placeholders.append(full and loss_replay.Placeholder(
                    (None, *shape), dtype, device, True))
                inputs.append(Output(t_rec, k))
                keys.append(("out", shape, dtype, device))
            calls.append(("in", len(placeholders) - 1))
            lines.append(None)
            continue
        descr, key = [], []
        arith = func in loss_replay.SCALING
        sizes = func in loss_replay.SIZE_ARGS
        for pos, d in enumerate(leaves):
            if d[0] == "e" and followed(t_rec.externals[d[1]]):
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
                    placeholders.append(full and loss_replay.Placeholder(
                        tuple(t.shape), t.dtype, t.device, False))
                    inputs.append(t)
                    ext_pos[(id(t_rec), d[1])] = len(placeholders) - 1
                    keys.append(("ext", loss_verdict_key.dim0_key(t, batch), tuple(t.shape[1:]),
                                 t.dtype, t.device, t.requires_grad))
                descr.append(("p", ext_pos[(id(t_rec), d[1])]))
                key.append(descr[-1])
            elif arith and pos < 2 and loss_replay.is_number(d[1]):
                placeholders.append(full and loss_replay.Placeholder.scalar(d[1]))
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
        keys.append((func, spec, tuple(key), is_arranged(line)))
        lines.append(line)
    program = {"calls": calls, "placeholders": placeholders, "loss": (len(order) - 1, leaf),
               "lines": lines, "candidates": candidates, "order": order}
    return program, (tuple(keys), position[(id(trace), index)], leaf), inputs


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
            elif d[0] == "e" and followed(t.externals[d[1]]):
                ext = t.externals[d[1]]
                stack.append((ext._dpfx[0], ext._dpfx[1], False))
    return order


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
