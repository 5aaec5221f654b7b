"""DPOptimizer(mechanism=): each release is the clipped sum plus sigma * S * (C^{-1} z)_t, over D.

- sigma 0: every step equals the clipped-sum reference (tests/support/reference.py), through
  Inductor, for each recursion kind (Toeplitz, BLT, dense);
- sigma > 0 with zero gradients (empty batches: the clipped sum of no example is 0): the
  released noise's covariance across steps, estimated over many coordinates in float64, is
  sigma^2 S^2 C^{-1} C^{-T} / D^2 within sampling error, per-layer clipping's S included
  (computed here from the bounds);
- a checkpoint resumes the same noise sequence; virtual batches advance the state once per
  logical step; ``noise_variance`` and the inner optimizer's ``dp_noise_variance``;
- refusals: noise="graph", adaptive clipping, step n + 1, a checkpoint of another mechanism, a
  ledger ahead of the checkpoint.

The strategies are stand-ins with a strategy's surface (tests/support/mf_strategy.py). Apart
from the Inductor test, the models run with backend="eager": the optimizer adds this noise
after the graph, whatever the backend.
"""
import math

import pytest
import torch

import dpfx
from dpfx.errors import PrivacyError
from support import mf_strategy
from support.models import MLP, mse
from support.reference import clip_fraction, dp_sgd_grads

KINDS = sorted(mf_strategy.ALL)
C, D = 0.3, 5


def _step(dp, opt, x, y) -> None:
    opt.zero_grad()
    out = dp(x)
    (mse(out, y) if x.shape[0] else out.sum() * 0.0).backward()
    opt.step()


def _grads(model) -> dict:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


@pytest.fixture(scope="module")
def inductor_mlp():
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=D,
                      noise="optimizer")            # Inductor
    return model, dp


@pytest.mark.parametrize("kind", KINDS)
def test_sigma0_every_step_is_the_clipped_sum(inductor_mlp, kind):
    model, dp = inductor_mlp
    steps = 4
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), dp,
                           mechanism=mf_strategy.ALL[kind](steps), check_noise_every=1)
    g = torch.Generator().manual_seed(5)
    for t in range(steps):
        x, y = torch.randn(6, 8, generator=g) * 3, torch.randn(6, 4, generator=g)
        assert clip_fraction(model, mse, x, y, C) > 0
        want = dp_sgd_grads(model, mse, x, y, max_grad_norm=C, expected_batch_size=D)
        _step(dp, opt, x, y)
        for k, grad in _grads(model).items():
            torch.testing.assert_close(grad, want[k], rtol=1e-4, atol=1e-6, msg=f"{kind} {t} {k}")
    assert opt._correlated.t == steps and opt._check.checked == steps


EMPTY_BATCHES = pytest.mark.filterwarnings("ignore::dpfx.loop.checks.BatchSizeWarning")


@EMPTY_BATCHES
@pytest.mark.parametrize("kind", KINDS)
def test_released_noise_has_the_strategy_covariance(kind):
    """Per-layer bounds: S = sqrt(0.3^2 + 0.4^2) = 0.5. 10 steps, 8,512 coordinates."""
    steps, sigma, bounds = 10, 1.7, {"fc1": 0.3, "fc2": 0.4}
    torch.manual_seed(1)
    model = MLP(32, 128, 32)
    dp = dpfx.compile(model, max_grad_norm=bounds, noise_multiplier=sigma, expected_batch_size=D,
                      seed=11, backend="eager", noise="optimizer")
    mechanism = mf_strategy.ALL[kind](steps)
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp, mechanism=mechanism)
    released = []
    for _ in range(steps):
        _step(dp, opt, torch.randn(0, 32), torch.randn(0, 32))
        released.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
    noise = torch.stack(released)                           # (steps, coordinates)
    std = sigma * math.sqrt(0.3 ** 2 + 0.4 ** 2) / D
    expected = mf_strategy.release_covariance(mechanism, steps, std)
    # the correlation is there to be seen: an off-diagonal entry many standard errors from 0
    n = noise.shape[1]
    diag = expected.diagonal()
    off = expected - torch.diag(diag)
    assert float((off.abs() / (diag[:, None] * diag[None, :] / n).sqrt()).max()) > 20
    mf_strategy.assert_covariance(noise, expected, kind)
    # and the variance each step reported is the diagonal's
    assert opt.noise_variance == pytest.approx(float(diag[-1]), rel=1e-9)


