"""dpfx.opacus against what Opacus 1.6's own privacy-engine tests establish about its surface.

The facts come from Opacus's tests/privacy_engine_test.py (arguments, returned objects, clipping
bounds, noise level, checkpoint round trip, epsilon growth); the models and the checks are
dpfx's. Runs use backend="eager" (the same rewritten graphs, no Inductor compile) to stay fast;
the Inductor runs of Opacus's own examples are tests/opacus/test_opacus_switch.py.
"""
import math
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import dpfx
from dpfx.opacus import PrivacyEngine
from dpfx.opacus.utils.batch_memory_manager import BatchMemoryManager
from dpfx.opacus.validators import ModuleValidator, UnsupportedModuleError

N, BATCH, LR = 256, 32, 0.5
FAST = {"backend": "eager"}


def small_net(frozen: bool = False, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(3)
    norm = nn.BatchNorm2d(4) if batchnorm else nn.GroupNorm(2, 4)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), norm, nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 6 * 6, 16), nn.ReLU(), nn.Linear(16, 3))
    if frozen:
        net[0].requires_grad_(False)
    return net


def loader(batch_size: int = BATCH, n: int = N) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def private(model=None, *, engine=None, dl=None, lr=LR, **kwargs):
    model = small_net() if model is None else model
    engine = PrivacyEngine() if engine is None else engine
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    args = dict(noise_multiplier=1.0, max_grad_norm=1.0, **FAST)
    args.update(kwargs)
    out = engine.make_private(module=model, optimizer=optimizer,
                              data_loader=loader() if dl is None else dl, **args)
    return (*out, engine)


def steps(model, optimizer, dl, n: int) -> list[float]:
    losses = []
    for i, (x, y) in enumerate(dl):
        if i == n:
            break
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- returned objects ----------------------------------------------------------------------------
@pytest.mark.parametrize("frozen", [False, True])
def test_make_private_returns_model_optimizer_loader_that_train(frozen):
    model, optimizer, dl, engine = private(small_net(frozen=frozen))
    assert isinstance(model, dpfx.DPModule) and isinstance(optimizer, dpfx.DPOptimizer)
    assert len(dl) == len(loader())                   # one epoch is len(data_loader) steps
    assert optimizer.noise_multiplier == 1.0 and optimizer.max_grad_norm == 1.0
    assert optimizer.expected_batch_size == BATCH      # q N, q = 1 / len(data_loader)
    steps(model, optimizer, dl, 2)
    assert engine.accountant.history == [(1.0, 1 / len(dl), 2)]


def test_ghost_mode_returns_the_criterion_third():
    criterion = nn.CrossEntropyLoss()
    out = private(grad_sample_mode="ghost", criterion=criterion)
    assert len(out) == 5 and out[2] is criterion
    model, optimizer, _, dl, _ = out
    steps(model, optimizer, dl, 1)


# -- the step's numbers ----------------------------------------------------------------------------
def vanilla_step(model, dl):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps(model, optimizer, dl, 1)
    return model


@pytest.mark.parametrize("clip,noise,match", [(1e6, 0.0, True), (0.1, 0.0, False),
                                              (1e6, 1.0, False)])
def test_without_clip_and_noise_the_step_is_plain_sgd(clip, noise, match):
    plain = vanilla_step(small_net(), loader())
    model, optimizer, dl, _ = private(poisson_sampling=False, max_grad_norm=clip,
                                      noise_multiplier=noise)
    assert dl is not None and not isinstance(dl.batch_sampler, dpfx.data.PoissonBatchSampler)
    steps(model, optimizer, dl, 1)
    same = all(torch.allclose(a, b, atol=1e-6, rtol=1e-4)
               for a, b in zip(plain.parameters(), model.parameters()))
    assert same == match


