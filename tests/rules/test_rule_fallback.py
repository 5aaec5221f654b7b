"""Differential tests of the vmap fallback (dpfx/rules/fallback.py) against torch.func.

The fallback's customers are weights whose gradient is a batched matrix product contracting over
the batch, for which no rule exists: per-head weights used through einsum, ``matmul`` of a
head-major activation with a (h, i, o) weight, ``baddbmm``. Each test asserts that the fallback
fired (the parameter's rule is ``vmap-fallback(aten.bmm.default)``, and compiling warned), then
compares dpfx with sigma = 0 and a C that clips to the reference for batch sizes 0..4 through one
compiled graph. An op the fallback cannot prove exact stays an UnsupportedOpError.
"""
import pytest
import torch
import torch.nn as nn
from hypothesis import Phase, example, given, settings, strategies as st

import dpfx
from dpfx.rules.fallback import FallbackWarning
from support.models import xent
from support.reference import (assert_close, check_every_batch_size, clip_fraction,
                               dp_sgd_grads, run_dpfx)

# Few examples (each compiles twice); no shrinking, which would recompile for minutes.
SETTINGS = settings(max_examples=4, deadline=None, derandomize=True,
                    phases=[Phase.explicit, Phase.generate])
DP_CONFIGS = st.sampled_from([("mean", None), ("mean", 5), ("sum", None)])
MAX_BATCH = 4
C = 0.05
BMM_FALLBACK = "vmap-fallback(aten.bmm.default)"


def check(model, x, y, *, config, backend="eager", strategy="auto"):
    """For B = 0..len(x) (B = 0 where D is known), dpfx equals the reference; clipping bites.
    Returns {parameter: rules fired}; asserts the fallback warned."""
    reduction, expected = config
    warned = lambda: pytest.warns(FallbackWarning,  # noqa: E731
                                  match=r"parameter 'w'.*aten\.bmm\.default")
    dp = check_every_batch_size(model, xent, x, y, max_grad_norm=C, reduction=reduction,
                                expected=expected, backend=backend, strategy=strategy,
                                first_call=warned)
    return {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}


# Widths are >= 2: torch cannot trace a layer of width 1 with a symbolic batch (docs/ARCHITECTURE.md,
# Known limits).

