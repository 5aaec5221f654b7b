"""Clip functions (``clipping=``): "flat", "per_layer" and "automatic" (every example scaled by
C / (||g_i|| + gamma), Bu et al. 2022). Each is exact against the batch-of-one reference
(tests/support/reference.py, which writes the factor on its own), through the eager sweep and
through Inductor with the self-check on; one canary example moves the release by at most C/D;
the verifier refuses a clip factor that could let an example past C; bad options leave the model
untouched."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import dpfx
from dpfx.config import DPConfig
from dpfx.passes.verify import verify_backward
from support import sweep
from support.models import MLP, SeqModel, TiedLM, mse, tiny_gpt2_lm
from support.reference import (assert_close, check_one_compiled_pair, loop_dp_sgd_grads,
                               run_dpfx_multi)

GAMMA = 0.01


def _over_batch(per_example, reduction):
    return per_example.mean() if reduction == "mean" else per_example.sum()


def _models(kind, d, reduction):
    """(model, loss, make). Each loss is a mean or a sum over the batch of per-example terms with
    no scalar of their own: automatic clipping's C / (||g_i|| + gamma) depends on the scale of
    g_i, and dpfx takes each example's term with every scalar after the batch reduction removed
    (Note [The per-example term] in dpfx/loss/check.py), which the batch-of-one reference then
    computes too."""
    torch.manual_seed(d)
    if kind == "mlp":
        model = MLP(d_in=d)

        def make(b, g):
            return (torch.randn(b, d, generator=g) * 3,), torch.randn(b, 4, generator=g)

        def loss(out, y):
            return _over_batch((out - y).pow(2).sum(1), reduction)
        return model, loss, make
    if kind == "seq":
        model = SeqModel(T=3, d=d)

        def make(b, g):
            return (torch.randn(b, 3, d, generator=g) * 3,), torch.randint(0, 4, (b,), generator=g)

        def loss(out, y):
            return _over_batch(F.cross_entropy(out, y, reduction="none"), reduction)
        return model, loss, make
    model = TiedLM(vocab=5, d=d)

    def make(b, g):
        return ((torch.randint(0, 5, (b, 3), generator=g),),
                torch.randint(0, 5, (b, 3), generator=g))

    def loss(out, y):
        tokens = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none")
        return _over_batch(tokens.view(y.shape).sum(1), reduction)
    return model, loss, make


@settings(max_examples=sweep.examples(9), deadline=None)
@given(kind=st.sampled_from(["mlp", "seq", "tied"]), d=st.integers(2, 6),
       reduction=st.sampled_from(["mean", "sum"]),
       strategy=st.sampled_from(["materialize", "ghost"]),
       bounds=st.sampled_from(["flat", "per_layer"]),
       gamma=st.sampled_from([GAMMA, 1.0]))
def test_automatic_clipping_equals_the_reference(kind, d, reduction, strategy, bounds, gamma):
    torch._dynamo.reset()
    model, loss_fn, make = _models(kind, d, reduction)
    first = next(n for n, _ in model.named_children())
    c = 0.7 if bounds == "flat" else {"": 0.7, first: 0.3}
    expected = 3 if reduction == "mean" else None
    dp = dpfx.compile(model, max_grad_norm=c, noise_multiplier=0.0, loss_reduction=reduction,
                      expected_batch_size=expected, backend="eager", strategy=strategy,
                      clipping="automatic", clipping_gamma=gamma)
    for b in (0, 1, 4, d):
        inputs, y = make(b, torch.Generator().manual_seed(b))
        got = run_dpfx_multi(dp, model, loss_fn, inputs, y, reduction)
        want = loop_dp_sgd_grads(model, loss_fn, inputs, y, max_grad_norm=c,
                                 loss_reduction=reduction, expected_batch_size=expected,
                                 gamma=gamma)
        try:
            assert_close(got, want, rtol=1e-4, atol=1e-6)
        except AssertionError as e:
            raise AssertionError(f"batch size {b}: {e}") from None
    assert dp.compile_count == 2


def test_automatic_clipping_through_inductor_gpt2():
    """A Hugging Face GPT-2 (tied head, attention) through Inductor with the self-check on, at
    batch sizes 0, 1 and 4 (the sequence length: a size that collides with another dim)."""
    torch.manual_seed(0)
    model, _, make = tiny_gpt2_lm(t=4)

    def token_sums(out, y):       # each example's term: the sum of its tokens' losses
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum") / y.shape[0]

    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=3,
                      clipping="automatic")
    assert dp.dp_config.backend == "inductor" and dp.dp_config.self_check
    check_one_compiled_pair(dp, model, token_sums, make, [3, 0, 1, 4], "mean",
                            max_grad_norm=0.05, divisor=3, bites=False, gamma=GAMMA)


def test_automatic_clipping_with_noise_at_the_optimizer():
    torch.manual_seed(1)
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=0.0, loss_reduction="sum",
                      noise="optimizer", backend="eager", clipping="automatic")
    x, y = torch.randn(5, 8) * 3, torch.randn(5, 4)

    def sse(out, y):
        return (out - y).pow(2).sum()

    sse(dp(x), y).backward()
    want = loop_dp_sgd_grads(model, sse, (x,), y, max_grad_norm=0.5, loss_reduction="sum",
                             gamma=GAMMA)
    assert_close({k: v.clone() for k, v in dp.clipped_sums.items()}, want, rtol=1e-5)


@pytest.mark.parametrize("clipping", ["flat", "automatic"])
def test_one_canary_moves_the_release_by_at_most_c_over_d(clipping):
    """An auditor's check at sigma 0: adding one example, however large its gradient, moves
    the release by at most C/D."""
    torch.manual_seed(2)
    model = MLP()
    c, d = 0.5, 4
    dp = dpfx.compile(model, max_grad_norm=c, noise_multiplier=0.0, expected_batch_size=d,
                      clipping=clipping)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    canary_x, canary_y = torch.full((1, 8), 50.0), torch.full((1, 4), -50.0)

    def release(xb, yb):
        return run_dpfx_multi(dp, model, mse, (xb,), yb, "mean")

    without = release(x, y)
    with_canary = release(torch.cat([x, canary_x]), torch.cat([y, canary_y]))
    # D is the expected batch size, the same with the canary: only its own term moves
    moved = torch.sqrt(sum((with_canary[k] - without[k]).pow(2).sum() for k in without))
    assert moved <= c / d * (1 + 1e-5)
    assert moved >= 0.9 * c / d     # the canary's gradient is large: it is scaled to about C


def _automatic_backward(config_kwargs=None):
    model = MLP()
    kwargs = dict(max_grad_norm=0.1, noise_multiplier=1.0, backend="eager",
                  clipping="automatic", strategy="materialize", **(config_kwargs or {}))
    dp = dpfx.compile(model, **kwargs)
    dp(torch.randn(3, 8))
    config = DPConfig(0.1, 1.0, backend="eager", clip=dpfx.Clipping("automatic"),
                      **(config_kwargs or {}))
    return dp._dpfx_backend.last_backward, config


def _factor(result):
    return next(n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "clip_factor")


def test_intact_automatic_graph_verifies():
    result, config = _automatic_backward()
    verify_backward(result.gm, result.analysis, result.private, config)


@pytest.mark.parametrize("gamma", [0.0, -0.01, 1e-6])
def test_a_wrong_gamma_is_refused(gamma):
    """gamma = 0 scales every example to norm exactly C (and divides 0 by 0); a negative one
    past C; another gamma than the configured one is not the function the user chose."""
    result, config = _automatic_backward()
    denom = _factor(result).args[1].args[0].args[0]
    denom.args = (denom.args[0], gamma)
    with pytest.raises(dpfx.PrivacyError, match="clip factor"):
        verify_backward(result.gm, result.analysis, result.private, config)


def test_a_scaled_down_norm_in_the_denominator_is_refused():
    """C / (norm / 100 + eps) under the clamp: the structure the verifier used to accept as long
    as the norm was an ancestor of the ratio. It lets an example reach 100 C."""
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=1.0, backend="eager",
                      strategy="materialize")
    dp(torch.randn(3, 8))
    result = dp._dpfx_backend.last_backward
    denom = _factor(result).args[1].args[0].args[0].args[0]
    norm = denom.args[0]
    with result.gm.graph.inserting_before(denom):
        shrunk = result.gm.graph.call_function(torch.ops.aten.mul.Tensor, (norm, 0.01))
    shrunk.meta["val"] = norm.meta["val"] * 0.01
    denom.args = (shrunk, denom.args[1])
    with pytest.raises(dpfx.PrivacyError, match="clip factor"):
        verify_backward(result.gm, result.analysis, result.private,
                        DPConfig(0.1, 1.0, backend="eager"))


def test_the_clamped_form_under_automatic_is_refused():
    """A graph clipped with min(1, .) is not what clipping='automatic' asked for."""
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=1.0, backend="eager",
                      strategy="materialize")
    dp(torch.randn(3, 8))
    result = dp._dpfx_backend.last_backward
    with pytest.raises(dpfx.PrivacyError, match="C / \\(norm \\+ gamma\\)"):
        verify_backward(result.gm, result.analysis, result.private,
                        DPConfig(0.1, 1.0, backend="eager",
                                 clip=dpfx.Clipping("automatic", gamma=1e-6)))


@pytest.mark.parametrize("kwargs,match", [
    (dict(clipping="quantile"), "clipping must be one of"),
    (dict(clipping="flat", max_grad_norm={"": 1.0}), "clipping='flat' takes one bound"),
    (dict(clipping="per_layer"), "clipping='per_layer' takes max_grad_norm as a dict"),
    (dict(clipping="automatic", clipping_gamma=0.0), "clipping_gamma must be"),
    (dict(clipping="automatic", clipping_gamma=float("nan")), "clipping_gamma must be"),
    (dict(clipping="automatic", clipping_gamma=True), "clipping_gamma must be"),
])
def test_bad_clipping_options_are_refused_and_the_model_is_untouched(kwargs, match):
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    settings = {"max_grad_norm": 1.0, "noise_multiplier": 1.0, **kwargs}
    with pytest.raises(dpfx.OptionError, match=match):
        dpfx.compile(model, **settings)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert type(model) is MLP and not hasattr(model, "_dpfx_backend")


def test_the_clipping_mode_is_inferred_from_the_bounds():
    assert DPConfig(1.0, 1.0).clipping == "flat"
    assert DPConfig({"": 1.0, "fc1": 0.5}, 1.0).clipping == "per_layer"
    assert DPConfig({"": 1.0}, 1.0, clip=dpfx.Clipping("automatic")).clip_eps == GAMMA
    assert DPConfig(1.0, 1.0).clip_eps == 1e-6
