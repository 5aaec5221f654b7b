"""Differential tests of normalization layers, attention and positional embeddings against torch.func.

None of these layers needs a rule of its own: LayerNorm/GroupNorm/InstanceNorm/RMSNorm affine
parameters and biases are broadcast over the batch, so the generic ``sum`` rule keeps them
per-sample; attention projections are Linears (``mm``); positional embeddings without a batch dim
are a ``sum`` frontier followed by lift rules (``index_put`` for ``nn.Embedding(T, d)(arange(T))``,
``slice_scatter`` for ``pos[:, :T]``). Each test runs with noise_multiplier=0 and a C small enough
that clipping bites, so dpfx's gradient must equal the reference's exactly, and asserts which
frontier rules fired for every parameter. backend="eager" runs the same rewritten graphs as
Inductor; one small GPT-style test goes through Inductor.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

import dpfx
from support.models import MHANet, SDPAttention, TinyGPT, xent, xent_over_positions
from support.reference import check_every_batch_size
from support.sweep import examples

aten = torch.ops.aten

# Every example compiles once and checks all batch sizes 0..4 through that one graph (compiles
# dominate the run time, so few examples per test).
SETTINGS = settings(max_examples=examples(5), deadline=None, derandomize=True)
# (loss_reduction, expected_batch_size): D = B, D = expected, and "sum".
DP_CONFIGS = st.sampled_from([("mean", None), ("mean", 5), ("sum", None)])
MAX_BATCH = 4
C = 0.05


# -- harness ---------------------------------------------------------------------------------------

def check(model, loss_fn, x, y, *, config, backend="eager"):
    """``reference.check_every_batch_size`` at ``config`` = (reduction, expected batch size).
    Returns {parameter: frontier rules fired} and {parameter: its ParamGrad}."""
    reduction, expected = config
    dp = check_every_batch_size(model, loss_fn, x, y, max_grad_norm=C, reduction=reduction,
                                expected=expected, backend=backend)
    grads = {pg.name: pg for pg in dp._dpfx_backend.param_grads}
    return {name: pg.rules for name, pg in grads.items()}, grads


def assert_linear_rules(rules, prefix, bias=True):
    assert rules[f"{prefix}.weight"] == ["mm"], rules
    if bias:
        assert rules[f"{prefix}.bias"] == ["sum"], rules
    else:
        assert f"{prefix}.bias" not in rules


# -- 1. normalization layers -----------------------------------------------------------------------
class NormNet(nn.Module):
    """A normalization layer on the raw input, then tanh and a Linear head on the flattened
    features."""

    def __init__(self, norm, shape, n_classes=3):
        super().__init__()
        self.norm = norm
        self.head = nn.Linear(math.prod(shape), n_classes)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(x)).flatten(1))


def check_norm(norm, shape, config, affine_params):
    """Every affine parameter of the norm is broadcast over the batch: its rule is ``sum``."""
    model = NormNet(norm, shape)
    x = torch.randn(MAX_BATCH, *shape) * 2
    y = torch.randint(0, 3, (MAX_BATCH,))
    rules, _ = check(model, xent, x, y, config=config)
    assert {n for n in rules if n.startswith("norm.")} == {f"norm.{n}" for n in affine_params}
    for name in affine_params:
        assert rules[f"norm.{name}"] == ["sum"], rules
    assert_linear_rules(rules, "head")


@settings(SETTINGS, max_examples=examples(5))
@given(affine=st.booleans(), bias=st.booleans(), two_dims=st.booleans(), config=DP_CONFIGS)
@example(affine=True, bias=True, two_dims=False, config=("sum", None))
def test_layer_norm(affine, bias, two_dims, config):
    """LayerNorm over the last one or two dims of (B, T, d), with and without weight and bias."""
    shape = (3, 4)
    norm = nn.LayerNorm(shape if two_dims else shape[-1], elementwise_affine=affine, bias=bias)
    check_norm(norm, shape, config, [n for n, _ in norm.named_parameters()])


@settings(SETTINGS, max_examples=examples(5))
@given(groups_channels=st.sampled_from([(1, 4), (2, 4), (2, 6), (3, 6)]),
       spatial=st.sampled_from([(), (3,), (2, 3)]), affine=st.booleans(), config=DP_CONFIGS)
@example(groups_channels=(3, 6), spatial=(2, 3), affine=True, config=("sum", None))
def test_group_norm(groups_channels, spatial, affine, config):
    """GroupNorm on (B, C) and (B, C, *spatial); every group holds more than one value so that a
    batch of one is valid (the reference runs each example alone)."""
    groups, channels = groups_channels
    norm = nn.GroupNorm(groups, channels, affine=affine)
    check_norm(norm, (channels, *spatial), config, ["weight", "bias"] if affine else [])


@settings(SETTINGS, max_examples=examples(3))
@given(affine=st.booleans(), config=DP_CONFIGS)
@example(affine=True, config=("sum", None))
def test_rms_norm(affine, config):
    """nn.RMSNorm over the last dim, with and without its elementwise scale."""
    check_norm(nn.RMSNorm(4, elementwise_affine=affine), (3, 4), config,
               ["weight"] if affine else [])


@pytest.mark.parametrize("cls,shape", [(nn.InstanceNorm1d, (3, 5)), (nn.InstanceNorm2d, (2, 2, 3)),
                                       (nn.InstanceNorm3d, (2, 2, 2, 2))], ids=["1d", "2d", "3d"])
def test_instance_norm(cls, shape):
    """InstanceNorm1d/2d/3d with affine=True, no running stats: weight and bias are ``sum``."""
    check_norm(cls(shape[0], affine=True), shape, ("mean", 5), ["weight", "bias"])


# -- 2. nn.MultiheadAttention ----------------------------------------------------------------------
def check_mha(model, config, T=4):
    """Projection weights are ``mm`` (one packed in_proj for self-attention, else q/k/v each),
    biases and bias_k/bias_v are ``sum``."""
    x = torch.randn(MAX_BATCH, T, model.features)
    y = torch.randint(0, 3, (MAX_BATCH,))
    rules, _ = check(model, xent, x, y, config=config)
    attn = model.attn
    if model.splits is None:
        assert rules["attn.in_proj_weight"] == ["mm"], rules
    else:
        for p in ("q", "k", "v"):
            assert rules[f"attn.{p}_proj_weight"] == ["mm"], rules
    if attn.in_proj_bias is not None:
        assert set(rules["attn.in_proj_bias"]) == {"sum"}, rules
    if attn.bias_k is not None:
        assert rules["attn.bias_k"] == ["sum"] and rules["attn.bias_v"] == ["sum"], rules
    assert_linear_rules(rules, "attn.out_proj", bias=attn.out_proj.bias is not None)
    assert_linear_rules(rules, "head")


@settings(SETTINGS, max_examples=examples(5))
@given(batch_first=st.booleans(), bias=st.booleans(), heads=st.sampled_from([1, 2]),
       kv_dims=st.sampled_from([(None, None), (6, 5), (8, 3)]), config=DP_CONFIGS)
def test_multihead_attention(batch_first, bias, heads, kv_dims, config):
    """nn.MultiheadAttention as is, in training mode with need_weights=False: packed or separate
    projections, with or without biases, batch first or not."""
    kdim, vdim = kv_dims
    check_mha(MHANet(heads=heads, batch_first=batch_first, bias=bias, kdim=kdim, vdim=vdim),
              config)


@pytest.mark.parametrize("batch_first,kv_dims", [(True, (None, None)), (False, (6, 5))])
def test_multihead_attention_bias_kv(batch_first, kv_dims):
    """add_bias_kv=True: bias_k and bias_v are broadcast over the batch, so ``sum``."""
    kdim, vdim = kv_dims
    check_mha(MHANet(batch_first=batch_first, add_bias_kv=True, kdim=kdim, vdim=vdim),
              ("mean", 5))


# -- 3. hand-written attention with scaled_dot_product_attention -----------------------------------
class SDPANet(nn.Module):
    def __init__(self, embed=8, heads=2, causal=True, bias=True):
        super().__init__()
        self.attn = SDPAttention(embed, heads, causal, bias)
        self.head = nn.Linear(embed, 3)

    def forward(self, x):
        return self.head(self.attn(x).mean(1))


@settings(SETTINGS, max_examples=examples(5))
@given(causal=st.booleans(), heads=st.sampled_from([1, 2, 4]), bias=st.booleans(),
       T=st.integers(1, 4), config=DP_CONFIGS)
def test_scaled_dot_product_attention(causal, heads, bias, T, config):
    """The projections around F.scaled_dot_product_attention (causal or not) are Linears on
    (B, T, E): ``mm`` for weights, ``sum`` for biases, whatever the head split."""
    model = SDPANet(heads=heads, causal=causal, bias=bias)
    x = torch.randn(MAX_BATCH, T, 8)
    y = torch.randint(0, 3, (MAX_BATCH,))
    rules, _ = check(model, xent, x, y, config=config)
    for name in ("q", "k", "v", "o"):
        assert_linear_rules(rules, f"attn.{name}", bias=bias)


# -- 4. positional embeddings without a batch dim --------------------------------------------------
class ParamPositions(nn.Module):
    """A learned (1, T_max, d) parameter, sliced to the input's length and added to it."""

    def __init__(self, T_max, d=4):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, T_max, d) * 0.1)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = x + self.pos[:, : x.shape[1]]
        return self.head(torch.tanh(h).mean(1))