# -- models whose weight gradient is a bmm over the batch -------------------------------------------
class HeadsEinsum(nn.Module):
    """Per-head weights w (h, i, o) on x viewed as (B, [T,] h, i): ``einsum("b[t]hi,hio->b[t]o")``,
    whose weight gradient contracts over B (or B*T) inside a bmm over the heads."""

    def __init__(self, heads, d_in, d_out, T=None):
        super().__init__()
        self.w = nn.Parameter(torch.randn(heads, d_in, d_out) * 0.5)
        self.head = nn.Linear(d_out, 3)
        self.shape, self.T = (heads, d_in) if T is None else (T, heads, d_in), T

    @property
    def features(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    def forward(self, x):
        x = x.view(x.shape[0], *self.shape)
        if self.T is None:
            h = torch.einsum("bhi,hio->bo", x, self.w)
        else:
            h = torch.einsum("bthi,hio->bto", x, self.w).mean(1)
        return self.head(torch.tanh(h))


class HeadsBaddbmm(nn.Module):
    """``baddbmm(bias, x, w)`` with x head-major (h, B, i): the bias is a ``sum`` over the batch,
    the weight a bmm over the heads that contracts over B."""

    def __init__(self, heads, d_in, d_out):
        super().__init__()
        self.w = nn.Parameter(torch.randn(heads, d_in, d_out) * 0.5)
        self.bias = nn.Parameter(torch.randn(heads, 1, d_out) * 0.1)
        self.head = nn.Linear(heads * d_out, 3)
        self.heads, self.d_in = heads, d_in

    @property
    def features(self):
        return self.heads * self.d_in

    def forward(self, x):
        x = x.view(x.shape[0], self.heads, self.d_in).transpose(0, 1)
        h = torch.baddbmm(self.bias, x, self.w).transpose(0, 1).flatten(1)
        return self.head(torch.tanh(h))


def data(model):
    x = torch.randn(MAX_BATCH, model.features) * 2
    return x, torch.randint(0, 3, (MAX_BATCH,))


@settings(SETTINGS)
@given(heads=st.integers(2, 3), d_in=st.integers(2, 4), d_out=st.integers(2, 4),
       T=st.sampled_from([None, 1, 3]), config=DP_CONFIGS,
       strategy=st.sampled_from(["auto", "materialize", "ghost"]))
@example(heads=2, d_in=4, d_out=3, T=3, config=("sum", None), strategy="auto")
def test_einsum_heads(heads, d_in, d_out, T, config, strategy):
    """One example per sample (no T: the bmm contracts over B) and a sequence (T: over B*T).
    The fallback has no ghost form, so every strategy materializes it."""
    model = HeadsEinsum(heads, d_in, d_out, T)
    rules = check(model, *data(model), config=config, strategy=strategy)
    assert rules["w"] == [BMM_FALLBACK], rules
    assert rules["head.weight"] == ["mm"] and rules["head.bias"] == ["sum"], rules


@settings(SETTINGS, max_examples=3)
@given(heads=st.integers(2, 3), d_in=st.integers(2, 4), d_out=st.integers(2, 3),
       config=DP_CONFIGS)
def test_baddbmm_heads(heads, d_in, d_out, config):
    model = HeadsBaddbmm(heads, d_in, d_out)
    rules = check(model, *data(model), config=config)
    assert rules["w"] == [BMM_FALLBACK] and rules["bias"] == ["sum"], rules


def test_explain_names_the_fallback():
    model = HeadsEinsum(2, 4, 3)
    with pytest.warns(FallbackWarning):
        report = dpfx.explain(model, torch.randn(3, 8), max_grad_norm=1.0, noise_multiplier=1.0)
    row = next(r for r in report.rows if r.name == "w")
    assert row.rules == [BMM_FALLBACK] and row.strategy == "materialize"
    assert BMM_FALLBACK in str(report)


def test_einsum_heads_inductor():
    """The spliced vmap nodes lowered by Inductor, with a sequence dim."""
    model = HeadsEinsum(2, 3, 4, T=5)
    rules = check(model, *data(model), config=("mean", 5), backend="inductor")
    assert rules["w"] == [BMM_FALLBACK], rules


# -- what the fallback refuses ---------------------------------------------------------------------
@torch.library.custom_op("dpfx_test::rowdot_weight_grad", mutates_args=())
def rowdot_weight_grad(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """sum_i g_i x_i, an opaque kernel: nothing tells dpfx that it sums per-example terms."""
    return (g.unsqueeze(-1) * x).sum(0)


@rowdot_weight_grad.register_fake
def _(x, g):
    return x.new_empty(x.shape[1:])


@torch.library.custom_op("dpfx_test::rowdot", mutates_args=())
def rowdot(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum(-1)


@rowdot.register_fake
def _(x, w):
    return x.new_empty(x.shape[:1])


def _rowdot_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad.unsqueeze(-1) * w, rowdot_weight_grad(x, grad)


def _rowdot_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


rowdot.register_autograd(_rowdot_backward, setup_context=_rowdot_setup)


class CustomKernel(nn.Module):
    def __init__(self, d=5):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))
        self.head = nn.Linear(2, 2)

    def forward(self, x):
        h = rowdot(x, self.w)
        return self.head(torch.stack([h, h * h], 1))


def test_custom_op_is_refused_with_parameter_and_op():
    """A custom weight-gradient kernel reduces over the batch but is no known contraction: the
    fallback cannot prove that it sums per-example terms, so dpfx refuses, naming parameter and
    op; validate lists the same refusal."""
    model = CustomKernel()
    x = torch.randn(3, 5)
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, backend="eager")
    with pytest.raises(dpfx.UnsupportedOpError,
                       match=r"parameter 'w'.*dpfx_test\.rowdot_weight_grad\.default.*"
                             r"vmap-fallback: .*not one.*freeze the parameter"):
        dp(x)
    torch._dynamo.reset()
    problems = dpfx.validate(model, x)
    assert [p.kind for p in problems] == ["unsupported"], problems
    assert "rowdot_weight_grad" in problems[0].message


# -- layers tried while looking for fallback customers: they need no fallback ---------------------
class PReLUNet(nn.Module):
    def __init__(self, channels, num_parameters):
        super().__init__()
        self.act = nn.PReLU(num_parameters, init=0.3)
        self.head = nn.Linear(channels * 3, 3)

    def forward(self, x):
        return self.head(self.act(x.view(x.shape[0], -1, 3)).flatten(1))


@pytest.mark.parametrize("num_parameters", [1, 4])
def test_prelu_is_a_sum(num_parameters):
    """nn.PReLU's weight is broadcast over the batch: the generic ``sum`` rule, no fallback."""
    torch._dynamo.reset()
    model = PReLUNet(4, num_parameters)
    x, y = torch.randn(MAX_BATCH, 12) * 2, torch.randint(0, 3, (MAX_BATCH,))
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager")
    assert clip_fraction(model, xent, x, y, C) > 0
    for batch in range(1, MAX_BATCH + 1):
        got = run_dpfx(dp, model, xent, x[:batch], y[:batch])
        assert_close(got, dp_sgd_grads(model, xent, x[:batch], y[:batch], max_grad_norm=C))
    rules = {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}
    assert rules["act.weight"] == ["sum"], rules
