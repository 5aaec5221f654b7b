"""The training loop around dpfx's graph: one release per forward and per accounted step, only
dpfx's gradients in a private step (post-processing of the release:
tests/loop/test_post_processing.py), inputs that require grad, secure sampling, fixed seeds and
private settings that cannot change after compile (dpfx/loop/checks.py)."""
import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from dpfx.loop.data import PoissonBatchSampler
from support.reference import assert_close, dp_sgd_grads

C = 0.5


def _flat_grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def _data(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g) * 3, torch.arange(n) % 3


def _linear(seed=0):
    # One Linear: its backward saves only the input, so torch allows backward(retain_graph=True)
    # (deeper models donate their saved buffers and torch itself refuses a retained graph).
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def _sum_xent(out, y):
    return F.cross_entropy(out, y, reduction="sum")


# -- one release per forward ----------------------------------------------------------------------

@pytest.mark.parametrize("second", ["backward", "autograd.grad"])
def test_second_backward_of_one_forward_refused(second):
    """A retained graph run twice releases every example twice (2C), accounted once."""
    model = _linear()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager",
                      loss_reduction="sum")
    x, y = _data()
    loss = _sum_xent(dp(x), y)
    if second == "backward":
        loss.backward(retain_graph=True)
    else:
        torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    first = None if model.weight.grad is None else _flat_grads(model).clone()
    with pytest.raises(dpfx.PrivacyError, match="second backward of one dpfx forward"):
        loss.backward()
    if first is not None:
        assert torch.equal(_flat_grads(model), first)     # the refused backward wrote nothing
    assert dp.releases == 1
    model.zero_grad()
    _sum_xent(dp(x), y).backward()                         # a new forward is a new release
    assert dp.releases == 2


def test_canary_moves_the_release_by_at_most_c():
    """The auditor's view at sigma 0: adding a canary with a huge gradient to the batch moves
    what the loop releases by at most C, one release per backward; the refused second backward
    would have moved it by 2C."""
    def release(with_canary: bool, twice: bool):
        model = _linear()
        dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager",
                          loss_reduction="sum")
        x, y = _data()
        if with_canary:
            x, y = torch.cat([x, torch.full((1, 4), 100.0)]), torch.cat([y, torch.tensor([2])])
        loss = _sum_xent(dp(x), y)
        loss.backward(retain_graph=True)
        if twice:
            with pytest.raises(dpfx.PrivacyError):
                loss.backward()
        return _flat_grads(model)

    for twice in (False, True):
        moved = (release(True, twice) - release(False, twice)).norm()
        assert C * 0.99 < moved <= C * (1 + 1e-4), moved     # the canary bites, bounded by C


# -- one release per accounted step ---------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::dpfx.MissingZeroGradWarning")   # backward after step()
@pytest.mark.parametrize("noise", ["graph", "optimizer"])
def test_second_backward_before_step_refused(noise):
    model = _linear()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=1.0, backend="eager",
                      noise=noise, expected_batch_size=6)
    acc = dpfx.privacy.Accountant()
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp, accountant=acc,
                           sample_rate=0.1)
    x, y = _data()
    opt.zero_grad()
    F.cross_entropy(dp(x), y).backward()
    written = {k: v.clone() for k, v in dp.clipped_sums.items()} if noise == "optimizer" \
        else _flat_grads(model).clone()
    with pytest.raises(dpfx.PrivacyError, match="second backward before DPOptimizer.step"):
        F.cross_entropy(dp(x), y).backward()
    if noise == "optimizer":
        assert_close(dp.clipped_sums, written)
    else:
        assert torch.equal(_flat_grads(model), written)
    opt.step()
    assert acc.steps == 1
    for _ in range(2):                                     # backward, step: as often as wanted
        opt.zero_grad()
        F.cross_entropy(dp(x), y).backward()
        opt.step()
    assert acc.steps == 3
    # A release discarded by zero_grad() before step(): counted when it was noised (graph).
    F.cross_entropy(dp(x), y).backward()
    opt.zero_grad()
    assert acc.steps == (4 if noise == "graph" else 3)
    F.cross_entropy(dp(x), y).backward()
    opt.step()


