"""The warm-up figure of benchmarks/first_step.py (Note [The warm-up, not the first step]): the
wall time of every step until the step time settles, less as many steady steps.

    python -m pytest -q tests/bench/test_warmup_figures.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
import first_step  # noqa: E402


def test_work_deferred_past_the_first_step_counts_in_the_warm_up():
    """A compile at step 1 (10 s) and a recompile at step 3 (4 s) over a 0.1 s steady step:
    the warm-up holds both, the steady step is 0.1 s, and the run settled after step 3."""
    times = [10.1, 0.1, 4.1] + [0.1] * 12
    assert first_step.settled(times)
    got = first_step.warmup_figures(times)
    assert abs(got["warmup"] - 14.0) < 1e-9
    assert abs(got["steady"] - 0.1) < 1e-12
    assert got["settled at"] == 4


def test_a_run_still_slowing_down_has_not_settled():
    """Too few steps, or a last window that still spreads more than the allowed spread, is not
    settled: the worker steps on."""
    assert not first_step.settled([0.1] * (first_step.MIN_STEPS - 1))
    still = [0.1] * first_step.MIN_STEPS + [0.1, 0.3, 0.1, 0.1, 0.1]
    assert not first_step.settled(still)
    assert not first_step.settled(still + [0.1])
    assert first_step.settled(still + [0.1, 0.1])