def _run(model, dp, mechanism, x, y, steps, checkpoint=None):
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp, mechanism=mechanism)
    if checkpoint is not None:
        dpfx.load_checkpoint(checkpoint, model=dp, optimizer=opt)
    grads = []
    for t in range(steps):
        _step(dp, opt, x[t], y[t])
        grads.append(_grads(model))
    return opt, grads


@pytest.mark.parametrize("kind", KINDS)
def test_a_resumed_run_continues_the_same_noise(kind, tmp_path):
    """2 steps, save a checkpoint (dpfx.save_checkpoint: the model and the state in one atomic
    file), load it into a fresh model and optimizer, 2 more: the 4 steps of one run."""
    mechanism = mf_strategy.ALL[kind](6)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, 4, generator=g)

    def fresh():
        torch.manual_seed(0)
        model = MLP(8, 16, 4)
        return model, dpfx.compile(model, max_grad_norm=C, noise_multiplier=2.0,
                                   expected_batch_size=D, seed=4, backend="eager",
                                   noise="optimizer")

    model, dp = fresh()
    _, whole = _run(model, dp, mechanism, x, y, 4)
    model, dp = fresh()
    opt, first = _run(model, dp, mechanism, x, y, 2)
    state = opt.state_dict()
    assert state["correlated"]["t"] == 2 and state["mechanism"] == mechanism.state_dict()
    dpfx.save_checkpoint(tmp_path / "run.ckpt", model=dp, optimizer=opt)
    model, dp = fresh()
    opt, rest = _run(model, dp, mechanism, x[2:], y[2:], 2, checkpoint=tmp_path / "run.ckpt")
    assert opt._correlated.t == 4
    for t, (a, b) in enumerate(zip(whole, first + rest)):
        for k in a:
            assert torch.equal(a[k], b[k]), (kind, t, k)
    assert any(not torch.equal(whole[2][k], whole[3][k]) for k in whole[2])


def test_virtual_batches_advance_the_state_once_per_logical_step():
    """Two physical batches per logical step release what one batch of both does, noise included
    (same seed), and the state moves once per logical step."""
    mechanism = mf_strategy.toeplitz3(3)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(3, 6, 8, generator=g), torch.randn(3, 6, 4, generator=g)

    def fresh():
        torch.manual_seed(0)
        model = MLP(8, 16, 4)
        dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=2.0, expected_batch_size=D,
                          seed=4, backend="eager", noise="optimizer")
        return model, dp, dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp,
                                           mechanism=mechanism)

    model, dp, opt = fresh()
    whole = []
    for t in range(3):
        _step(dp, opt, x[t], y[t])
        whole.append(_grads(model))
    model, dp, opt = fresh()
    for t in range(3):
        opt.zero_grad()
        for half in (slice(0, 2), slice(2, 6)):
            mse(dp(x[t][half]), y[t][half]).backward()
            if half.start == 0:
                opt.signal_skip_step()
            opt.step()
        assert opt._correlated.t == t + 1
        for k, v in _grads(model).items():
            torch.testing.assert_close(v, whole[t][k], rtol=1e-5, atol=1e-6)


class _BiasCorrected(torch.optim.SGD):
    """An inner optimizer that reads the step's noise variance, as DP-AdamBC does."""
    dp_noise_variance = None

    def step(self, closure=None):
        self.seen = self.dp_noise_variance
        return super().step(closure)


@pytest.mark.parametrize("kind", [None, "blt2"])
def test_the_inner_optimizer_reads_the_step_noise_variance(kind):
    """(sigma S / D)^2 times Var(w_t) = sum_j (C^{-1})[t, j]^2, set before the inner step."""
    steps, sigma = 3, 1.3
    mechanism = None if kind is None else mf_strategy.ALL[kind](steps)
    model = MLP(8, 16, 4)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=D,
                      backend="eager", noise="optimizer")
    inner = _BiasCorrected(model.parameters(), lr=0.1)
    opt = dpfx.DPOptimizer(inner, dp, mechanism=mechanism)
    for t in range(steps):
        _step(dp, opt, torch.randn(6, 8), torch.randn(6, 4))
        var_w = 1.0 if mechanism is None else float(
            mechanism.rec.inverse_matrix(t + 1)[t].pow(2).sum())
        want = (sigma * C / D) ** 2 * var_w
        assert inner.seen == pytest.approx(want, rel=1e-12) and opt.noise_variance == inner.seen


