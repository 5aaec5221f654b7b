"""The batch's tensors as model inputs: each one user code computed keeps examples apart.

    x = (batch_x - batch_x.mean(0)) / batch_x.std(0)    # tracked (loss/track.py)
    dp_model(x)        # check_inputs: refused, the input couples examples

A model input computed from an earlier step's outputs, or from a tensor they were written into,
is refused too: those outputs were never made private.
"""
from __future__ import annotations

import collections
from typing import Any

import torch.utils._pytree as pytree

from dpfx.errors import PrivacyError
from dpfx.loss import check as loss_check, replay as loss_replay
from dpfx.loss.program import build_program
from dpfx.loss.trace import WRITTEN, Tracked, caller_text, site_text, was_written
from dpfx.loss.verdicts import CACHE_SIZE, replay_refusal


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
        if not isinstance(t, Tracked):
            if WRITTEN and was_written(t):
                raise PrivacyError(_EARLIER_OUTPUTS.format(where=caller_text()))
            continue
        trace, index, leaf = t._dpfx
        if not trace.data and (trace.released or trace.batch != (t.shape[0] if t.dim() else 0)):
            raise PrivacyError(_EARLIER_OUTPUTS.format(where=caller_text()))
        if trace.records[index][0] is None:
            continue
        if trace.data:
            trace.batch = t.shape[0] if t.dim() else 0
        if not trace.batch:
            continue
        program, key, _ = build_program(trace, index, leaf)
        verdict = _ROWS.get(key)
        if verdict is None:
            verdict = _rows_verdict(program, trace.batch)
            _ROWS[key] = verdict
            while len(_ROWS) > CACHE_SIZE:
                _ROWS.popitem(last=False)
        if verdict is not True:
            line = program["lines"][verdict.record] if verdict.record is not None else None
            raise PrivacyError(
                f"a model input couples examples: op {verdict.op} ({site_text(line)}) "
                f"{verdict.reason}. "
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
        gm, record_of, factors, _ = loss_replay.replay(
            program["calls"], program["placeholders"], program["loss"], batch)
        loss_check.analyze_rows(gm, program["placeholders"], record_of, factors)
        return True
    except loss_check.LossRefused as e:
        return e
    except Exception as e:
        return replay_refusal(e, program)
