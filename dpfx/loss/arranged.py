"""The loss's scale warnings, and the scales dpfx arranged for a trainer, which warn of nothing.

    with arranged_by_trainer():          # DPTrainer's step
        with arranging():                # around dpfx's own labels= loss (DPModule.forward)
            loss = causal_lm_loss(out, labels)     # recorded calls carry ARRANGED

A loss whose scale dpfx changes (a token mean's count, a reduction other than
``loss_reduction``) is warned of once (``LossScaleWarning``, ``scale_message``); a normalizer
computed in an arranged call stands for what it replaces (Note [A scale dpfx arranged]).
"""
from __future__ import annotations

import contextlib

from dpfx.errors import DPFXWarning
from dpfx.loss import scale as loss_scale
from dpfx.loss.trace import site_text


class LossScaleWarning(DPFXWarning):
    """dpfx changed the scale of the loss's gradient (loss/check.py)."""


# The scale warnings given, by their text. A loss is warned of once per process: its verdict
# carries a flag too, but a batch size that keys the program apart (a batch of 1, whose rows
# cannot be told from a broadcast) or a step off the steady path analyzes it afresh.
WARNED: set[str] = set()


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


ARRANGING = [False]


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
    before = ARRANGING[0]
    ARRANGING[0] = _TRAINER_ARRANGES[0]
    try:
        yield
    finally:
        ARRANGING[0] = before


def is_arranged(line) -> bool:
    return type(line) is tuple and len(line) > 2 and line[2] == ARRANGED


def arranged_scale(verdict, lines: list, values: tuple, batch: int, reduction: str) -> bool:
    """Whether the scale changed only by normalizers computed in arranged calls, each standing
    for what it replaces (Note [A scale dpfx arranged])."""
    calls = verdict.normalizer_calls
    arranged = [c is not None and is_arranged(lines[c]) for c in calls]
    if not any(arranged) or len(values) != len(calls):
        return False
    standing = tuple(
        (1.0 if i in verdict.scalar_normalizers else float(batch)) if mine else value
        for i, (mine, value) in enumerate(zip(arranged, values)))
    weights = verdict.weights
    try:
        scale = loss_scale.eval_scale(verdict, batch, standing, reduction)
    finally:
        verdict.weights = weights
    return type(scale) is tuple and not scale[1]


def scale_message(verdict, reduction: str, program: dict) -> str:
    lines = program["lines"]
    mine = sorted((i in verdict.scalar_normalizers, c)       # counts before Python numbers
                  for i, c in enumerate(verdict.normalizer_calls)
                  if c is not None and not is_arranged(lines[c]))
    mine = [c for _, c in mine]
    if any(i not in verdict.scalar_normalizers for t in verdict.terms for i, _ in t.normalizers):
        where = site_text(lines[mine[0]] if mine else lines[-1])
        return (f"the loss ({where}) divides by a number computed from the whole batch (the "
                f"count of non-ignored tokens or mask entries): one example would change every "
                f"example's gradient. dpfx takes each example's gradient of its own sum over "
                f"its tokens instead (the loss value is unchanged)")
    terms = [c for c in verdict.term_calls if c is not None]
    where = site_text(lines[terms[0]] if terms else lines[-1])
    # the scale changed, so the loss's reduction is the other one; ``declared`` also counts a
    # Python number's power, which the warning reads only where it is the batch size's (Note
    # [A constant factor is no change of scale] in loss/scale.py)
    declared = verdict.declared if verdict.declared != reduction else \
        {"mean": "sum", "sum": "mean"}[reduction]
    return (f"the loss ({where}) is a {declared} over the batch, but dpfx was compiled "
            f"with loss_reduction={reduction!r}; dpfx takes each example's gradient of its own "
            f"loss, as with a {reduction} (pass loss_reduction={declared!r} to silence)")