def test_virtual_batches_still_accumulate():
    """Summing physical batches under one noise draw goes through virtual batches only."""
    model = _linear()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager",
                      noise="optimizer", loss_reduction="sum")
    acc = dpfx.privacy.Accountant()
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp, accountant=acc,
                           sample_rate=0.1)
    x, y = _data(7)
    for cx, cy in dpfx.VirtualBatches([(x, y)], 3, opt):
        opt.zero_grad()
        _sum_xent(dp(cx), cy).backward()
        opt.step()
    assert acc.steps == 1 and dp.releases == 3
    want = dp_sgd_grads(model, _sum_xent, x, y, max_grad_norm=C, loss_reduction="sum")
    assert_close({n: p.grad for n, p in model.named_parameters()}, want, rtol=1e-4, atol=1e-6)


# -- only dpfx's gradients reach a private step ---------------------------------------------------

@pytest.mark.filterwarnings("ignore::dpfx.PlainGradientWarning")   # a plain backward on purpose
@pytest.mark.parametrize("noise", ["graph", "optimizer"])
def test_raw_model_gradient_refused_at_step(noise):
    model = _linear()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=1.0, backend="eager",
                      noise=noise, expected_batch_size=6)
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp)
    x, y = _data()
    F.cross_entropy(dp(x), y).backward()     # hooks live from the first forward on
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    F.cross_entropy(model(x), y).backward()  # the raw model in the loop
    assert not dp.clipped_sums               # never moved into the clipped sums
    with pytest.raises(dpfx.PrivacyError, match=r"parameter '(weight|bias)' has a gradient"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.zero_grad()                          # dpfx's gradient replaced by another tensor
    F.cross_entropy(dp(x), y).backward()
    model.weight.grad = torch.ones_like(model.weight)
    with pytest.raises(dpfx.PrivacyError, match=r"'weight' .* a tensor assigned to p\.grad"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.filterwarnings("ignore::dpfx.PlainGradientWarning")   # a plain backward on purpose
@pytest.mark.parametrize("noise", ["graph", "optimizer"])
def test_sharing_module_before_private_backward_refused(noise):
    """p.grad = raw + private: a module sharing the weight backwarded first, no zero_grad."""
    model = _linear()
    other = nn.Linear(4, 3)
    other.weight = model.weight
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=1.0, backend="eager",
                      noise=noise, expected_batch_size=6)
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp)
    x, y = _data()
    F.cross_entropy(dp(x), y).backward()
    opt.step()
    opt.zero_grad()
    F.cross_entropy(other(x), y).backward()
    with pytest.raises(dpfx.PrivacyError, match="'weight' already holds a gradient"):
        F.cross_entropy(dp(x), y).backward()
    opt.zero_grad(set_to_none=False)          # zeros are clean
    F.cross_entropy(dp(x), y).backward()
    opt.step()


def test_input_that_requires_grad_refused_unless_allowed():
    encoder = nn.Linear(5, 4)
    model = _linear()
    x, y = torch.randn(6, 5), torch.arange(6) % 3
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager")
    with pytest.raises(dpfx.PrivacyError, match="input 0 .* requires grad.*Compile the upstream "
                                                "module in.*allow_input_grads=True"):
        dp(encoder(x))
    assert model.weight.grad is None and encoder.weight.grad is None
    torch._dynamo.reset()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager",
                      loss_reduction="sum", allow_input_grads=True)
    h = encoder(x).detach().requires_grad_()
    for batch in (0, 1, 6):
        model.zero_grad(set_to_none=True)
        h.grad = None
        loss = F.cross_entropy(dp(h[:batch]), y[:batch], reduction="sum")
        loss.backward()
        want = dp_sgd_grads(model, _sum_xent, h[:batch].detach(), y[:batch], max_grad_norm=C,
                            loss_reduction="sum")
        assert_close({n: p.grad for n, p in model.named_parameters()}, want, rtol=1e-4,
                     atol=1e-6)
        assert batch == 0 or h.grad is not None         # the opt-in gets (non-private) grads


# -- secure sampling, fixed seeds, settings after compile -----------------------------------------

def _batches(sampler):
    return [tuple(b) for b in sampler]