class ArangePositions(nn.Module):
    """nn.Embedding(T_max, d) looked up with arange(T) and broadcast over the batch (the GPT-2
    positional embedding; Opacus' embedding hook cannot do it, the lookup has no batch).
    ``share=2`` gives each row to two neighbouring positions (a repeated index must accumulate
    within the example) and ``padding_idx`` masks a row out."""

    def __init__(self, T_max, d=4, share=1, padding_idx=None):
        super().__init__()
        self.pos = nn.Embedding(T_max, d, padding_idx=padding_idx)
        self.head = nn.Linear(d, 3)
        self.share = share

    def forward(self, x):
        h = x + self.pos(torch.arange(x.shape[1], device=x.device) // self.share)
        return self.head(torch.tanh(h).mean(1))


class SharedPaddedPositions(ArangePositions):
    def __init__(self, T_max, d=4):
        super().__init__(T_max, d, share=2, padding_idx=0)


class IndexedPositions(nn.Module):
    """A raw (T_max, d) table indexed with arange(T): ``table[idx]``, whose backward is index_put."""

    def __init__(self, T_max, d=4):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(T_max, d) * 0.1)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = x + self.pos[torch.arange(x.shape[1], device=x.device)]
        return self.head(torch.tanh(h).mean(1))


# kind -> (model, parameter name, the lifted op that scatters the per-sample sum into the table)
POSITIONAL = {"parameter": (ParamPositions, "pos", aten.slice_scatter.default),
              "embedding": (ArangePositions, "pos.weight", aten.index_put.default),
              "shared_padded": (SharedPaddedPositions, "pos.weight", aten.index_put.default),
              "indexed": (IndexedPositions, "pos", aten.index_put.default)}


