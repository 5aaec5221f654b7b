"""The loop's checks that no graph can make: what the user's forward hands dpfx, and a training
loop that accounts nothing.

    out = dp_model(x)          # check_loop_inputs: no input requiring grad, no parameter frozen
                               # or unfrozen since compile
    loss.backward()            # the first release: warn_if_plain_trainer, when a plain
                               # transformers.Trainer drives the loop
    with dpfx.public(model):   # a deliberate public phase: the model trained directly, without
        pretrain(model)        # PlainGradientWarning
    BatchSizes(D).observe(B)   # each release's batch size against expected_batch_size

The state of a release (one per forward, one per optimizer step, only dpfx's gradients in a
private step) has one owner, the release gate (loss/gate.py), and its Notes are there.
"""
from __future__ import annotations

import contextlib
import math
import sys
import warnings

import torch

from dpfx.errors import PrivacyError, DPFXWarning
from dpfx.loss.gate import gates_of, warn_at_caller


def check_loop_inputs(config, trainable_at_compile: list, tensors: list,
                      unchanged: bool = False) -> None:
    """Refusals of a training forward that the graph cannot see: an input that requires grad
    (its gradient leaves the graph unclipped), and a parameter frozen or unfrozen since compile
    (``trainable_at_compile``: each parameter's (name, parameter, requires_grad) then;
    ``unchanged``: the caller has compared every parameter's requires_grad with it)."""
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
    if unchanged:
        return
    for name, p, trainable in trainable_at_compile:
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


@contextlib.contextmanager
def public(model: torch.nn.Module):
    """A deliberate public phase of a compiled model (pre-training on public data): inside it,
    ``model`` (or the module dpfx.compile returned for it) trains with plain gradients and no
    ``PlainGradientWarning`` is raised (Note [The model passed to dpfx.compile] in loss/gate.py).
    Nothing private changes: dpfx's own forward and backward still clip and noise, and
    ``DPOptimizer.step()`` still refuses a plain gradient, so step the public phase with a torch
    optimizer and ``zero_grad()`` before the private phase."""
    with contextlib.ExitStack() as phases:
        for gate in gates_of(model.parameters()):
            phases.enter_context(gate.public())
        yield


# Note [Batch sizes far from expected_batch_size]
# With loss_reduction="mean" and expected_batch_size=D the release is divided by D, whatever the
# batch's size: batches of 32 under D=256 give gradients 8x too small, silently. Under Poisson
# sampling a batch's size is Binomial(N, q) with mean D and variance D(1 - q) <= D, so the mean
# of n sizes has standard deviation at most sqrt(D / n). The sizes are tested at n = 8, 16, 32,
# ... (a handful of tests over any run, so their false alarms do not add up): the warning needs
# the mean more than 6 of those deviations from D *and* more than 20% away from it. A single
# batch, small or empty, never warns. dpfx's own Poisson loader fails a test with probability
# 1.2e-6 at worst (D = 1, n = 8, the Poisson tail, which bounds the binomial's), below 1.3e-7
# from D = 2 or n = 16 on. One integer sum per release; the test itself runs at those n only.
# (tests/loop/test_mis_setups.py)
class BatchSizeWarning(DPFXWarning):
    """The batches are far from expected_batch_size, which divides the private gradient."""


class BatchSizes:
    """The sizes of the releases of one model, tested against D (Note [Batch sizes far from
    expected_batch_size])."""

    def __init__(self, expected: int):
        self.expected = expected
        self.count = 0
        self.total = 0
        self._next_test = 8

    def observe(self, size: int) -> None:
        self.count += 1
        self.total += size
        if self.count == self._next_test:
            self._next_test = 2 * self.count if self._test() else 0

    def _test(self) -> bool:
        """False once it has warned (no more tests)."""
        mean, d = self.total / self.count, self.expected
        std = math.sqrt(d / self.count)
        if abs(mean - d) <= max(6 * std, 0.2 * d):
            return True
        warn_at_caller(
            f"the batches are far from expected_batch_size={d}: {self.count} batches averaged "
            f"{mean:.1f} examples, where Poisson sampling at that expected size gives {d} +- "
            f"{std:.2g}. The private gradient is divided by expected_batch_size, not by the "
            f"batch's size, so each step's gradient is {mean / d:.3g}x what a mean over the batch "
            f"would give, and the noise is sized for batches of {d}. Pass expected_batch_size = "
            f"q * N for the sampling rate q (dpfx.expected_batch_size(N, q)), and sample the "
            f"batches with dpfx.poisson_loader(dataset, q), which that divisor and the "
            f"accountant assume.", BatchSizeWarning)
        return False