def test_secure_sampling_ignores_torch_seed():
    def run(secure):
        torch.manual_seed(3)
        return _batches(PoissonBatchSampler(200, 0.1, steps=5, secure_mode=secure))

    assert run(False) == run(False)
    assert run(True) != run(True)
    sizes = [len(b) for b in PoissonBatchSampler(1000, 0.1, steps=40, secure_mode=True)]
    assert abs(sum(sizes) / 40 - 100) < 4 * (1000 * 0.1 * 0.9 / 40) ** 0.5   # ~4 standard errors
    assert _batches(PoissonBatchSampler(7, 1.0, steps=2, secure_mode=True)) == [tuple(range(7))] * 2
    with pytest.raises(ValueError, match="CSPRNG"):
        PoissonBatchSampler(10, 0.5, generator=torch.Generator(), secure_mode=True)


def test_make_private_secure_mode_samples_securely():
    data = torch.utils.data.TensorDataset(torch.randn(50, 4), torch.arange(50) % 3)
    model = _linear()
    run = dpfx.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                            batch_size=10, max_grad_norm=C, noise_multiplier=1.0,
                            secure_mode=True, backend="eager")
    assert run.loader.batch_sampler.secure_mode
    with pytest.raises(ValueError, match="CSPRNG"):
        dpfx.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                          batch_size=10, max_grad_norm=C, noise_multiplier=1.0,
                          secure_mode=True, generator=torch.Generator(), backend="eager")


def test_fixed_seed_warns():
    with pytest.warns(dpfx.FixedSeedWarning, match="tests"):
        dpfx.compile(_linear(), max_grad_norm=C, noise_multiplier=1.0, seed=0, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", dpfx.FixedSeedWarning)
        dpfx.compile(_linear(), max_grad_norm=C, noise_multiplier=1.0, backend="eager")


def test_private_settings_cannot_change_after_compile():
    model = _linear()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=1.0, backend="eager",
                      expected_batch_size=6)
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dp)
    with pytest.raises(dpfx.PrivacyError, match="'noise_multiplier' is a private setting"):
        dp.noise_multiplier = 2.0
    with pytest.raises(dpfx.PrivacyError, match="DPConfig.max_grad_norm cannot change"):
        dp.dp_config.max_grad_norm = 2.0
    with pytest.raises(dpfx.PrivacyError, match="'noise_multiplier' cannot change"):
        opt.noise_multiplier = 2.0
    assert dp.dp_config.noise_multiplier == 1.0 and dp.dp_config.max_grad_norm == C


@pytest.mark.parametrize("frozen_at_compile", [True, False])
def test_freezing_or_unfreezing_after_compile_refused(frozen_at_compile):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    model[0].weight.requires_grad_(not frozen_at_compile)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager")
    x, y = _data()
    F.cross_entropy(dp(x), y).backward()
    model[0].weight.requires_grad_(frozen_at_compile)
    change = "unfrozen" if frozen_at_compile else "frozen"
    with pytest.raises(dpfx.PrivacyError, match=rf"parameter '0.weight' was {change} "
                                                rf"\(requires_grad=.*\) after dpfx.compile"):
        dp(x)


