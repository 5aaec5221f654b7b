"""DPAdamBC (dpfx/loop/adambc.py) against independent references: torch.optim.Adam / AdamW when the
noise variance is 0, the equations of Tang et al. (2024) written per coordinate in plain Python
when it is not, Opake's AdamW-BC on recorded gradients, and a private run through dpfx.compile
(Inductor) and DPOptimizer whose released gradients are checked to carry noise of variance Phi."""
import copy
import io
import math

import pytest
import torch

import dpfx
from dpfx.loop.adambc import DPAdamBC
from torch._dynamo.utils import counters
from support.models import MLP, mse
from support.noise_stats import assert_gaussian_scale
from support.reference import dp_sgd_grads


def reference_steps(theta, grads, phis, *, lr, betas, gamma, eps=0.0, weight_decay=0.0,
                    decoupled=False):
    """The paper's Algorithm 1, one coordinate at a time in Python floats: m_hat / (sqrt(max(
    v_hat - Phi_bar_t, gamma)) + eps), Phi_bar_t the (1 - beta2)-weighted mean of the steps'
    Phi_i that v_hat's noise part averages (= Phi when it is constant). Returns the parameters
    after each step."""
    b1, b2 = betas
    theta = list(theta)
    m, v = [0.0] * len(theta), [0.0] * len(theta)
    out = []
    for t, (g, _) in enumerate(zip(grads, phis), start=1):
        g = list(g)
        if weight_decay and decoupled:
            theta = [th * (1 - lr * weight_decay) for th in theta]
        elif weight_decay:
            g = [gi + weight_decay * th for gi, th in zip(g, theta)]
        phi_bar = sum((1 - b2) * b2 ** (t - i) * phis[i - 1] for i in range(1, t + 1)) \
            / (1 - b2 ** t)
        for j in range(len(theta)):
            m[j] = b1 * m[j] + (1 - b1) * g[j]
            v[j] = b2 * v[j] + (1 - b2) * g[j] * g[j]
            m_hat, v_hat = m[j] / (1 - b1 ** t), v[j] / (1 - b2 ** t)
            theta[j] -= lr * m_hat / (math.sqrt(max(v_hat - phi_bar, gamma)) + eps)
        out.append(list(theta))
    return out


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return MLP(4, 6, 3).to(dtype)


def _grad_sequence(model, steps, scale=1.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g, dtype=p.dtype) * scale
             for p in model.parameters()] for _ in range(steps)]


def _run(model, opt, grads, scheduler=None):
    for step in grads:
        for p, g in zip(model.parameters(), step):
            p.grad = g.clone()
        opt.step()
        if scheduler is not None:
            scheduler.step()


@pytest.mark.parametrize("weight_decay,decoupled", [(0.0, False), (0.1, False), (0.1, True)])
def test_without_noise_it_is_torch_adam(weight_decay, decoupled):
    """Phi = 0 and a floor below every v_hat: torch.optim.Adam (L2) or AdamW (decoupled),
    bit for bit, over 6 steps and an LR schedule that halves lr every 2 steps."""
    ours, theirs = _model(), _model()
    grads = _grad_sequence(ours, 6)
    opt = DPAdamBC(ours.parameters(), lr=0.05, betas=(0.8, 0.95), gamma=1e-30, eps=1e-8,
                   weight_decay=weight_decay, decoupled_weight_decay=decoupled)
    opt.dp_noise_variance = 0.0
    kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = kind(theirs.parameters(), lr=0.05, betas=(0.8, 0.95), eps=1e-8,
               weight_decay=weight_decay)
    _run(ours, opt, grads, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
    _run(theirs, ref, grads, torch.optim.lr_scheduler.StepLR(ref, 2, 0.5))
    assert opt.param_groups[0]["lr"] == 0.05 / 8
    start = _model()
    for a, b, p0 in zip(ours.parameters(), theirs.parameters(), start.parameters()):
        assert not torch.equal(a, p0)                   # it stepped
        assert torch.equal(a, b)
    for p in ours.parameters():
        assert opt.state[p]["noise_variance_sum"] == 0.0 and opt.state[p]["step"] == 6


@pytest.mark.parametrize("weight_decay,decoupled", [(0.0, False), (0.05, False), (0.05, True)])
@pytest.mark.parametrize("varying", [False, True])
def test_each_step_is_the_papers_update(weight_decay, decoupled, varying):
    """Phi > 0, constant (the paper) or changing per step (correlated noise): every step of a
    float64 model against ``reference_steps``; the floor binds on some coordinates and not on
    others, so both sides of the max are checked."""
    model = _model(dtype=torch.float64)
    grads = _grad_sequence(model, 5, scale=0.3)
    phis = [0.04, 0.09, 0.01, 0.05, 0.02] if varying else [0.04] * 5
    gamma = 0.005
    opt = DPAdamBC(model.parameters(), lr=0.01, betas=(0.9, 0.99), gamma=gamma,
                   weight_decay=weight_decay, decoupled_weight_decay=decoupled)
    flat0 = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    flat_grads = [torch.cat([g.flatten() for g in step]).tolist() for step in grads]
    want = reference_steps(flat0, flat_grads, phis, lr=0.01, betas=(0.9, 0.99), gamma=gamma,
                           weight_decay=weight_decay, decoupled=decoupled)
    floored = []
    for step, phi, expected in zip(grads, phis, want):
        for p, g in zip(model.parameters(), step):
            p.grad = g.clone()
        opt.dp_noise_variance = phi
        opt.step()
        got = torch.cat([p.detach().flatten() for p in model.parameters()])
        torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64),
                                   rtol=1e-12, atol=1e-12)
        t = opt.state[next(iter(model.parameters()))]["step"].item()
        s = torch.cat([(opt.state[p]["exp_avg_sq"] - opt.state[p]["noise_variance_sum"])
                       .flatten() / (1 - 0.99 ** t) for p in model.parameters()])
        floored.append((s < gamma).double().mean().item())
    assert 0.05 < sum(floored) / len(floored) < 0.95, floored