def test_flat_clipping_bounds_the_whole_gradient():
    model, optimizer, dl, _ = private(dl=loader(batch_size=1), poisson_sampling=False,
                                      noise_multiplier=0.0, max_grad_norm=0.05)
    steps(model, optimizer, dl, 1)        # D = 1: p.grad is the one clipped gradient
    norm = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    assert norm.item() == pytest.approx(0.05, rel=1e-3)


def test_per_layer_clipping_bounds_each_parameter():
    reference = small_net()
    x, y = next(iter(loader(batch_size=1)))
    nn.functional.cross_entropy(reference(x), y).backward()
    bound = 0.05
    model, optimizer, dl, _ = private(dl=loader(batch_size=1), poisson_sampling=False,
                                      noise_multiplier=0.0, clipping="per_layer",
                                      max_grad_norm=[bound] * 8)
    steps(model, optimizer, dl, 1)
    for p, ref in zip(model.parameters(), reference.parameters()):
        assert p.grad.norm().item() == pytest.approx(min(ref.grad.norm().item(), bound),
                                                     rel=1e-3)


@pytest.mark.slow
def test_noise_differs_between_runs_and_repeats_with_a_noise_generator():
    def run(generator=None):
        model, optimizer, dl, _ = private(poisson_sampling=False, noise_generator=generator)
        steps(model, optimizer, dl, 1)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    assert not torch.allclose(run(), run())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpfx.FixedSeedWarning)
        first = run(torch.Generator().manual_seed(7))
        assert torch.equal(first, run(torch.Generator().manual_seed(7)))


def test_noise_level_is_sigma_over_expected_batch_size():
    model, optimizer, dl, _ = private(noise_multiplier=50.0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    n = 3
    steps(model, optimizer, dl, n)
    params = sum(p.numel() for p in model.parameters())
    expected = n * params * (50.0 * LR / optimizer.expected_batch_size) ** 2
    real = sum((p.detach() ** 2).sum().item() for p in model.parameters())
    assert real == pytest.approx(expected, rel=0.15)


# -- validation and refusals ------------------------------------------------------------------------
def test_batchnorm_is_refused_and_fixed():
    model = small_net(batchnorm=True)
    before = snapshot(model)
    errors = ModuleValidator.validate(model, strict=False)
    assert errors and isinstance(errors[0], UnsupportedModuleError)
    with pytest.raises(UnsupportedModuleError, match="BatchNorm"):
        private(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    fixed = PrivacyEngine.get_compatible_module(model)
    assert fixed is not model and ModuleValidator.is_valid(fixed)
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())     # given one untouched
    x, _ = next(iter(loader()))
    assert ModuleValidator.is_valid(fixed, x)         # captured and every op checked
    private(fixed)


def test_optimizer_over_other_parameters_is_refused():
    model, other = small_net(), small_net()
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Module parameters are different"):
        PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader(),
                                     noise_multiplier=1.0, max_grad_norm=1.0)