# -- the same loop through Inductor ----------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::dpfx.PlainGradientWarning")   # a plain backward on purpose
def test_loop_refusals_through_inductor():
    """Cases 2-6 once through the default backend: one compile, every refusal, then a clean
    step that matches the reference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction="sum")
    acc = dpfx.privacy.Accountant()
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp, accountant=acc,
                           sample_rate=0.1)
    x, y = _data()
    loss = _sum_xent(dp(x), y)
    loss.backward(retain_graph=True)
    with pytest.raises(dpfx.PrivacyError, match="second backward of one dpfx forward"):
        loss.backward()
    with pytest.raises(dpfx.PrivacyError, match="second backward before DPOptimizer.step"):
        _sum_xent(dp(x), y).backward()
    opt.step()
    opt.zero_grad()
    _sum_xent(model(x), y).backward()
    with pytest.raises(dpfx.PrivacyError, match="has a gradient that is not dpfx's release"):
        opt.step()
    with pytest.raises(dpfx.PrivacyError, match="already holds a gradient"):
        _sum_xent(dp(x), y).backward()
    opt.zero_grad()
    with pytest.raises(dpfx.PrivacyError, match="requires grad"):
        dp(x.clone().requires_grad_())
    for batch in (0, 1, 6):
        opt.zero_grad()
        _sum_xent(dp(x[:batch]), y[:batch]).backward()
        want = dp_sgd_grads(model, _sum_xent, x[:batch], y[:batch], max_grad_norm=C,
                            loss_reduction="sum")
        assert_close({n: p.grad for n, p in model.named_parameters()}, want, rtol=1e-4,
                     atol=1e-6)
        opt.step()
    # 1 + the partly written release refused at accumulation, counted at zero_grad + 3
    assert acc.steps == 5 and dp.compile_count == 2


# -- normalization with frozen statistics, roll ----------------------------------------------------

class FrozenStatsNet(nn.Module):
    """Eval-mode BatchNorm and InstanceNorm with running statistics (each example normalized
    alone, written out by capture/swaps.py), and a roll over a non-batch dim."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3)
        self.bn = nn.BatchNorm1d(4)
        self.inorm = nn.InstanceNorm1d(4, affine=True, track_running_stats=True)
        self.fc = nn.Linear(24, 3)

    def forward(self, x):
        h = self.inorm(self.bn(self.conv(x)))
        return self.fc(torch.roll(h, 2, dims=2).flatten(1))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_frozen_stats_norms_and_roll_match_reference(backend):
    torch.manual_seed(0)
    model = FrozenStatsNet()
    model(torch.randn(16, 2, 8) * 2 + 1)          # running statistics that are not 0 / 1
    model.eval()
    with torch.no_grad():
        model.bn.weight.uniform_(0.5, 2)
        model.inorm.bias.uniform_(-1, 1)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend=backend,
                      loss_reduction="sum")
    x, y = torch.randn(6, 2, 8) * 3, torch.arange(6) % 3
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    for batch in (0, 1, 6):
        model.zero_grad(set_to_none=True)
        _sum_xent(dp(x[:batch]), y[:batch]).backward()
        want = dp_sgd_grads(model, _sum_xent, x[:batch], y[:batch], max_grad_norm=C,
                            loss_reduction="sum")
        assert_close({n: p.grad for n, p in model.named_parameters()}, want, rtol=1e-4,
                     atol=1e-6)
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())


class RollBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return torch.roll(self.fc(x), 1, 0)            # example i gets example i-1's output