def test_a_step_without_the_noise_variance_is_refused():
    """dp_noise_variance exists from construction as None; a step then (or with a value that is
    not a variance) is refused and changes nothing."""
    model = _model()
    opt = DPAdamBC(model.parameters(), lr=0.1)
    assert opt.dp_noise_variance is None
    before = copy.deepcopy(model.state_dict())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"dp_noise_variance is None.*dpfx\.DPOptimizer"):
        opt.step()
    for bad in (-1e-3, float("nan"), float("inf"), "0.1", torch.ones(3)):
        opt.dp_noise_variance = bad
        with pytest.raises(ValueError, match="dp_noise_variance must be a finite float >= 0"):
            opt.step()
    assert not opt.state
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    opt.dp_noise_variance = torch.tensor(0.01)          # a 0-d tensor is a number: it steps
    opt.step()
    assert all(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_amsgrad_and_bad_settings_are_refused():
    model = _model()
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        DPAdamBC(model.parameters(), amsgrad=True)
    opt = DPAdamBC(model.fc1.parameters())
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        opt.add_param_group({"params": model.fc2.parameters(), "amsgrad": True})
    assert len(opt.param_groups) == 1
    for kwargs in (dict(gamma=0.0), dict(lr=-1.0), dict(betas=(1.0, 0.9)), dict(eps=-1e-8)):
        with pytest.raises(ValueError, match="DPAdamBC: invalid"):
            DPAdamBC(model.parameters(), **kwargs)


def test_state_dict_round_trip_and_resume():
    """Three steps, a checkpoint through torch.save, a fresh optimizer loads it and takes three
    more: the same parameters, bit for bit, as six steps in one go. Adam's own state (moments
    without the noise variance's sum) is refused."""
    grads = _grad_sequence(_model(), 6)
    phis = [0.02, 0.03, 0.01, 0.02, 0.05, 0.04]

    def steps(model, opt, gs, ps):
        for g, phi in zip(gs, ps):
            opt.dp_noise_variance = phi
            _run(model, opt, [g])

    whole = _model()
    opt = DPAdamBC(whole.parameters(), lr=0.05, gamma=1e-3, weight_decay=0.01,
                   decoupled_weight_decay=True)
    steps(whole, opt, grads, phis)

    first = _model()
    opt1 = DPAdamBC(first.parameters(), lr=0.05, gamma=1e-3, weight_decay=0.01,
                    decoupled_weight_decay=True)
    steps(first, opt1, grads[:3], phis[:3])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = _model(seed=5)
    resumed.load_state_dict(saved["model"])
    opt2 = DPAdamBC(resumed.parameters(), lr=0.05, gamma=1e-3, weight_decay=0.01,
                    decoupled_weight_decay=True)
    opt2.load_state_dict(saved["opt"])
    assert opt2.state[resumed.fc1.weight]["noise_variance_sum"] > 0
    steps(resumed, opt2, grads[3:], phis[3:])
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert copy.deepcopy(opt2).dp_noise_variance == phis[-1]

    adam = torch.optim.Adam(first.parameters())
    _run(first, adam, grads[:1])
    with pytest.raises(ValueError, match="no noise_variance_sum: it comes from another"):
        DPAdamBC(first.parameters()).load_state_dict(adam.state_dict())


def test_gaussian_noise_variance():
    assert DPAdamBC.gaussian_noise_variance(1.1, 1.0, 256) == (1.1 / 256) ** 2
    # per-layer bounds: S = sqrt(3^2 + 4^2) = 5
    assert DPAdamBC.gaussian_noise_variance(2.0, {"fc1": 3.0, "fc2": 4.0}, 10) == 1.0
    assert DPAdamBC.gaussian_noise_variance(1.0, 0.5, 1) == 0.25      # loss_reduction="sum"
    with pytest.raises(ValueError, match="divisor"):
        DPAdamBC.gaussian_noise_variance(1.0, 1.0, 0)


_COMPILES = ("fxgraph_cache_miss", "fxgraph_cache_hit", "fxgraph_cache_bypass")


def test_through_dpfx_compile_and_dp_optimizer():
    """A private run (Inductor, noise added by DPOptimizer) with dp_noise_variance set by hand
    from the helper: the released gradients minus the clipped reference are N(0, Phi), and the
    parameters after 4 steps are the plain-Python update of those released gradients."""
    sigma, c, d = 4.0, 0.5, 8
    torch.manual_seed(0)
    model = MLP(8, 32, 3)
    x, y = torch.randn(6, 8) * 3, torch.randn(6, 3)
    dp = dpfx.compile(model, max_grad_norm=c, noise_multiplier=sigma, expected_batch_size=d,
                      seed=11, noise="optimizer")
    inner = DPAdamBC(model.parameters(), lr=1e-3, gamma=1e-3)
    inner.dp_noise_variance = DPAdamBC.gaussian_noise_variance(sigma, c, d)
    assert inner.dp_noise_variance == (dp.dp_config.noise_std / d) ** 2
    opt = dpfx.DPOptimizer(inner, dp)
    released, compiled = [], sum(counters["inductor"][k] for k in _COMPILES)
    inner.register_step_pre_hook(lambda o, args, kwargs: released.append(
        [p.grad.detach().clone() for p in model.parameters()]))
    start = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    noise = []
    for _ in range(4):
        clean = dp_sgd_grads(model, mse, x, y, max_grad_norm=c, expected_batch_size=d)
        opt.zero_grad()
        mse(dp(x), y).backward()
        opt.step()
        noise.append(torch.cat([(g - clean[n]).flatten() for g, (n, _) in
                                zip(released[-1], model.named_parameters())]))
    assert len(released) == 4 and dp.dp_config.backend == "inductor"
    assert sum(counters["inductor"][k] for k in _COMPILES) > compiled   # Inductor lowered it
    assert_gaussian_scale(torch.stack(noise), math.sqrt(inner.dp_noise_variance),
                          "the released gradients' noise")
    want = reference_steps(start.tolist(),
                           [torch.cat([g.flatten() for g in r]).double().tolist()
                            for r in released],
                           [inner.dp_noise_variance] * 4, lr=1e-3, betas=(0.9, 0.999),
                           gamma=1e-3)[-1]
    got = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-5,
                               atol=1e-6)
    assert inner.state[model.fc1.weight]["noise_variance_sum"] > 0


