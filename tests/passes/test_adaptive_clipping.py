"""Adaptive clipping (``clipping="adaptive"``, Andrew et al. 2021): the graph clips to a bound
C_t that it reads as an input, and releases the count of unclipped examples beside the gradient.

At sigma 0 every step equals the batch-of-one reference clipped with that step's C_t, and the
next bound is C_t exp(-eta (b_t - gamma)) of the reference's own count, through Inductor with the
self-check on and through eager, both loss reductions, ghost and materialize, noise in the graph
and at the optimizer; a new bound compiles nothing; one canary moves the release by at most
C_t / D; the verifier refuses a clip factor, a noise std or a count that does not read the one
bound input as Note [The adaptive bound is proven as an input] (passes/verify/adaptive.py) says."""
import math
import warnings

import pytest
import torch

import dpfx
from dpfx.config import DPConfig
from dpfx.passes.verify import verify_backward
from support.models import MLP, mse
from support.reference import (assert_close, bound_that_bites, loop_dp_sgd_grads,
                               loop_example_grads, per_example_norms, run_dpfx_multi)

ETA, GAMMA = 0.5, 0.5


def _sse(out, y):
    return (out - y).pow(2).sum()


def _expected_next(c, norms, denominator):
    """Andrew et al.'s update with sigma_b = 0, written on its own: b = sum_i (1[n_i <= C] - 1/2)
    / D + 1/2, C exp(-eta (b - gamma)); without a denominator the bound stays."""
    if denominator == 0:
        return c
    centered = sum((1.0 if float(n) <= c else 0.0) - 0.5 for n in norms)
    return c * math.exp(-ETA * (centered / denominator + 0.5 - GAMMA))


def _steps(dp, model, loss_fn, reduction, batches, expected, step, tol):
    """Each batch through ``step``; its gradient against the reference at the bound the step
    started from, and the bound after it against ``_expected_next``."""
    g = torch.Generator().manual_seed(0)
    bites = 0
    for b in batches:
        x, y = torch.randn(b, 8, generator=g) * 2, torch.randn(b, 4, generator=g)
        c = dp.adaptive_clip.bound
        norms = per_example_norms(loop_example_grads(model, loss_fn, (x,), y)) if b else []
        bites += sum(float(n) > c for n in norms)
        got = step(x, y)
        want = loop_dp_sgd_grads(model, loss_fn, (x,), y, max_grad_norm=c,
                                 loss_reduction=reduction, expected_batch_size=expected)
        try:
            assert_close(got, want, **tol)
        except AssertionError as e:
            raise AssertionError(f"batch size {b}, C_t = {c}: {e}") from None
        assert dp.adaptive_clip.bound == pytest.approx(
            _expected_next(c, norms, expected or b), rel=1e-6), f"batch size {b}"
    assert bites > 0, "clipping must bite on some step"
    assert dp.compile_count == 2, "a new bound compiles nothing"


def _first_bound(model, loss_fn):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 8, generator=g) * 2, torch.randn(5, 4, generator=g)
    # off the median norm itself, so that no example's norm ties with C_0 (where the count
    # would hang on the last bit of a norm)
    return 0.97 * bound_that_bites(per_example_norms(loop_example_grads(model, loss_fn, (x,), y)))


@pytest.mark.parametrize("reduction,strategy", [("mean", "materialize"), ("sum", "ghost")])
def test_each_step_is_the_reference_at_its_bound_through_inductor(reduction, strategy):
    """Through Inductor with the self-check on (the backward compared on synthetic batches with
    a bound input of its own), batch sizes 5, 0, 1, 3 through one compiled pair."""
    torch.manual_seed(0)
    model = MLP()
    loss_fn = mse if reduction == "mean" else _sse
    expected = 4 if reduction == "mean" else None
    dp = dpfx.compile(model, max_grad_norm=_first_bound(model, loss_fn), noise_multiplier=0.0,
                      loss_reduction=reduction, expected_batch_size=expected, strategy=strategy,
                      clipping="adaptive", clip_lr=ETA, target_unclipped_quantile=GAMMA)
    assert dp.dp_config.backend == "inductor" and dp.dp_config.self_check

    def step(x, y):
        return run_dpfx_multi(dp, model, loss_fn, (x,), y, reduction)

    _steps(dp, model, loss_fn, reduction, [5, 0, 1, 3], expected, step,
           {"rtol": 2e-4, "atol": 1e-6})
    checks = list(dp._dpfx_backend._checks.values())
    assert checks and all(c.done and c.backward is not None for c in checks)


@pytest.mark.parametrize("reduction,strategy,backend", [("mean", "ghost", "eager"),
                                                        ("sum", "materialize", "eager"),
                                                        ("mean", "materialize", "inductor")])