@pytest.mark.parametrize("kind", sorted(POSITIONAL))
@settings(SETTINGS, max_examples=examples(2))
@given(T=st.integers(1, 5), extra=st.integers(0, 2), config=DP_CONFIGS)
def test_positional_embeddings(kind, T, extra, config):
    """A positional table used without a batch dim: the frontier is the ``sum`` over the batch,
    and the scatter back into the table (slice_scatter for a slice, index_put-accumulate for an
    arange lookup) is lifted per example. Rows past T (extra > 0) get zero gradients; a slice of
    the whole parameter (extra = 0) is a plain broadcast with nothing to lift."""
    cls, name, lifted = POSITIONAL[kind]
    model = cls(T + extra)
    x = torch.randn(MAX_BATCH, T, 4)
    y = torch.randint(0, 3, (MAX_BATCH,))
    rules, grads = check(model, xent, x, y, config=config)
    assert rules[name] == ["sum"], rules
    per_sample = grads[name].per_sample.target
    assert (per_sample is lifted) == (kind != "parameter" or extra > 0), per_sample
    assert_linear_rules(rules, "head")


# -- 5. a GPT-style model --------------------------------------------------------------------------
def check_gpt(model, T, config, backend="eager"):
    """Token table: its lookup (``embedding``) plus the tied head (``mm``), summed per example
    by the add lift; positional table: ``sum`` + index_put lift; LayerNorms and biases: ``sum``;
    Linears: ``mm``. Loss: cross-entropy of the last position, or its mean over positions."""
    vocab = model.tok.num_embeddings
    idx = torch.randint(0, vocab, (MAX_BATCH, T))
    if model.last_only:
        y, loss_fn = torch.randint(0, vocab, (MAX_BATCH,)), xent
    else:
        y, loss_fn = torch.randint(0, vocab, (MAX_BATCH, T)), xent_over_positions
    rules, grads = check(model, loss_fn, idx, y, config=config, backend=backend)
    assert sorted(rules["tok.weight"]) == ["embedding", "mm"], rules
    assert rules["pos.weight"] == ["sum"], rules
    # (Inductor's post-grad passes may reinplace the node after dpfx verified the graph.)
    assert grads["pos.weight"].per_sample.target in (aten.index_put.default,
                                                     aten.index_put_.default)
    for ln in ("block.ln1", "block.ln2", "ln_f"):
        assert rules[f"{ln}.weight"] == ["sum"] and rules[f"{ln}.bias"] == ["sum"], rules
    for lin in ("block.attn.q", "block.attn.k", "block.attn.v", "block.attn.o", "block.fc",
                "block.proj"):
        assert_linear_rules(rules, lin)


@settings(SETTINGS, max_examples=examples(2))
@given(last_only=st.booleans(), T=st.integers(1, 4), config=DP_CONFIGS)
@example(last_only=True, T=4, config=("sum", None))
def test_tiny_gpt(last_only, T, config):
    """The whole GPT-style model against the reference, on eager."""
    check_gpt(TinyGPT(vocab=7, d=8, T=4, last_only=last_only), T, config)


@pytest.mark.filterwarnings("ignore::dpfx.LossScaleWarning")  # the loss's scale changed: expected
def test_tiny_gpt_inductor():
    """The same rewritten graphs lowered by Inductor (d=16, T=8, vocab 11), loss averaged over
    positions, every batch size 0..4 through one compiled graph."""
    check_gpt(TinyGPT(vocab=11, d=16, T=8, last_only=False), 8, ("mean", 5), backend="inductor")