@pytest.mark.parametrize("make, match", [
    (lambda: RollBatch(), r"torch.roll over the batch dim.*\n  in the model's code:\n.*"
                          r"test_loop_privacy.py.*, in forward: .*torch.roll\(self.fc\(x\), 1, 0\)"),
    (lambda: nn.Sequential(nn.Linear(4, 4),
                           nn.BatchNorm1d(4, track_running_stats=False).eval()),
     r"module '1' \(BatchNorm1d\) has no running statistics .*replace_batchnorm"),
    (lambda: nn.Sequential(nn.Unflatten(1, (1, 4)), nn.Conv1d(1, 2, 1),
                           nn.InstanceNorm1d(2, track_running_stats=True)),
     r"module '2' \(InstanceNorm1d\) is in training mode with track_running_stats=True: .*"
     r"running buffers.*track_running_stats=False"),
])
def test_batch_mixing_norms_and_roll_refused(make, match):
    torch.manual_seed(0)
    model = make()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager")
    with pytest.raises(dpfx.PrivacyError, match=match):
        dp(torch.randn(5, 4))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_steady_state_caches_follow_the_model():
    """Note [The steady-state call]: what DPModule caches between calls cannot hide a change.
    A BatchNorm switched to training mode after some steps is refused by name; a module added
    after compile makes dynamo capture again, where the graph's verifier refuses its batch
    statistics; a parameter added or replaced after compile is refused at that capture, before
    anything runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6).eval(), nn.ReLU(), nn.Linear(6, 3))
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager",
                      loss_reduction="sum")
    x, y = torch.randn(5, 4), torch.arange(5) % 3
    for _ in range(2):
        _sum_xent(dp(x), y).backward()
        model.zero_grad(set_to_none=True)
    model[1].train()
    with pytest.raises(dpfx.PrivacyError, match=r"module '1' \(BatchNorm1d\) is in training"):
        dp(x)
    model[1].eval()
    model.append(nn.BatchNorm1d(3, affine=False))     # training mode, added after compile
    with pytest.raises(dpfx.PrivacyError, match="BatchNorm"):
        dp(x)
    del model[4]
    model.append(nn.Linear(3, 3))                     # a new trainable parameter
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(dpfx.PrivacyError, match=r"parameters changed.*added: \['4.bias', "
                                                 r"'4.weight'\]"):
        dp(x)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    del model[4]                                      # back to the compiled model: trains
    _sum_xent(dp(x), y).backward()
    want = dp_sgd_grads(model, _sum_xent, x, y, max_grad_norm=C, loss_reduction="sum")
    assert_close({n: p.grad for n, p in model.named_parameters()}, want, rtol=1e-4, atol=1e-6)


def test_capture_settings_only_while_dynamo_captures(monkeypatch):
    """Note [Settings only a capture reads]: dynamo's settings, the batch mark and the batch-size
    decisions are in place for every capture, a first one and a later one (a new entry for
    no_grad), and a steady-state call sets none of them up; the user's dynamo config is the same
    after every call."""
    from dpfx import api
    from dpfx.capture import entry as capture
    from dpfx.backend import DPBackend

    seen, entered = [], []
    real_call, real_enter = DPBackend.__call__, capture.DynamoSettings.__enter__

    def spy_call(self, gm, example_inputs):
        config = torch._dynamo.config
        batch = [x for x in example_inputs if isinstance(x, torch.SymInt)]
        seen.append((config.recompile_limit, config.fail_on_recompile_limit_hit,
                     config.allow_rnn, logging.Logger.warning in config.ignore_logging_functions,
                     [str(s) for s in batch]))
        return real_call(self, gm, example_inputs)

    def spy_enter(self):
        entered.append(1)
        return real_enter(self)

    monkeypatch.setattr(DPBackend, "__call__", spy_call)
    monkeypatch.setattr(capture.DynamoSettings, "__enter__", spy_enter)
    before = (torch._dynamo.config.recompile_limit, torch._dynamo.config.allow_rnn,
              set(torch._dynamo.config.ignore_logging_functions))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager",
                      loss_reduction="sum")
    y = torch.arange(5) % 3
    _sum_xent(dp(torch.randn(5, 4)), y).backward()
    assert len(seen) == 1 and seen[0][:4] == (64, True, True, True)
    assert seen[0][4] and all(s.startswith("u") for s in seen[0][4])   # the unbacked batch
    first = len(entered)
    for batch in (5, 2, 7):
        model.zero_grad(set_to_none=True)
        _sum_xent(dp(torch.randn(batch, 4)), torch.arange(batch) % 3).backward()
    assert len(entered) == first and len(seen) == 1      # steady state: no capture, no setup
    with torch.no_grad():                                # a new capture (inference graph)
        dp(torch.randn(3, 4))
    assert len(seen) == 2 and seen[1][:4] == (64, True, True, True)
    after = (torch._dynamo.config.recompile_limit, torch._dynamo.config.allow_rnn,
             set(torch._dynamo.config.ignore_logging_functions))
    assert after == before


class _RollsWhenEvaluating(nn.Module):
    """Reads F.conv2d and F.linear in training; only in eval mode also torch.roll over the
    features, whose own version fails on the unbacked batch (capture/swaps.py's stand-in does
    not)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):
        h = self.conv(x).view(x.shape[0], -1)
        if not self.training:
            h = torch.roll(h, 1, dims=1)
        return self.fc(h)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_steady_calls_swap_only_what_the_guards_read(backend):
    """Note [Only the swaps the guards read, between captures]: after a capture, a steady call
    swaps what the guards of the entry's graphs read and no more; no call captures again for
    want of a swap (Poisson batch sizes 0 and 1 included); a later capture (eval mode, which
    reads torch.roll) runs with every swap; and between calls torch's own functions are back."""
    from dpfx.capture import swaps as capture_swaps

    torch.manual_seed(0)
    model = _RollsWhenEvaluating()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend=backend,
                      loss_reduction="sum")
    originals = (F.linear, torch.Tensor.view, torch.roll, F.conv2d)
    for batch in (3, 0, 1, 5):
        model.zero_grad(set_to_none=True)
        _sum_xent(dp(torch.randn(batch, 1, 4, 4)), torch.arange(batch) % 3).backward()
        assert (F.linear, torch.Tensor.view, torch.roll, F.conv2d) == originals
    entry = dp._dpfx_entries[0]
    assert entry.capture.captures == 1
    assert {"linear", "conv2d"} <= entry.swaps.names < capture_swaps.ALL.names
    assert "roll" not in entry.swaps.names
    with torch.no_grad():
        dp.eval()
        for batch in (2, 0, 4):
            out = dp(torch.randn(batch, 1, 4, 4))
            assert out.shape == (batch, 3)
    assert entry.capture.captures == 2
    assert {"linear", "conv2d", "roll"} <= entry.swaps.names < capture_swaps.ALL.names
    dp.train()
    _sum_xent(dp(torch.randn(2, 1, 4, 4)), torch.arange(2) % 3).backward()
    assert entry.capture.captures == 2
    assert (F.linear, torch.Tensor.view, torch.roll, F.conv2d) == originals


