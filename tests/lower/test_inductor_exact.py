"""What Inductor runs must be the graph dpfx proved (Note [Inductor must not assume what it cannot
check] in dpfx/lower/shape_patches.py). Each model in CASES compiled to code that mixed examples,
or failed on a guard, before the fix; NormedTokens checks the stacked release of vector parameters. Every
test runs through Inductor with a cold and then a warm FX-graph cache, at batch sizes equal to
the model's other dims (heads, T, d)."""
import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import dpfx
from dpfx.lower.shape_patches import UncheckedAssumption, no_unchecked_assumptions
from support.models import MHAHead, TiedAutoencoder, TiedLM, TwoLookupLM
from support.reference import assert_close, clip_fraction, dp_sgd_grads, per_example_grads, run_dpfx


class EmbeddingMHA(nn.Module):
    """Embedding(20, 8) + MHA(8, 2 heads), sequence-first inside: failed at B=4, T=5."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.att = nn.MultiheadAttention(8, 2)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids):
        h = self.emb(ids).transpose(0, 1)
        return self.fc(self.att(h, h, h, need_weights=False)[0].mean(0))


class HeadSplit(nn.Module):
    """The smallest reproduction: (B, T, 16) -> (T, B, 16) -> (T, 2B, 8), an Inductor view of
    a lazy pointwise node."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        y = (x * self.scale).transpose(0, 1)
        heads = y.reshape(y.shape[0], y.shape[1] * 2, 8).transpose(0, 1)
        return self.fc(heads.mean(1)).view(x.shape[0], 2, 3).sum(1)


