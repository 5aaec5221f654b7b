"""Set-ups that train but not as meant, said at once: the model given to dpfx.compile trained
directly (and a public phase declared with dpfx.public), batches far from expected_batch_size, no
noise, gradients kept across steps, and a second backward of one forward named before torch's
own errors. Each warning is checked to fire on the slip and to stay silent on the correct loop,
through Inductor."""
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import dpfx
from dpfx.loop.checks import BatchSizes
from support.models import MLP
from support.reference import assert_close, dp_sgd_grads


def _data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _xent(out, y):
    return F.cross_entropy(out, y)


class _Silent:
    """Every warning of ``categories`` raised as an error inside the block."""

    def __init__(self, *categories):
        self.categories = categories

    def __enter__(self):
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        for c in self.categories:
            warnings.simplefilter("error", c)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


# -- the model given to dpfx.compile -----------------------------------------------------------

def test_original_model_trained_directly_warns_once():
    """``model(x)`` instead of ``dp(x)`` with a torch optimizer: said once, at the user's line,
    naming the returned model; the private loop beside it says nothing and stays exact."""
    torch.manual_seed(0)
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    with _Silent(dpfx.PlainGradientWarning):
        opt.zero_grad()
        _xent(dp(x), y).backward()
    assert_close({k: p.grad for k, p in model.named_parameters()},
                 dp_sgd_grads(model, _xent, x, y, max_grad_norm=0.5), rtol=1e-4, atol=1e-6)
    with pytest.warns(dpfx.PlainGradientWarning,
                      match="Call the model dpfx.compile returned") as seen:
        for _ in range(3):
            opt.zero_grad()
            _xent(model(x), y).backward()
            opt.step()
    assert len(seen) == 1 and seen[0].filename == __file__
    assert "dpfx.public(model)" in str(seen[0].message)


@pytest.mark.parametrize("declared", ["model", "dp_model"])
def test_public_phase_is_silent(declared):
    """Pre-training on public data inside ``dpfx.public``: no warning; the private phase after
    it is DP-SGD exactly, and a plain gradient left behind is still refused at the private
    step."""
    torch.manual_seed(0)
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=0.0)
    public_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(seed=1)
    with _Silent(dpfx.PlainGradientWarning), dpfx.public(model if declared == "model" else dp):
        for _ in range(2):
            public_opt.zero_grad()
            _xent(model(x), y).backward()
            public_opt.step()
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp)
    with pytest.raises(dpfx.PrivacyError, match="not dpfx's release"):
        opt.step()                       # the public phase's gradient, not zeroed
    opt.zero_grad()
    with _Silent(dpfx.PlainGradientWarning):
        _xent(dp(x), y).backward()
    assert_close({k: p.grad for k, p in model.named_parameters()},
                 dp_sgd_grads(model, _xent, x, y, max_grad_norm=0.5), rtol=1e-4, atol=1e-6)
    # the phase is over: the slip is said again
    with pytest.warns(dpfx.PlainGradientWarning):
        model.zero_grad()
        _xent(model(x), y).backward()


def test_two_modules_over_one_model():
    """Two dpfx.compile calls over one model (one padded to buckets, one not): the backward of
    either is private and says nothing to the other; dpfx.public(model) covers both."""
    torch.manual_seed(0)
    model = MLP()
    padded = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=0.0, batch_buckets=(8,))
    plain = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=0.0, backend="eager")
    x, y = _data(6)
    with _Silent(dpfx.PlainGradientWarning):
        for dp in (padded, plain, padded):
            model.zero_grad()
            _xent(dp(x), y).backward()
            assert_close({k: p.grad for k, p in model.named_parameters()},
                         dp_sgd_grads(model, _xent, x, y, max_grad_norm=0.5), rtol=1e-4,
                         atol=1e-6)
        with dpfx.public(model):
            model.zero_grad()
            _xent(model(x), y).backward()
    with pytest.warns(dpfx.PlainGradientWarning) as seen:
        model.zero_grad()
        _xent(model(x), y).backward()
    assert len(seen) == 2       # once for each compiled module


def test_make_private_names_the_returned_model():
    """Under make_private the same slip reaches the loss check, which names the parameter as
    the model's own and the fix (call the returned model), before anything is written."""
    x, y = _data(64)
    model = MLP()
    private = dpfx.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                TensorDataset(x, y), batch_size=16, max_grad_norm=1.0,
                                noise_multiplier=1.0)
    batch = next(b for b in private.loader if len(b[0]))
    with pytest.raises(dpfx.PrivacyError, match=r"uses parameter 'fc\d\.\w+' of the model given "
                       r"to dpfx.compile directly.*Call the returned model"):
        _xent(model(batch[0]), batch[1]).backward()
    assert all(p.grad is None for p in model.parameters())


# -- expected_batch_size against the batches ---------------------------------------------------

