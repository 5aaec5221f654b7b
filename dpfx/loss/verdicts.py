"""The loss check's verdicts: a program analyzed, and the verdicts cached by its key.

    verdict = lookup(key, program["candidates"])
    if verdict is None:
        verdict, choice = analyze(program, batch)      # loss_replay.replay, then analyze
        store(key, choice, verdict)

A verdict is a ``loss_check`` verdict or the ``LossRefused`` that says why not; a size int the
analysis read as the batch size is part of the choice a later step must match (Note [Python
numbers in the loss] in loss/check.py). ``forget()`` drops every cached verdict.
"""
from __future__ import annotations

import collections
from typing import Any

from dpfx.loss import (arranged, check as loss_check, replay as loss_replay,
                       verdict_key as loss_verdict_key)


def forget() -> None:
    """Drop every cached loss verdict, steady-state entry and given warning: the next loss is
    analyzed, and warned of, as in a new process."""
    _VERDICTS.clear()
    loss_verdict_key._STEADY.clear()
    arranged.WARNED.clear()


# The verdicts, by the program's structure: at most CACHE_SIZE keys, least recently used
# dropped first; each key holds the verdicts of its choices of size ints (usually one).
_VERDICTS: "collections.OrderedDict[Any, list]" = collections.OrderedDict()


CACHE_SIZE = 256


def lookup(key, candidates: list):
    entries = _VERDICTS.get(key)
    if entries is None:
        return None
    _VERDICTS.move_to_end(key)
    for choice, verdict in entries:
        if _matches(choice, candidates):
            return verdict
    return None


def store(key, choice: tuple, verdict) -> None:
    entries = _VERDICTS.setdefault(key, [])
    entries.append((choice, verdict))
    del entries[:-8]
    _VERDICTS.move_to_end(key)
    while len(_VERDICTS) > CACHE_SIZE:
        _VERDICTS.popitem(last=False)


def analyze(program: dict, batch: int):
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
        gm, record_of, factors, taken = loss_replay.replay(
            program["calls"], program["placeholders"], program["loss"], batch, not_batch)
        return loss_check.analyze(gm, program["placeholders"], record_of, factors), taken
    except loss_check.LossRefused as e:
        return e, set()
    except Exception as e:  # a shape error, an op fake tensors cannot run
        return replay_refusal(e, program), set()


def replay_refusal(e: Exception, program: dict) -> loss_check.LossRefused:
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
