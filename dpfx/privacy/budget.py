"""The noise of the steps a run has left, given the steps it has taken at their own noise.

    from dpfx.privacy.budget import noise_for_steps_left

    sigma = noise_for_steps_left(accountant.history, noise_multiplier=planned_sigma,
                                 sample_rate=q, steps=400, target_epsilon=4.0, delta=1e-5)

``planned_sigma`` when 400 more steps at it keep the whole run (the ``spent`` phases, then the
400) within the target, else the smallest sigma that does (Note [Calibrating the steps that
remain] in privacy/__init__.py); a ``ValueError`` with the epsilon spent where no sigma does.
``DPTrainer`` calls it before a resumed run trains (Note [A resumed run keeps its budget] in
hf/resume.py).
"""
from __future__ import annotations

from dpfx import privacy


def noise_for_steps_left(spent, *, noise_multiplier: float, sample_rate: float, steps: int,
                         target_epsilon: float, delta: float, accountant: str = "pld") -> float:
    """See the module's docstring. ``spent``: phases (noise_multiplier, sample_rate, steps)."""
    run = privacy.Accountant(accountant)
    for sigma, q, n in spent:
        run.step(noise_multiplier=sigma, sample_rate=q, n=n)
    if steps <= 0 or run.steps == 0:
        return noise_multiplier
    # the run as planned, phases merged as the accountant will record it
    planned = privacy.Accountant(accountant)
    planned.load_state_dict(run.state_dict())
    planned.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, n=steps)
    if planned.get_epsilon(delta) <= target_epsilon:
        return noise_multiplier
    spent_epsilon = run.get_epsilon(delta)
    why = "the target is spent already"
    if spent_epsilon < target_epsilon:
        try:
            return privacy.noise_multiplier(
                target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate,
                steps=steps, accountant=accountant, spent=run.history)
        except ValueError as e:
            why = str(e)
    raise ValueError(
        f"the {run.steps} steps already released (phases of noise_multiplier, sample_rate, "
        f"steps: {run.history}) are at epsilon {spent_epsilon:.4g} (delta {delta:g}), and the "
        f"{steps} steps left fit within target_epsilon={target_epsilon} at no "
        f"noise_multiplier ({why})")