# Opake 0.16.1 (opake-optimizers 0.16.1, torchopt 0.7.3, PyPI), ``opake.optimizers.adamw(lr=0.01,
# betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, decoupled_weight_decay=..., noise_bias_correction=
# True)`` fed ``NoisedPytree(pytree={"w": g_t}, max_norm=1.0, noise_stddev=0.1)`` in float64, from
# w = OPAKE_START, on the four gradients below (coordinates 0-3: signal + N(0, 0.1^2) noise;
# 4-5: noise only). Recorded 2026-12-02.
OPAKE_START = [0.5, -1.0, 2.0, 0.25, 1.0, -0.5]
OPAKE_GRADS = [
    [1.1540996108244044, -2.029342890576095, 0.4821210617925442, 1.5568431277280668,
     -0.10845223424240209, -0.13985953953708768],
    [1.04033468476293, -1.916197366700234, 0.6280742421530641, 1.4596656475067826,
     -0.05966353626151273, 0.018203648506130553],
    [0.9143325406703626, -1.8899395829096572, 0.5928812636890852, 1.5122701239163312,
     -0.05663174751548547, 0.03731146341824996],
    [0.9108004685193437, -2.1509107744632203, 0.7370393533373815, 1.6456502606790337,
     0.09398099079535258, 0.07748488177844169]]