def test_each_step_is_the_reference_with_noise_at_the_optimizer(reduction, strategy, backend):
    """noise="optimizer": the graph returns the raw count and DPOptimizer.step noises it once
    and moves the bound, after releasing the gradient at the step's C_t."""
    torch.manual_seed(1)
    model = MLP()
    loss_fn = mse if reduction == "mean" else _sse
    expected = 4 if reduction == "mean" else None
    dp = dpfx.compile(model, max_grad_norm=_first_bound(model, loss_fn), noise_multiplier=0.0,
                      loss_reduction=reduction, expected_batch_size=expected, strategy=strategy,
                      backend=backend, noise="optimizer", clipping="adaptive", clip_lr=ETA,
                      target_unclipped_quantile=GAMMA)
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp)

    def step(x, y):
        opt.zero_grad()
        out = dp(x)
        (loss_fn(out, y) if x.shape[0] else out.sum() * 0.0).backward()
        opt.step()
        return {k: p.grad.detach().clone() for k, p in model.named_parameters()}

    _steps(dp, model, loss_fn, reduction, [5, 1, 3, 0], expected, step,
           {"rtol": 2e-4, "atol": 1e-6} if backend == "inductor" else {})


def test_a_new_bound_compiles_nothing():
    """dynamo captures once and dpfx compiles one forward and one backward graph, whatever C_t."""
    from torch._dynamo.utils import counters

    counters.clear()
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=0.0, clipping="adaptive",
                      clip_lr=1.0, backend="eager")
    bounds = []
    for _ in range(4):
        run_dpfx_multi(dp, model, mse, (torch.randn(6, 8) * 3,), torch.randn(6, 4))
        bounds.append(dp.adaptive_clip.bound)
    assert len(set(bounds)) == 4
    assert dp.compile_count == 2
    assert counters["stats"]["unique_graphs"] == 1


def test_one_canary_moves_the_release_by_at_most_the_step_bound_over_d():
    """An auditor's check at sigma 0, at a step whose bound has moved away from C_0: adding one
    example, however large its gradient, moves the release by at most C_t / D."""
    torch.manual_seed(2)
    model = MLP()
    d = 4
    dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=d,
                      clipping="adaptive", clip_lr=1.0, target_unclipped_quantile=0.9)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for _ in range(3):
        run_dpfx_multi(dp, model, mse, (x,), y)
    state = dp.adaptive_clip.state_dict()
    c = state["bound"]
    assert abs(c - 0.5) > 0.05
    without = run_dpfx_multi(dp, model, mse, (x,), y)
    dp.adaptive_clip.load_state_dict(state)     # the same C_t for the second release
    canary_x, canary_y = torch.full((1, 8), 50.0), torch.full((1, 4), -50.0)
    with_canary = run_dpfx_multi(dp, model, mse, (torch.cat([x, canary_x]),),
                                 torch.cat([y, canary_y]))
    moved = torch.sqrt(sum((with_canary[k] - without[k]).pow(2).sum() for k in without))
    assert moved <= c / d * (1 + 1e-5)
    assert moved >= 0.9 * c / d


# -- the verifier ------------------------------------------------------------------------------

def _adaptive_backward(noise="graph"):
    model = MLP()
    kwargs = dict(max_grad_norm=0.1, noise_multiplier=1.0, count_noise_multiplier=2.0,
                  backend="eager", clipping="adaptive", strategy="materialize", noise=noise)
    dp = dpfx.compile(model, **kwargs)
    dp(torch.randn(3, 8))
    config = DPConfig(0.1, 1.0, backend="eager", noise=noise,
                      clip=dpfx.Clipping("adaptive", count_noise_multiplier=2.0))
    return dp._dpfx_backend.last_backward, config


def _tagged(result, tag):
    return [n for n in result.gm.graph.nodes if n.meta.get("dpfx") == tag]


def _verify(result, config):
    verify_backward(result.gm, result.analysis,
                    {k: v for k, v in result.private.items()}, config)


@pytest.mark.parametrize("noise", ["graph", "optimizer"])
def test_intact_adaptive_graph_verifies(noise):
    result, config = _adaptive_backward(noise)
    _verify(result, config)
    bound = result.gm.graph.find_nodes(op="placeholder")[-1]
    assert bound.meta["dpfx"] == "clip_bound"
    factor = _tagged(result, "clip_factor")[0]
    assert factor.args[1].args[0].args[1] is bound     # C_t is the input, not a constant
    if noise == "graph":
        (std,) = _tagged(result, "noise_std")
        assert std.args == (bound, config.grad_noise_multiplier)


def _other_input(result):
    """A second 0-d float32 input, before the bound (which stays last)."""
    graph = result.gm.graph
    bound = graph.find_nodes(op="placeholder")[-1]
    with graph.inserting_before(bound):
        other = graph.placeholder("other_bound")
    other.meta["val"] = bound.meta["val"]
    return other