class GroupNormCNN(nn.Module):
    """Two stride-2 convolutions (the second grouped) with GroupNorm: the second one's input
    gradient is dpfx::conv2d_input_grad (Note [Conv2d input gradients in channels-last])."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
            nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2), nn.GroupNorm(4, 8), nn.ReLU())
        self.fc = nn.Linear(8 * 3 * 3, 3)

    def forward(self, x):
        return self.fc(self.body(x).flatten(1))


CASES = [
    (MHAHead, lambda b: torch.randn(b, 7, 16), [5, 2, 7, 16, 1]),   # B = heads, T, d
    (GroupNormCNN, lambda b: torch.randn(b, 3, 10, 10) * 3, [4, 8, 2, 3, 1]),  # B = channels
    (EmbeddingMHA, lambda b: torch.randint(0, 20, (b, 5)), [4, 2, 5, 8, 1]),
    (HeadSplit, lambda b: torch.randn(b, 7, 16), [5, 2, 7, 8, 1]),
    # Tied weights on the ghost strategy (Note [Tied weights without per-sample gradients]):
    # the embedding x head cross term's gather, a transposed use, two lookups of one table.
    (lambda: TiedLM(vocab=3, d=8, last_only=True), lambda b: torch.randint(0, 3, (b, 4)),
     [4, 3, 8, 1], "ghost"),
    (lambda: TiedAutoencoder(d=6, k=3, pooled=True), lambda b: torch.randn(b, 5, 6) * 2,
     [5, 6, 3, 1], "ghost"),
    (lambda: TwoLookupLM(vocab=3, d=4), lambda b: torch.randint(0, 3, (b, 4)), [4, 3, 1],
     "ghost"),
]
CASES = [c if len(c) == 4 else (*c, "auto") for c in CASES]
CASE_IDS = ["MHAHead", "GroupNormCNN", "EmbeddingMHA", "HeadSplit", "TiedLM", "TiedAutoencoder", "TwoLookupLM"]


@pytest.fixture
def fresh_inductor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    yield


def _step_exact(model, make_input, batches, C=0.05, strategy="auto"):
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, strategy=strategy)
    for b in batches:
        x, y = make_input(b), torch.randint(0, 3, (b,))
        got = run_dpfx(dp, model, F.cross_entropy, x, y)
        assert_close(got, dp_sgd_grads(model, F.cross_entropy, x, y, max_grad_norm=C),
                     rtol=1e-4, atol=1e-6)
        assert b == 1 or clip_fraction(model, F.cross_entropy, x, y, C) > 0
    assert dp.compile_count == 2
    return dp


def _forward_independent(dp, make_input, b):
    x = make_input(b)
    x2 = x.clone()
    x2[0] = make_input(1)[0]
    with torch.no_grad():
        a, c = dp(x), dp(x2)
    torch.testing.assert_close(a[1:], c[1:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model_cls,make_input,batches,strategy", CASES, ids=CASE_IDS)
def test_exact_cold_and_warm_cache(fresh_inductor_cache, model_cls, make_input, batches,
                                   strategy):
    torch.manual_seed(0)
    model = model_cls()
    hits = counters["inductor"]["fxgraph_cache_hit"]
    dp = _step_exact(model, make_input, batches, strategy=strategy)
    _forward_independent(dp, make_input, batches[0])
    tied = [pg for pg in dp._dpfx_backend.param_grads if len(pg.rules) > 1]
    assert all(pg.strategy == "ghost" for pg in tied)
    torch._dynamo.reset()                        # same process, same cache dir: warm
    dp = _step_exact(model, make_input, batches, strategy=strategy)
    _forward_independent(dp, make_input, batches[0])
    assert counters["inductor"]["fxgraph_cache_hit"] - hits >= 2


def test_unprovable_batch_assumption_raises():
    """The mechanism: once runtime asserts are frozen, torch would defer Eq(16, 16*u0) to an
    assert nobody emits (returns True); under dpfx it raises, so the caller takes its exact path."""
    env = ShapeEnv()
    u0 = env.create_unbacked_symint().node.expr
    env.freeze_runtime_asserts()
    assumption = sympy.Eq(16, 16 * u0)
    with no_unchecked_assumptions(env):
        with pytest.raises(UncheckedAssumption, match="16"):
            env.guard_or_defer_runtime_assert(assumption, "test")
        assert env.guard_or_defer_runtime_assert(sympy.Eq(16 * u0, 16 * u0), "test")
    assert env.guard_or_defer_runtime_assert(assumption, "test")   # torch's own behaviour


class NormedTokens(nn.Module):
    """LayerNorms and biased Linears over tokens: six vector parameters whose per-sample
    gradients are dpfx's sums over the tokens, stacked on CPU (Note [Vector parameters'
    per-sample gradients stacked] in dpfx/passes/clip_noise.py)."""

    def __init__(self, d=8, h=6, out=3):
        super().__init__()
        self.ln1, self.fc1 = nn.LayerNorm(d), nn.Linear(d, h)
        self.ln2, self.fc2 = nn.LayerNorm(h), nn.Linear(h, out)

    def forward(self, x):
        return self.fc2(self.ln2(torch.tanh(self.fc1(self.ln1(x))))).mean(1)


def _per_group_reference(model, x, y, config, reduction, expected):
    """DP-SGD at sigma 0 with each clipping group's own norm and factor (a batch-of-one loop
    through torch.func), and whether clipping bit."""
    params = dict(model.named_parameters())
    if x.shape[0] == 0:
        return {k: torch.zeros_like(p) for k, p in params.items()}, False
    g = per_example_grads(model, F.cross_entropy, x, y)
    out, bit = {}, False
    for group, bound in config.clip_bounds.items():
        mine = [k for k in g if config.group_of(k) == group]
        if not mine:
            continue
        norms = torch.sqrt(sum(g[k].flatten(1).pow(2).sum(1) for k in mine))
        factor = (bound / (norms + 1e-6)).clamp(max=1.0)
        bit |= bool((factor < 1).any())
        for k in mine:
            out[k] = (factor.view(-1, *[1] * (g[k].dim() - 1)) * g[k]).sum(0)
    denom = (expected or x.shape[0]) if reduction == "mean" else 1
    return {k: v / denom for k, v in out.items()}, bit


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bounds,stacked", [
    (0.05, {"ln1.weight", "ln1.bias", "fc1.bias", "ln2.weight", "ln2.bias", "fc2.bias"}),
    # per-layer: fc1's bias is alone in its group and stays whole
    ({"fc1": 0.02, "ln2": 0.03, "": 0.05},
     {"ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "fc2.bias"})])
def test_stacked_vector_parameters_exact_cold_and_warm(fresh_inductor_cache, reduction, bounds,
                                                       stacked):
    """The stacked release through Inductor, cold then warm cache, self-check on, at batch
    sizes 0, 1 and equal to T (5) and d (8): every gradient is DP-SGD's (per clipping group),
    with clipping that bites, and the stacked parameters are slices of one noised sum."""
    torch.manual_seed(0)
    model = NormedTokens()
    expected = 4 if reduction == "mean" else None
    hits = counters["inductor"]["fxgraph_cache_hit"]
    for _ in ("cold", "warm"):
        torch._dynamo.reset()
        dp = dpfx.compile(model, max_grad_norm=bounds, noise_multiplier=0.0,
                          loss_reduction=reduction, expected_batch_size=expected)
        bit = False
        for b in (3, 0, 1, 5, 8):
            x, y = torch.randn(b, 5, 8) * 3, torch.randint(0, 3, (b,))
            got = run_dpfx(dp, model, F.cross_entropy, x, y, reduction)
            want, clipped = _per_group_reference(model, x, y, dp.dp_config, reduction, expected)
            assert_close(got, want, rtol=1e-4, atol=1e-6)
            bit |= clipped
        assert bit and dp.compile_count == 2
        private = dp._dpfx_backend.last_backward.private
        assert {k for k, o in private.items() if o.target is torch.ops.aten.slice.Tensor} == \
            stacked
    assert counters["inductor"]["fxgraph_cache_hit"] - hits >= 2
