"""DPTrainer with a correlated-noise mechanism: the plan (privacy/plan.py) builds its strategy for
Trainer's max_steps, its loader is the plan's cyclic Poisson sampler, its DPOptimizer adds the
strategy's noise, and its accountant counts each step as the strategy's."""
import pytest
import torch

import dpfx
from dpfx.privacy import matrix_accounting

hf = pytest.importorskip("dpfx.hf")

from test_trainer import args, gpt2, lm_data, quiet  # noqa: E402


def test_dp_trainer_trains_a_banded_mechanism_for_its_planned_steps(tmp_path):
    torch.manual_seed(0)
    trainer = hf.DPTrainer(
        model=gpt2(), args=args(tmp_path, per_device_train_batch_size=4, max_steps=6),
        train_dataset=lm_data(24), target_epsilon=8.0, target_delta=1e-5,
        mechanism=dpfx.Mechanism("bandmf", bands=3),
        sampler_generator=torch.Generator().manual_seed(1))
    assert trainer.plan.strategy.steps == 6 and trainer.plan.parts == 3
    assert isinstance(trainer.accountant, matrix_accounting.MatrixAccountant)
    with quiet():
        trainer.train()
    assert trainer.accountant.steps == 6
    assert trainer.dp_optimizer.noise_variance > 0
    assert trainer.get_epsilon() <= 8.0 * (1 + 1e-6)
    # the strategy refuses a seventh step: the plan covered six
    with pytest.raises(dpfx.PrivacyError, match="was built for 6 steps and this is step 7"):
        trainer.dp_optimizer.step()


def test_dp_trainer_refuses_a_correlated_mechanism_over_users(tmp_path):
    data = lm_data(24)
    with pytest.raises(ValueError, match="user-level DP"):
        hf.DPTrainer(model=gpt2(), args=args(tmp_path, per_device_train_batch_size=4,
                                             max_steps=4),
                     train_dataset=data, noise_multiplier=1.0, mechanism="blt",
                     user_ids=[i // 2 for i in range(24)], max_examples_per_user=2)
