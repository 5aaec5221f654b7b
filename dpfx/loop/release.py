"""The loop's checks that no graph can make: what the user's forward hands dpfx, and a training
loop that accounts nothing.

    out = dp_model(x)          # check_loop_inputs: no input requiring grad, no parameter frozen
                               # or unfrozen since compile
    loss.backward()            # the first release: warn_if_plain_trainer, when a plain
                               # transformers.Trainer drives the loop

The state of a release (one per forward, one per optimizer step, only dpfx's gradients in a
private step) has one owner, the release gate (loss/gate.py), and its Notes are there.
"""
from __future__ import annotations

import sys
import warnings

from dpfx.errors import PrivacyError, DPFXWarning


def check_loop_inputs(module, tensors: list) -> None:
    """Refusals of a training forward that the graph cannot see: an input that requires grad
    (its gradient leaves the graph unclipped), and a parameter frozen or unfrozen since compile."""
    config = module.dp_config
    if not config.allow_input_grads:
        for i, t in enumerate(tensors):
            if t.requires_grad:
                raise PrivacyError(
                    f"input {i} of the dpfx-compiled module requires grad: the gradient flowing "
                    f"back into it (and into whatever computed it, such as a trainable encoder "
                    f"upstream) is neither clipped nor noised. Compile the upstream module in (one "
                    f"dpfx.compile of a module whose forward runs both), or detach the input; if "
                    f"you need input gradients and accept that they are not private, pass "
                    f"dpfx.compile(..., allow_input_grads=True).")
    for name, p, trainable in module._trainable_at_compile:
        if p.requires_grad != trainable:
            change = "unfrozen (requires_grad=True)" if p.requires_grad else \
                "frozen (requires_grad=False)"
            raise PrivacyError(
                f"parameter '{name}' was {change} after dpfx.compile: the compiled graphs, the "
                f"clipping groups and the DPOptimizer fix the set of trainable parameters. Call "
                f"dpfx.compile again after changing requires_grad (and build a new DPOptimizer).")


class UnaccountedTrainingWarning(DPFXWarning):
    """A dpfx model trains in a plain transformers.Trainer: nothing counts epsilon."""


def warn_if_plain_trainer() -> None:
    """Called at a model's first release when no DPOptimizer counts its steps: a plain Trainer
    among the callers samples shuffled fixed-size batches (not Poisson) and keeps no accountant.
    transformers is not imported for it: a Trainer among the callers means its module was."""
    trainer = sys.modules.get("transformers.trainer")
    if trainer is None:
        return
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, trainer.Trainer) and not getattr(owner, "accounts_privacy", False):
            warnings.warn(
                "a dpfx model is training in a plain transformers.Trainer: each optimizer step "
                "is a private release, but the batches are shuffled fixed-size ones (not Poisson "
                "sampling) and nothing counts epsilon. Use dpfx.hf.DPTrainer for Poisson "
                "batches, the accountant and epsilon in the logs.",
                UnaccountedTrainingWarning, stacklevel=2)
            return
        frame = frame.f_back