@pytest.mark.parametrize("guard_names", [None, set(), {"linear"}])
def test_steady_swaps_are_all_where_the_guards_cannot_be_read(monkeypatch, guard_names):
    """Where dynamo's guards cannot be read (None) or name too little for the graph this call
    ran to pass them (the model reads conv2d too), a steady call swaps everything, as
    before, and never captures again."""
    from dpfx.capture import entry as capture, swaps as capture_swaps

    monkeypatch.setattr(capture, "names_guards_read", lambda code: guard_names)
    torch.manual_seed(0)
    dp = dpfx.compile(_RollsWhenEvaluating(), max_grad_norm=C, noise_multiplier=0.0,
                      backend="eager", loss_reduction="sum")
    for batch in (3, 1, 4):
        _sum_xent(dp(torch.randn(batch, 1, 4, 4)), torch.arange(batch) % 3).backward()
    entry = dp._dpfx_entries[0]
    assert entry.swaps is capture_swaps.ALL and entry.capture.captures == 1


def test_capture_settings_under_a_compile_stance():
    """Under torch.compiler.set_stance("eager_then_compile") dynamo calls a callback of its own,
    built around the innermost backend: dpfx then sets its capture settings up around the whole
    call, and the capture that follows the stance's eager call trains privately."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager",
                      loss_reduction="sum")
    x, y = torch.randn(5, 4), torch.arange(5) % 3
    with torch.compiler.set_stance("eager_then_compile"):
        with pytest.raises(dpfx.DPFXError):      # the stance's first call is not dpfx's graph
            _sum_xent(dp(x), y).backward()
        model.zero_grad(set_to_none=True)
        _sum_xent(dp(x), y).backward()
    want = dp_sgd_grads(model, _sum_xent, x, y, max_grad_norm=C, loss_reduction="sum")
    assert_close({n: p.grad for n, p in model.named_parameters()}, want, rtol=1e-4, atol=1e-6)


def test_outputs_fed_back_as_inputs():
    """An input computed from an earlier step's outputs (never made private) is refused, and so
    is one into which such a value was written in place; features of this step's own batch that
    keep rows apart are inputs like any other, and a batch statistic of them is refused."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    first = torch.nn.Linear(4, 4)
    second = torch.nn.Linear(4, 4)
    dp = dpfx.compile(first, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    dp2 = dpfx.compile(second, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    x, y = torch.randn(5, 4), torch.randn(5, 4)
    out = dp(x)
    F.mse_loss(out, y).backward()
    with pytest.raises(dpfx.PrivacyError, match="outputs of an earlier step's forward"):
        dp(x + out.detach().mean(0))
    buf = torch.zeros(5, 4)
    out = dp(x)
    buf += out.detach().mean(0)
    F.mse_loss(out, y).backward()
    with pytest.raises(dpfx.PrivacyError, match="written in place"):
        dp(buf)
    features = dp(x)
    first.zero_grad(set_to_none=True)
    F.mse_loss(dp2(features.detach() * 2), y).backward()
    assert second.weight.grad is not None and first.weight.grad is None
    with pytest.raises(dpfx.PrivacyError, match="couples examples"):
        dp2(features.detach() - features.detach().mean(0))