@EMPTY_BATCHES
def test_secure_mode_draws_the_correlated_noise():
    model = MLP(8, 16, 4)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=1.0, expected_batch_size=D,
                      backend="eager", noise="optimizer")
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp, secure_mode=True,
                           mechanism=mf_strategy.blt(4), check_noise_every=1)
    assert opt._generator is None
    for _ in range(4):
        _step(dp, opt, torch.randn(0, 8), torch.randn(0, 4))
        assert all(p.grad.abs().sum() > 0 for p in model.parameters())
    assert opt._check.checked == 4


# -- refusals ----------------------------------------------------------------------------------
def _compiled(**settings):
    model = MLP(8, 16, 4)
    options = dict(max_grad_norm=C, noise_multiplier=1.0, expected_batch_size=D,
                   backend="eager", noise="optimizer")
    options.update(settings)
    return model, dpfx.compile(model, **options)


def test_graph_noise_is_refused_naming_the_option():
    model, dp = _compiled(noise="graph")
    with pytest.raises(ValueError, match="mechanism='bandmf'.*noise='optimizer'"):
        dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp,
                         mechanism=mf_strategy.toeplitz3(4))


def test_adaptive_clipping_is_refused():
    model, dp = _compiled(clipping="adaptive", target_unclipped_quantile=0.5, clip_lr=0.2,
                          count_noise_multiplier=5.0)
    with pytest.raises(ValueError, match="clipping='adaptive'.*fixed max_grad_norm"):
        dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp,
                         mechanism=mf_strategy.toeplitz3(4))


def test_a_check_without_a_mechanism_and_a_stand_in_without_its_surface_are_refused():
    model, dp = _compiled()
    with pytest.raises(ValueError, match="check_noise_every.*mechanism="):
        dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp, check_noise_every=3)
    with pytest.raises(TypeError, match="without .*recursion"):
        dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp, mechanism="bandmf")


def test_step_n_plus_one_is_refused_before_anything_is_released(tmp_path):
    model, dp = _compiled()
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp,
                           mechanism=mf_strategy.blt(2), accountant=dpfx.privacy.Accountant(),
                           sample_rate=0.01, ledger=tmp_path / "ledger")
    for _ in range(2):
        _step(dp, opt, torch.randn(6, 8), torch.randn(6, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt.zero_grad()
    mse(dp(torch.randn(6, 8)), torch.randn(6, 4)).backward()
    with pytest.raises(PrivacyError, match="'blt' strategy was built for 2 steps.*step 3"):
        opt.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert opt.privacy_ledger.steps == 2 and opt.accountant.steps == 2 and opt.steps == 2


def test_a_checkpoint_of_another_mechanism_is_refused():
    model, dp = _compiled()
    gaussian = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp)
    _step(dp, gaussian, torch.randn(6, 8), torch.randn(6, 4))
    state = gaussian.state_dict()
    assert state["mechanism"] is None and state["correlated"] is None
    correlated = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp,
                                  mechanism=mf_strategy.toeplitz3(4))
    with pytest.raises(ValueError, match=r"mechanism \(Gaussian, none\).*'bandmf', 4 steps"):
        correlated.load_state_dict(state)
    assert correlated.steps == 0 and correlated._correlated.t == 0


def test_a_ledger_ahead_of_the_checkpoint_is_refused(tmp_path):
    """Releases after the checkpoint drew noise the checkpoint's state does not hold."""
    mechanism = mf_strategy.toeplitz3(6)
    model, dp = _compiled()

    def optimizer():
        return dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp,
                                mechanism=mechanism, accountant=dpfx.privacy.Accountant(),
                                sample_rate=0.01, ledger=tmp_path / "ledger")

    opt = optimizer()
    _step(dp, opt, torch.randn(6, 8), torch.randn(6, 4))
    state = opt.state_dict()
    _step(dp, opt, torch.randn(6, 8), torch.randn(6, 4))
    opt.privacy_ledger.close()
    resumed = optimizer()
    with pytest.raises(ValueError, match="ledger records 2 releases.*saved after 1"):
        resumed.load_state_dict(state)
    # nor can the strategy start again from its first step under the same ledger
    opt.zero_grad()
    mse(dp(torch.randn(6, 8)), torch.randn(6, 4)).backward()
    with pytest.raises(PrivacyError, match="ledger records 2 releases.*step 0 of the 'bandmf'"):
        resumed.step()
    assert resumed.privacy_ledger.steps == 2
