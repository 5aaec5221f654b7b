"""A resumed DPTrainer run keeps its target_epsilon (dpfx/hf/resume.py, Note [A resumed run keeps its
budget]): the steps left are calibrated after the steps taken, each segment counted with its
own noise, checked against dp_accounting directly; a plan that cannot fit is refused with the
epsilon spent. Eager backend: these tests check the accounting, not the gradients."""
import shutil

import dp_accounting
import pytest
import torch

import dpfx
from dpfx.privacy.ledger import recorded

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("dpfx.hf")

from test_trainer import args, gpt2, lm_data, quiet  # noqa: E402

TARGET, DELTA = 4.0, 1e-5


def trainer(out, max_steps, target=TARGET):
    torch.manual_seed(0)
    return hf.DPTrainer(
        model=gpt2(), args=args(out, per_device_train_batch_size=2, max_steps=max_steps,
                                save_strategy="steps", save_steps=4),
        train_dataset=lm_data(20), target_epsilon=target, target_delta=DELTA,
        sampler_generator=torch.Generator().manual_seed(1), dp_kwargs={"backend": "eager"})


def reference_epsilon(phases):
    """The composed segments' epsilon, by dp_accounting's own PLD accountant."""
    events = [dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(sigma)), n) for sigma, q, n in phases]
    return dp_accounting.pld.PLDAccountant().compose(
        dp_accounting.ComposedDpEvent(events)).get_epsilon(DELTA)


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A run planned for 4 steps, checkpointed at its end: its folder and trainer."""
    out = tmp_path_factory.mktemp("four")
    first = trainer(out, 4)
    with quiet():
        first.train()
    assert first.accountant.steps == 4
    return out, first


def test_resume_with_a_longer_plan_ends_at_or_below_the_target(four_steps, tmp_path):
    folder, first = four_steps
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    resumed = trainer(tmp_path, 8)
    sigma_plan = resumed.noise_multiplier           # calibrated for 8 steps from scratch
    assert sigma_plan > first.noise_multiplier
    with quiet():
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    q = resumed.sample_rate
    sigma_first, sigma_rest = first.noise_multiplier, resumed.noise_multiplier
    assert sigma_rest > sigma_plan      # the 4 steps left pay for the 4 taken at less noise
    phases = [(sigma_first, q, 4), (sigma_rest, q, 4)]
    assert resumed.accountant.history == phases
    assert recorded(tmp_path / hf.LEDGER_FILE) == phases        # each segment's own noise
    eps = resumed.get_epsilon()
    want = reference_epsilon(phases)
    overspent = reference_epsilon([(sigma_first, q, 4), (sigma_plan, q, 4)])
    print(f"\n4 + 4 steps: sigma {sigma_first:.4f} then {sigma_rest:.4f}, epsilon {eps:.4f} "
          f"(dp_accounting {want:.4f}); with the 8-step plan's sigma {sigma_plan:.4f} on the "
          f"last 4: {overspent:.4f}")
    assert overspent > TARGET                      # what resuming did before
    assert eps <= TARGET and want <= TARGET * (1 + 1e-3)
    assert eps == pytest.approx(want, rel=2e-3)
    assert eps == pytest.approx(TARGET, rel=0.02)                # the budget is used, not wasted
    logged = [e["epsilon"] for e in resumed.state.log_history if "loss" in e]
    assert len(logged) == 8 and max(logged) <= TARGET       # the checkpoint's 4, then 4


def test_resume_with_the_same_plan_ends_where_the_uninterrupted_run_does(tmp_path):
    stopped = trainer(tmp_path, 8)
    stopped.add_callback(_StopAt(4))
    with quiet():
        stopped.train()
    resumed = trainer(tmp_path, 8)
    with quiet():
        resumed.train(resume_from_checkpoint=True)
    sigma, q = stopped.noise_multiplier, stopped.sample_rate
    assert resumed.noise_multiplier == sigma and resumed.accountant.history == [(sigma, q, 8)]
    uninterrupted = dpfx.privacy.epsilon(noise_multiplier=sigma, sample_rate=q, steps=8,
                                         delta=DELTA)
    assert resumed.get_epsilon() == uninterrupted <= TARGET


def test_a_plan_that_cannot_fit_is_refused_with_the_epsilon_spent(four_steps, tmp_path):
    folder, first = four_steps
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    spent = first.get_epsilon()
    lower = trainer(tmp_path, 8, target=3.0)
    with pytest.raises(dpfx.PrivacyError, match=rf"at epsilon {spent:.4g} .*Raise target_epsilon"
                                                r", or plan no more than the 4 steps taken"):
        lower.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert lower.accountant.steps == 0 and recorded(tmp_path / hf.LEDGER_FILE) == \
        [(first.noise_multiplier, first.sample_rate, 4)]


class _StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def test_noise_for_steps_left_composes_the_segments():
    """Without a trainer: the planned sigma where it fits, else the smallest that does, against
    dp_accounting's composition; a spent target is refused with the figure."""
    from dpfx.privacy.budget import noise_for_steps_left

    q, spent = 0.05, [(1.0, 0.05, 30)]
    kept = noise_for_steps_left(spent, noise_multiplier=5.0, sample_rate=q, steps=30,
                                target_epsilon=10.0, delta=DELTA)
    assert kept == 5.0
    sigma = noise_for_steps_left(spent, noise_multiplier=1.0, sample_rate=q, steps=30,
                                 target_epsilon=2.5, delta=DELTA)
    assert sigma > 1.0
    assert reference_epsilon(spent + [(sigma, q, 30)]) <= 2.5 * (1 + 1e-3)
    assert reference_epsilon(spent + [(sigma * 0.99, q, 30)]) > 2.5
    eps_spent = dpfx.privacy.epsilon(noise_multiplier=1.0, sample_rate=q, steps=30, delta=DELTA)
    with pytest.raises(ValueError, match=rf"are at epsilon {eps_spent:.4g}"):
        noise_for_steps_left(spent, noise_multiplier=1.0, sample_rate=q, steps=30,
                             target_epsilon=eps_spent * 0.9, delta=DELTA)