def test_a_factor_reading_another_input_than_the_noise_is_refused():
    """The noise is sigma_grad * C_t of the bound input; a factor that clips to another input
    (say, a larger bound) would let examples past what the noise covers."""
    result, config = _adaptive_backward()
    ratio = _tagged(result, "clip_factor")[0].args[1].args[0]
    ratio.args = (ratio.args[0], _other_input(result))
    with pytest.raises(dpfx.PrivacyError, match="clip factor"):
        _verify(result, config)


def test_a_noise_std_reading_another_input_or_a_constant_is_refused():
    result, config = _adaptive_backward()
    (std,) = _tagged(result, "noise_std")
    std.args = (_other_input(result), std.args[1])
    with pytest.raises(dpfx.PrivacyError, match="sigma_grad"):
        _verify(result, config)
    result, config = _adaptive_backward()
    scale = _tagged(result, "noise_scale")[0]
    scale.args = (scale.args[0], config.grad_noise_multiplier * 0.1)
    with pytest.raises(dpfx.PrivacyError, match="sigma_grad"):
        _verify(result, config)


def test_the_user_sigma_instead_of_sigma_grad_is_refused():
    """sigma_grad > sigma: noising the gradient with sigma leaves nothing for the count."""
    result, config = _adaptive_backward()
    (std,) = _tagged(result, "noise_std")
    std.args = (std.args[0], 1.0)
    with pytest.raises(dpfx.PrivacyError, match="sigma_grad"):
        _verify(result, config)


def test_a_bound_that_is_not_the_last_input_is_refused():
    """The backend appends C_t to the backward's arguments: a bound placeholder elsewhere would
    be fed another tensor."""
    result, config = _adaptive_backward()
    graph = result.gm.graph
    first = graph.find_nodes(op="placeholder")[0]
    with graph.inserting_before(first):
        late = graph.placeholder("after_bound")
    late.meta["val"] = first.meta["val"]
    bound = graph.find_nodes(op="placeholder")[-1]
    bound.append(late)      # now the bound is not last
    with pytest.raises(dpfx.PrivacyError, match="its last"):
        _verify(result, config)


@pytest.mark.parametrize("plant", ["uncentered", "not_a_flag", "count_noise", "other_bound"])
def test_a_count_that_is_not_the_proven_form_is_refused(plant):
    """The count's sensitivity is 1/2 because each term is float(bool) - 1/2: an uncentered
    count (sensitivity 1 under the noise of 1/2), a sum of norms, another sigma_b, or a flag
    against another bound is refused."""
    result, config = _adaptive_backward()
    (count,) = _tagged(result, "unclipped_count")
    centered = count.args[0]
    if plant == "uncentered":
        centered.args = (centered.args[0], 0.0)
    elif plant == "not_a_flag":
        norm = _tagged(result, "per_sample_norms")[0]
        centered.args = (norm, 0.5)
    elif plant == "count_noise":
        (scale,) = _tagged(result, "count_noise_scale")
        scale.args = (scale.args[0], 0.5)
    else:
        flags = centered.args[0].args[0]
        le = flags.args[1]
        le.args = (le.args[0], _other_input(result))
    with pytest.raises(dpfx.PrivacyError, match="count of unclipped examples"):
        _verify(result, config)


@pytest.mark.parametrize("kwargs,match", [
    (dict(count_noise_multiplier=0.5), "must exceed noise_multiplier / 2"),
    (dict(count_noise_multiplier=None), "needs count_noise_multiplier"),
    (dict(max_grad_norm={"": 1.0}), "per-layer adaptive bounds are not supported"),
    (dict(target_unclipped_quantile=1.0), "target_unclipped_quantile must be"),
    (dict(clip_lr=0.0), "clip_lr must be"),
    (dict(clipping="flat"), "pass clipping='adaptive' too"),
])
def test_bad_adaptive_options_are_refused(kwargs, match):
    settings = {"max_grad_norm": 1.0, "noise_multiplier": 1.0, "clipping": "adaptive",
                "count_noise_multiplier": 5.0, **kwargs}
    with warnings.catch_warnings(), pytest.raises(dpfx.OptionError, match=match):
        dpfx.compile(MLP(), **settings)


def test_sigma_grad_composes_with_the_count_to_sigma():
    config = DPConfig(1.0, 1.0, clip=dpfx.Clipping("adaptive", count_noise_multiplier=2.0))
    s = config.grad_noise_multiplier
    assert s > 1.0
    assert (s ** -2 + (2 * 2.0) ** -2) ** -0.5 == pytest.approx(1.0, rel=1e-12)
    assert DPConfig(1.0, 0.0, clip=dpfx.Clipping("adaptive")).grad_noise_multiplier == 0.0