def test_batches_far_from_expected_batch_size_warn_once():
    """expected_batch_size=256 with batches of 32 divides by 256: said once, after a few
    batches, with the observed mean; a single small or empty batch says nothing."""
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=256)
    x, y = _data(32)
    with _Silent(dpfx.BatchSizeWarning):
        for batch in (3, 0, 300):
            model.zero_grad()
            _xent(dp(x[:batch] if batch <= 32 else x.repeat(10, 1)[:batch]),
                  y[:batch] if batch <= 32 else y.repeat(10)[:batch]).backward()
    with pytest.warns(dpfx.BatchSizeWarning, match="far from expected_batch_size=256") as seen:
        for _ in range(20):
            model.zero_grad()
            _xent(dp(x), y).backward()
    assert len(seen) == 1 and seen[0].filename == __file__


@pytest.mark.parametrize("expected", [1, 4, 64, 256, 4096])
def test_poisson_batch_sizes_never_warn(expected):
    """Batch sizes drawn as Poisson sampling draws them (Binomial(N, q), mean D) pass the test
    at every D, from 1 up: 300 runs of 256 steps each, none warned."""
    rng = random.Random(expected)
    n = 20 * expected
    with _Silent(dpfx.BatchSizeWarning):
        for _ in range(300):
            sizes = BatchSizes(expected)
            for _ in range(256):
                # Binomial(n, q) by its normal approximation above D = 64, exactly below
                size = (sum(rng.random() < 0.05 for _ in range(n)) if expected < 64 else
                        max(0, round(rng.gauss(expected, (expected * 0.95) ** 0.5))))
                sizes.observe(size)


def test_poisson_loader_and_virtual_batches_never_warn():
    """dpfx's own loader at a realistic q, with the noise at the optimizer and physical batches
    a quarter of the logical one: the logical steps are what is tested, and nothing warns."""
    x, y = _data(400)
    model = MLP()
    with _Silent(dpfx.BatchSizeWarning, dpfx.PlainGradientWarning, dpfx.MissingZeroGradWarning):
        dp, opt, loader, _ = dpfx.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), TensorDataset(x, y),
            batch_size=16, max_grad_norm=1.0, noise_multiplier=1.0, max_physical_batch_size=4)
        for _ in range(2):
            for bx, by in loader:
                opt.zero_grad()
                _xent(dp(bx), by).backward()
                opt.step()
        assert opt.original_optimizer is not None and dp.dp_config.noise == "optimizer"
        assert dp._batch_sizes is None      # the logical steps are DPOptimizer's to observe


# -- no noise, and gradients kept across steps -------------------------------------------------

def test_no_noise_under_dp_optimizer_warns():
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    with pytest.warns(dpfx.NoNoiseWarning, match="epsilon is infinite") as seen:
        dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp)
    assert seen[0].filename == __file__
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, backend="eager")
    with _Silent(dpfx.NoNoiseWarning):
        dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp)


@pytest.mark.parametrize("noise", ["graph", "optimizer"])
def test_missing_zero_grad_warns_once(noise):
    """Under make_private, a loop without zero_grad() adds each release to the last step's
    gradient: said once; the same loop with zero_grad() says nothing."""
    x, y = _data(64)
    model = MLP()
    dp, opt, loader, _ = dpfx.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TensorDataset(x, y), batch_size=16,
        max_grad_norm=1.0, noise_multiplier=1.0, noise=noise)
    with _Silent(dpfx.MissingZeroGradWarning):
        for bx, by in loader:
            opt.zero_grad()
            _xent(dp(bx), by).backward()
            opt.step()
    with pytest.warns(dpfx.MissingZeroGradWarning, match="no zero_grad\\(\\) between") as seen:
        for bx, by in loader:
            _xent(dp(bx), by).backward()
            opt.step()
    assert len(seen) == 1 and seen[0].filename == __file__


# -- a second backward of one forward ----------------------------------------------------------

@pytest.mark.parametrize("path", ["plain loop", "captured loss"])
def test_second_backward_is_named_first(path):
    """The second ``loss.backward()`` of one forward meets dpfx's refusal first (not torch's
    "backward through the graph a second time" or its donated-buffer error), writes nothing,
    and says so each time; ``retain_graph=True`` on the compiled backward is named too."""
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0,
                      loss=_xent if path == "captured loss" else None)
    x, y = _data()

    def loss():
        return dp.loss(x, y) if path == "captured loss" else _xent(dp(x), y)

    first = loss()
    first.backward()
    written = [p.grad.clone() for p in model.parameters()]
    for _ in range(2):
        with pytest.raises(dpfx.PrivacyError, match="second backward of one dpfx forward"):
            first.backward()
    with pytest.raises(dpfx.PrivacyError, match="second backward of one dpfx forward"):
        torch.autograd.grad(first, list(model.parameters()))
    assert all(torch.equal(w, p.grad) for w, p in zip(written, model.parameters()))
    model.zero_grad()
    with pytest.raises(RuntimeError, match="call loss.backward\\(\\) without retain_graph"):
        loss().backward(retain_graph=True)