@pytest.mark.parametrize("kwargs,error,says", [
    (dict(clipping="adaptive"), ValueError, "'flat'.*'per_layer'"),
    (dict(clipping="per_layer", max_grad_norm=[1.0]), ValueError, "list of 8 bounds"),
    (dict(clipping="flat", max_grad_norm=[1.0] * 8), ValueError, "per_layer"),
    (dict(grad_sample_mode="no_op"), ValueError, "per layer"),
    (dict(batch_first=False), ValueError, "dim 0"),
    (dict(wrap_model=False), ValueError, "returned model"),
    (dict(rand_on_empty=True), ValueError, "batch size 0"),
    (dict(clip_schedule=1), TypeError, "dpfx.make_private"),
])
def test_arguments_dpfx_cannot_honour_are_refused_untouched(kwargs, error, says):
    model = small_net()
    before = snapshot(model)
    with pytest.raises(error, match=says):
        private(model, **kwargs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_secure_mode_refuses_a_noise_generator_and_fixed_batches():
    with pytest.raises(ValueError, match="prohibited in secure mode"):
        private(engine=PrivacyEngine(secure_mode=True), noise_generator=torch.Generator())
    with pytest.raises(ValueError, match="poisson_sampling=True"):
        private(engine=PrivacyEngine(secure_mode=True), poisson_sampling=False)
    model, optimizer, dl, _ = private(engine=PrivacyEngine(secure_mode=True))
    assert optimizer.secure_mode and dl.batch_sampler.secure_mode
    steps(model, optimizer, dl, 1)


# -- accounting ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,dpfx_name", [("prv", "pld"), ("rdp", "rdp"), ("gdp", "pld")])
def test_accountant_names_map_to_dpfx_accountants(name, dpfx_name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = PrivacyEngine(accountant=name)
    assert engine.accountant.accountant == dpfx_name and engine.accountant.mechanism() == name
    assert any("central-limit" in str(w.message) for w in caught) == (name == "gdp")


def test_unknown_accountant_is_refused():
    with pytest.raises(ValueError, match="'prv' and 'gdp' with PLD"):
        PrivacyEngine(accountant="moments")


def test_epsilon_grows_with_steps_and_matches_opacus():
    opacus_accountants = pytest.importorskip("opacus.accountants")
    engine = PrivacyEngine()
    model, optimizer, dl, _ = private(engine=engine)
    epsilons = []
    for _ in range(3):
        steps(model, optimizer, dl, 1)
        epsilons.append(engine.get_epsilon(1e-5))
    assert epsilons == sorted(epsilons) and len(set(epsilons)) == 3
    theirs = opacus_accountants.PRVAccountant()
    theirs.history = engine.accountant.history
    assert epsilons[-1] == pytest.approx(theirs.get_epsilon(1e-5), rel=0.02)


@pytest.mark.slow
def test_make_private_with_epsilon_spends_the_target():
    engine = PrivacyEngine()
    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dl = loader(batch_size=64)
    model, optimizer, dl = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=dl, target_epsilon=2.0,
        target_delta=1e-5, epochs=2, max_grad_norm=1.0, **FAST)
    for _ in range(2):
        steps(model, optimizer, dl, len(dl))
    assert engine.accountant.history[0][2] == 2 * len(dl)
    assert engine.get_epsilon(1e-5) == pytest.approx(2.0, abs=0.01)


# -- virtual batches ----------------------------------------------------------------------------------
def test_batch_memory_manager_splits_logical_batches_and_steps_once_per_batch():
    model, optimizer, dl, engine = private(dl=loader(batch_size=64))
    sizes = []
    with BatchMemoryManager(data_loader=dl, max_physical_batch_size=16,
                            optimizer=optimizer) as physical:
        for x, y in physical:
            sizes.append(len(x))
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    assert max(sizes) <= 16 and len(sizes) > len(dl)
    assert engine.accountant.history == [(1.0, 1 / len(dl), len(dl))]


# -- checkpoints --------------------------------------------------------------------------------------
def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(1)
    m1, opt1, dl1, pe1 = private(small_net(), poisson_sampling=False, noise_multiplier=0.5)
    m2, opt2, _, pe2 = private(nn.Sequential(*[m for m in small_net()]), noise_multiplier=2.0)
    with torch.no_grad():
        for p in m2.parameters():
            p.add_(1.0)
    steps(m1, opt1, dl1, 3)
    path = tmp_path / "run.ckpt"
    pe1.save_checkpoint(path=path, module=m1, optimizer=opt1, checkpoint_dict={"foo": "bar"})
    extra = pe2.load_checkpoint(path=path, module=m2, optimizer=opt2)
    assert extra == {"foo": "bar"}
    assert pe1.accountant.state_dict() == pe2.accountant.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(),
                                                  m2.state_dict().values()))
    assert opt1.noise_multiplier != opt2.noise_multiplier      # fixed with each compiled model
    with pytest.raises(ValueError, match="schedulers"):
        pe1.save_checkpoint(path=path, module=m1, optimizer=opt1, noise_scheduler=object())
    assert math.isfinite(pe2.get_epsilon(1e-5))