OPAKE_STEPS = {   # (weight_decay, decoupled): w after each step
    (0.0, True): [
        [0.48996224831701785, -0.989987836762766, 1.9897776922678463, 0.2399793069095319,
         1.0258374328272652, -0.4856963322659219],
        [0.479961137145404, -0.9799940523387807, 1.9796319217312133, 0.22997929623388108,
         1.0352957635332396, -0.4800127660119537],
        [0.47003966042332057, -0.9700102898194278, 1.969468964363603, 0.21997042331360697,
         1.044602932150353, -0.4774010124400874],
        [0.4601495765232347, -0.9599865130273184, 1.959289851041261, 0.20993022971414296,
         1.047569737494195, -0.4782410591654087]],
    (0.1, True): [
        [0.48946224831701785, -0.988987836762766, 1.9877776922678463, 0.2397293069095319,
         1.0248374328272651, -0.4851963322659219],
        [0.478971674897087, -0.9780050645020179, 1.9756441440389454, 0.22948956692697156,
         1.0332709261004123, -0.4790275696796878],
        [0.4685712265001064, -0.9670432969181629, 1.963505542527296, 0.21925120443977048,
         1.0415448237914253, -0.4759367885381418],
        [0.45821257137352045, -0.9560524768291353, 1.951362923662427, 0.2089917596358667,
         1.043470084311476, -0.47630089847492496]],
    (0.1, False): [
        [0.4899653344710016, -0.9899889542284416, 1.989890776320681, 0.2399799577756705,
         1.0099999881688226, -0.48823595971761913],
        [0.47996588746111163, -0.9799954633305035, 1.979798551576412, 0.22998048762108905,
         1.004050999346814, -0.4767220120907684],
        [0.470042265183493, -0.9700117523309505, 1.9696972776216406, 0.2199725590346963,
         0.9962599609049009, -0.4621353161045607],
        [0.46014928212987727, -0.9599895795449984, 1.9595667719791612, 0.20993380569687728,
         0.9532003313551033, -0.4579218383824859]]}


@pytest.mark.parametrize("weight_decay,decoupled", sorted(OPAKE_STEPS))
def test_agrees_with_opake_where_the_signal_exceeds_the_noise(weight_decay, decoupled):
    """Opake's AdamW-BC subtracts the same beta2-weighted mean of Phi (Chooi et al. 2025) and
    adds eps after the root, so on the coordinates where v_hat > Phi at every step (0-3) the two
    agree to rounding. Where v_hat - Phi <= 0 they part by design: Opake falls back to the
    uncorrected v_hat (an Adam step), DPAdamBC floors at gamma as Tang et al. do (a step of
    m_hat / sqrt(gamma)), so coordinates 4-5 differ once the noise overtakes v_hat."""
    w = torch.nn.Parameter(torch.tensor(OPAKE_START, dtype=torch.float64))
    opt = DPAdamBC([w], lr=0.01, eps=1e-8, gamma=1e-30, weight_decay=weight_decay,
                   decoupled_weight_decay=decoupled)
    opt.dp_noise_variance = 0.1 ** 2
    parted = False
    for g, theirs in zip(OPAKE_GRADS, OPAKE_STEPS[(weight_decay, decoupled)]):
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        torch.testing.assert_close(w.detach()[:4], torch.tensor(theirs[:4], dtype=torch.float64),
                                   rtol=1e-13, atol=1e-13)
        s = opt.state[w]
        below = (s["exp_avg_sq"] - s["noise_variance_sum"] <= 0)[4:]
        parted |= bool(below.any())
        for j in range(4, 6):
            if not below[j - 4] and not parted:     # before any floor the histories agree
                assert w[j].item() == pytest.approx(theirs[j], rel=1e-13, abs=1e-13)
    assert parted
    assert abs(w[4].item() - OPAKE_STEPS[(weight_decay, decoupled)][-1][4]) > 1.0
