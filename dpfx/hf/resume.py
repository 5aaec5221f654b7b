"""What a ``DPTrainer`` checkpoint holds beside Trainer's, and how a resumed run keeps counting.

    trainer = dpfx.hf.DPTrainer(model=model, args=args, train_dataset=train,
                                target_epsilon=8.0, max_grad_norm=1.0)
    trainer.train(resume_from_checkpoint=True)
    # out/checkpoint-500/dp_accountant.json: the accountant, sigma, q, delta, epsilon, C_t
    # out/privacy.ledger: every step released, written before its update

Each checkpoint gets ``ACCOUNTANT_FILE`` (``CheckpointAccountant``), readable without torch;
Trainer's ``optimizer.pt`` carries the accountant too (inside ``DPOptimizer``'s state). On
resume the accountant counts the longer of the two records and of the privacy ledger
(``restore_accountant``, ``spent_phases``), and with ``target_epsilon`` the noise of the steps
left is fitted to what is spent (``noise_for_resume``, Note [A resumed run keeps its budget]).
"""
from __future__ import annotations

import contextlib
import json
import os

import torch
from transformers import TrainerCallback

from dpfx.errors import PrivacyError
from dpfx.loop.users import PerUser
from dpfx.privacy.budget import noise_for_steps_left
from dpfx.privacy.ledger import recorded as ledger_recorded

ACCOUNTANT_FILE = "dp_accountant.json"
LEDGER_FILE = "privacy.ledger"


class CheckpointAccountant(TrainerCallback):
    """Writes the accountant next to each checkpoint Trainer saves (atomically: a temporary
    file, synced, then renamed)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        trainer = self.trainer
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if args.should_save and os.path.isdir(folder):     # rank 0 writes the shared file
            clip = getattr(trainer.model, "adaptive_clip", None)
            record = {"accountant": trainer.accountant.state_dict(),
                      "noise_multiplier": trainer.noise_multiplier,
                      "sample_rate": trainer.sample_rate, "delta": trainer.delta,
                      "privacy_unit": trainer.privacy_unit,
                      "epsilon": trainer.get_epsilon(), "steps": trainer.accountant.steps,
                      "adaptive_clip": None if clip is None else clip.state_dict()}
            tmp = os.path.join(folder, ACCOUNTANT_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(record, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(folder, ACCOUNTANT_FILE))
        return control


def restore_accountant(accountant, checkpoint) -> None:
    """After Trainer loaded ``optimizer.pt`` (the accountant inside ``DPOptimizer``'s state):
    the checkpoint's ``ACCOUNTANT_FILE`` where it counts more steps. A checkpoint without the
    file was not written by DPTrainer, and is refused."""
    if checkpoint is None:
        return
    path = os.path.join(checkpoint, ACCOUNTANT_FILE)
    if not os.path.isfile(path):
        raise PrivacyError(f"{checkpoint} has no {ACCOUNTANT_FILE}: it was not written by "
                           f"DPTrainer, and epsilon could not keep counting from it")
    with open(path) as f:
        saved = json.load(f)["accountant"]
    if sum(phase[2] for phase in saved["history"]) > accountant.steps:
        # optimizer.pt counts fewer steps than were released: never count fewer
        accountant.load_state_dict(saved)


@contextlib.contextmanager
def users_model(trainer):
    """Trainer's saving and loading see the user's model (``save_pretrained``-loadable, its
    tied weights re-tied on load), not dpfx's wrapper around it."""
    wrapper = trainer.model
    inner = wrapper._orig_mod
    trainer.model = inner.module if isinstance(inner, PerUser) else inner
    try:
        yield
    finally:
        trainer.model = wrapper


# Note [A resumed run keeps its budget]
# With ``target_epsilon``, sigma is calibrated at construction for the whole plan, as if
# no step had been taken. A run that continues steps already released (resumed from a
# checkpoint, or from the privacy ledger's count) would then spend more than the target
# whenever its plan grew: 4 steps at the sigma of a 4-step plan, then 4 at the sigma of an
# 8-step plan, ended at epsilon 4.45 for a target of 4.0. Before training, the steps the run
# continues from (the longer of the checkpoint's accountant and the ledger, which the
# optimizer then reconciles to) and the steps left of the plan (Trainer's max_steps less
# the checkpoint's global step) are known. If the compiled sigma keeps the whole run at or
# below the target (a resumed run with its plan unchanged: the uninterrupted run's sigma and
# epsilon), it stays; else the steps left are calibrated as a phase composed after the
# spent ones (Note [Calibrating the steps that remain] in privacy/__init__.py) and the model
# is compiled again with that sigma, the only place it can change (the compiled model and
# the DPOptimizer fix it). The accountant and the ledger record each step with the sigma of
# the model that released it, so each segment is counted with its own noise. Where no sigma
# fits, training is refused with the epsilon already spent.
# (tests/hf/test_trainer_budget.py)
def noise_for_resume(trainer, checkpoint) -> float:
    """The noise multiplier of the steps ``trainer`` has left when resumed from
    ``checkpoint`` (a folder, or None for a fresh run): its own where the whole run stays
    within ``target_epsilon``, else the smallest that does; a ``PrivacyError`` where none
    does."""
    if trainer.target_epsilon is None or trainer.plan.strategy is not None \
            or trainer.plan.sampler != "poisson":
        # a correlated mechanism's strategy and accountant are built for the planned steps
        # and one sigma: the checkpoint's accountant refuses another plan when loaded
        return trainer.noise_multiplier
    taken = _steps_taken(checkpoint)
    try:
        return noise_for_steps_left(
            spent_phases(trainer, checkpoint), noise_multiplier=trainer.noise_multiplier,
            sample_rate=trainer.sample_rate, steps=trainer.planned_steps() - taken,
            target_epsilon=trainer.target_epsilon, delta=trainer.delta,
            accountant=trainer.accountant.accountant)
    except ValueError as e:
        raise PrivacyError(
            f"DPTrainer cannot keep target_epsilon={trainer.target_epsilon} over its plan of "
            f"{trainer.planned_steps()} steps: {e}. Raise target_epsilon, or plan no more than "
            f"the {taken} steps taken (max_steps={taken})") from None


def _steps_taken(checkpoint) -> int:
    """The global step of Trainer's state in ``checkpoint`` (0 without one)."""
    if not isinstance(checkpoint, str):
        return 0
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_callback import TrainerState

    state = os.path.join(checkpoint, TRAINER_STATE_NAME)
    return TrainerState.load_from_json(state).global_step if os.path.isfile(state) else 0


def spent_phases(trainer, checkpoint) -> list:
    """The steps the run continues from, as the accountant will hold them once the optimizer
    is built and the checkpoint loaded (the longer record: ``privacy/ledger.reconcile``)."""
    records = [trainer.accountant.history]
    if isinstance(checkpoint, str):
        path = os.path.join(checkpoint, ACCOUNTANT_FILE)
        if os.path.isfile(path):
            with open(path) as f:
                records[0] = [tuple(p) for p in json.load(f)["accountant"]["history"]]
    if trainer.ledger is not None:
        records.append(ledger_recorded(trainer.ledger))
    spent = [max(records, key=lambda phases: sum(p[2] for p in phases))]
    if trainer.world > 1:      # rank 0's files: every rank calibrates the same sigma
        torch.distributed.broadcast_object_list(spent, src=0)
    return spent[0]
