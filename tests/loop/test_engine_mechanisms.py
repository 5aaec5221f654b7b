"""make_private with a correlated-noise mechanism (privacy/plan.py): the plan's sampler feeds the
loop, its strategy drives DPOptimizer's noise and its accountant counts the steps. At sigma 0
every step is the clipped-sum reference through the default backend; at sigma > 0 the
accountant's epsilon is the plan's and the variance DPOptimizer reports is the strategy's."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import dpfx
from dpfx.privacy import matrix_accounting
from support.reference import assert_close, dp_sgd_grads

N = 24


def _run(mechanism, sigma, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
    data = TensorDataset(x, y, torch.arange(N))
    private = dpfx.make_private(model, torch.optim.SGD(model.parameters(), lr=0.0), data,
                                batch_size=6, max_grad_norm=0.1, noise_multiplier=sigma,
                                epochs=2, mechanism=mechanism,
                                generator=torch.Generator().manual_seed(1), **kwargs)
    return model, private


@pytest.mark.parametrize("mechanism", [dpfx.Mechanism("bandmf", bands=2), "blt"])
def test_each_step_is_the_clipped_sum_and_examples_keep_their_separation(mechanism):
    model, private = _run(mechanism, 0.0)
    parts = private.loader.batch_sampler.parts
    seen: dict[int, int] = {}
    step = 0
    for _ in range(2):
        for xb, yb, ib in private.loader:
            for i in ib.tolist():       # an example's steps are at least `parts` apart
                assert step - seen.get(i, -parts) >= parts
                seen[i] = step
            private.optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(private.model(xb), yb).backward()
            private.optimizer.step()
            got = {k: p.grad for k, p in model.named_parameters()}
            assert_close(got, dp_sgd_grads(model, F.cross_entropy, xb, yb, max_grad_norm=0.1,
                                           expected_batch_size=6), rtol=1e-4, atol=1e-6)
            step += 1
    assert step == private.accountant.steps == private.accountant.strategy.steps


def test_the_accountant_and_the_variance_are_the_plans():
    mechanism = dpfx.Mechanism("bsr", bands=2)
    model, private = _run(mechanism, 1.3, backend="eager")
    assert isinstance(private.accountant, matrix_accounting.MatrixAccountant)
    strategy = private.accountant.strategy
    t = 0
    for _ in range(2):
        for xb, yb, _ in private.loader:
            private.optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(private.model(xb), yb).backward()
            private.optimizer.step()
            want = (1.3 * 0.1 / 6) ** 2 * strategy.noise_variance(t)
            assert math.isclose(private.optimizer.noise_variance, want, rel_tol=1e-9)
            t += 1
    direct = matrix_accounting.MatrixAccountant(strategy, private.accountant.sampling)
    direct.step(noise_multiplier=1.3, sample_rate=6 / N, n=t)
    assert private.accountant.get_epsilon(1e-5) == direct.get_epsilon(1e-5)


def test_a_correlated_mechanism_refuses_graph_noise_and_users():
    with pytest.raises(ValueError, match="correlated mechanism"):
        _run("blt", 1.0, noise="graph")
    with pytest.raises(ValueError, match="user-level DP"):
        _run("blt", 1.0, user_ids=torch.arange(N) // 2, max_examples_per_user=2)
