"""The correlation state on its own (dpfx/loop/correlated.py): each recursion's w equals the dense
C^{-1} Z, its float32 drift is at float32's rounding, it keeps only its window, a checkpoint
continues the same sequence, and step n + 1 of an n-step strategy is refused."""
import inspect

import pytest
import torch

from dpfx.errors import PrivacyError
from dpfx.loop.correlated import STATE_DTYPE, CorrelatedNoise
from dpfx.privacy.recursion import BLTRecursion, ToeplitzRecursion
from support import mf_strategy

KINDS = sorted(mf_strategy.ALL)


def _reference(mechanism, z: torch.Tensor) -> torch.Tensor:
    """C^{-1} Z by a dense triangular solve in float64, for the steps z has."""
    return mechanism.rec.inverse_matrix(z.shape[0]) @ z.to(torch.float64)


@pytest.mark.parametrize("kind", KINDS)
def test_each_recursion_releases_the_rows_of_c_inverse(kind):
    steps = 24
    mechanism = mf_strategy.ALL[kind](steps)
    z = torch.randn(steps, 500, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    state = CorrelatedNoise(mechanism.recursion(), steps, name=mechanism.name,
                            dtype=torch.float64)
    got = torch.stack([state.step(z[t]) for t in range(steps)])
    torch.testing.assert_close(got, _reference(mechanism, z), rtol=1e-12, atol=1e-12)
    assert state.t == steps
    # the window it keeps: k - 1 vectors w, d BLT buffers, every earlier w of a dense C
    kept = state.state_dict()["buffers"]
    assert kept.shape == ({"toeplitz3": 2, "blt2": 2, "dense": steps - 1}[kind], 500), kept.shape


def test_the_recursions_float64_error():
    """Note [The correlation state is kept in float32]: over 500 steps, the float32 state's w
    stays within float32's rounding of the float64 C^{-1} Z (relative L2 error per step), for
    a 4-band Toeplitz strategy and a slow BLT (theta 0.99)."""
    assert STATE_DTYPE == torch.float32
    steps = 500
    z = torch.randn(steps, 2000, generator=torch.Generator().manual_seed(2))
    for rec, bound in [(ToeplitzRecursion((1.0, 0.9, 0.7, 0.4)), 2e-7),
                       (BLTRecursion(1.0, (0.99, 0.6), (0.5, 0.3)), 2e-7)]:
        mechanism = mf_strategy.StandIn("x", steps, rec)
        state = CorrelatedNoise(rec, steps)
        got = torch.stack([state.step(z[t]) for t in range(steps)])
        assert got.dtype == torch.float32
        ref = _reference(mechanism, z)
        error = ((got.double() - ref).norm(dim=1) / ref.norm(dim=1)).max()
        assert float(error) < bound, (rec, float(error))


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_continues_the_same_sequence(kind):
    steps = 8
    mechanism = mf_strategy.ALL[kind](steps)
    z = torch.randn(steps, 300, generator=torch.Generator().manual_seed(3))
    whole = CorrelatedNoise(mechanism.recursion(), steps, name=mechanism.name)
    expected = [whole.step(z[t]) for t in range(steps)]
    first = CorrelatedNoise(mechanism.recursion(), steps, name=mechanism.name)
    got = [first.step(z[t]) for t in range(3)]
    saved = first.state_dict()
    assert saved["t"] == 3
    resumed = CorrelatedNoise(mechanism.recursion(), steps, name=mechanism.name)
    resumed.load_state_dict(saved)
    got += [resumed.step(z[t]) for t in range(3, steps)]
    for t in range(steps):
        assert torch.equal(got[t], expected[t]), t


def test_step_n_plus_one_is_refused_with_the_strategy_named():
    state = CorrelatedNoise(ToeplitzRecursion((1.0, 0.5)), 2, name="bandmf")
    for _ in range(2):
        state.step(torch.randn(4))
    with pytest.raises(PrivacyError, match=r"'bandmf' strategy was built for 2 steps.*step 3"
                                           r".*steps="):
        state.step(torch.randn(4))
    assert state.t == 2


def test_a_state_of_another_strategy_is_refused():
    state = CorrelatedNoise(ToeplitzRecursion((1.0, 0.5)), 4, name="bandmf")
    state.step(torch.randn(4))
    other = CorrelatedNoise(BLTRecursion(1.0, (0.5,), (0.2,)), 4, name="blt")
    with pytest.raises(ValueError, match="'bandmf' strategy.*'blt'"):
        other.load_state_dict(state.state_dict())
    assert other.t == 0


def test_the_step_reads_nothing_but_the_draw():
    """Note [The state is noise only]: the step's one input is z."""
    assert list(inspect.signature(CorrelatedNoise.step).parameters) == ["self", "z"]
