"""DP-SGD through Hugging Face's ``transformers.Trainer``: ``dpfx.hf.DPTrainer``.

    import dpfx.hf
    trainer = dpfx.hf.DPTrainer(model=model, args=args, train_dataset=train,
                                target_epsilon=8.0, max_grad_norm=1.0)
    trainer.train()          # epsilon logged with the loss and in the final metrics

One module a concern (README.md beside this file):

- trainer.py: ``DPTrainer``, what changes against a plain Trainer (the compiled model, Poisson
  batches, gradient accumulation as a virtual batch, the DP optimizer, epsilon in the logs);
- resume.py: what its checkpoints hold beside Trainer's and how a resumed run keeps counting
  and keeps its budget (``ACCOUNTANT_FILE``, ``LEDGER_FILE``);
- users.py: the user as the privacy unit (Note [DPTrainer at the user level]);
- ranks.py: a launch over several processes (Note [DPTrainer over several processes]).
"""
from dpfx.hf.resume import ACCOUNTANT_FILE, LEDGER_FILE
from dpfx.hf.trainer import DPTrainer
from dpfx.loop.checks import UnaccountedTrainingWarning

__all__ = ["DPTrainer", "ACCOUNTANT_FILE", "LEDGER_FILE", "UnaccountedTrainingWarning"]
