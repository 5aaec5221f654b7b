"""Every rule family through Inductor (the backend users run), against a batch-of-one autograd
reference, with clipping that bites, at batch sizes equal to the models' other dims (heads, T,
d, heads*B = d), the first compile at such a size, then the same models again on a warm FX-graph
cache. A representative set runs by default; the whole sweep is marked slow."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import dpfx
from support.reference import assert_close, loop_dp_sgd_grads, run_dpfx_multi

C = 0.05


class Head(nn.Module):
    """body(*inputs) -> (B, ..., d) features, averaged to (B, d), then a 3-way Linear."""

    def __init__(self, body, d, pool=None):
        super().__init__()
        self.body, self.fc, self.pool = body, nn.Linear(d, 3), pool

    def forward(self, *inputs):
        h = self.body(*inputs)
        h = h.flatten(2).mean(-1) if self.pool == "spatial" else h
        while h.dim() > 2:
            h = h.mean(1)
        return self.fc(h)


class Call(nn.Module):
    def __init__(self, fn, **mods):
        super().__init__()
        self.fn = fn
        for k, v in mods.items():
            setattr(self, k, v)

    def forward(self, *inputs):
        return self.fn(self, *inputs)


def _floats(*shape):
    return lambda b: (torch.randn(b, *shape),)


def _padding_mask(t):
    def make(b):
        mask = torch.rand(b, t) > 0.7
        mask[:, 0] = False
        return torch.randn(b, t, 8), mask
    return make


def _mha(batch_first, masked):
    att = nn.MultiheadAttention(8, 4, batch_first=batch_first)

    def fn(self, x, mask=None):
        x = x if batch_first else x.transpose(0, 1)
        out = self.att(x, x, x, key_padding_mask=mask if masked else None,
                       need_weights=False)[0]
        return out if batch_first else out.transpose(0, 1)
    return Call(fn, att=att)


def _sdpa_masked():
    def fn(self, x, mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        attn = ~mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn)
        return out.transpose(1, 2).reshape(b, t, 8)
    return Call(fn, qkv=nn.Linear(8, 24))


def _decoder():
    layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    causal = nn.Transformer.generate_square_subsequent_mask(4)
    return Call(lambda self, x, mem: self.layer(x, mem, tgt_mask=causal), layer=layer)


def _flattened_layernorm():
    """HF OPT's pattern: hidden states flattened to (B*T, d) before a LayerNorm and a Linear."""
    def fn(self, x):
        b, t, d = x.shape
        return self.fc(self.norm(x.reshape(b * t, d))).view(b, t, d)
    return Call(fn, norm=nn.LayerNorm(8), fc=nn.Linear(8, 8))


def _views_conv_groupnorm():
    """Augmentation multiplicity: (B, K, C, H, W) run as B*K images, features (B, K, C)."""
    def fn(self, x):
        b, k = x.shape[:2]
        h = self.norm(self.conv(x.flatten(0, 1))).mean((2, 3))
        return h.view(b, k, 6)
    return Call(fn, conv=nn.Conv2d(3, 6, 3, padding=1), norm=nn.GroupNorm(3, 6))


def _permuted_block():
    """HF ConvNeXt's block: a depthwise conv, a Linear on the channels-last permute, permuted
    back, so the next depthwise conv reads channels-last strides."""
    def fn(self, x):
        h = self.fc(self.dw1(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.dw2(h)
    return Call(fn, dw1=nn.Conv2d(4, 4, 3, padding=1, groups=4), fc=nn.Linear(4, 4),
                dw2=nn.Conv2d(4, 4, 3, padding=1, groups=4))


# name, body factory, feature width, pooling, inputs(b), batch sizes (first is the compile's)
FAMILIES = {
    "linear_rank4": (lambda: nn.Linear(8, 8), 8, None, _floats(2, 4, 8), [4, 8, 2]),
    "conv1d_groups": (lambda: nn.Sequential(nn.Conv1d(4, 8, 3, groups=2), nn.GroupNorm(2, 8)),
                      8, "spatial", _floats(4, 9), [4, 8, 1]),
    "conv2d_stride": (lambda: nn.Sequential(nn.Conv2d(3, 6, 3, stride=2, padding=1),
                                            nn.InstanceNorm2d(6, affine=True)),
                      6, "spatial", _floats(3, 6, 6), [6, 3, 2]),
    "conv3d": (lambda: nn.Conv3d(2, 4, 2), 4, "spatial", _floats(2, 3, 3, 3), [2, 4, 3]),
    "conv_transpose2d": (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2), 4, "spatial",
                         _floats(3, 4, 4), [4, 3, 1]),
    "embedding_bag": (lambda: Call(lambda s, i: torch.cat([s.emb(i), s.bag(i)[:, None]], 1),
                                   emb=nn.Embedding(12, 8, padding_idx=0),
                                   bag=nn.EmbeddingBag(12, 8, mode="mean")),
                      8, None, lambda b: (torch.randint(0, 12, (b, 8)),), [8, 2, 1]),
    "layernorm_rmsnorm": (lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8),
                                                nn.RMSNorm(8)), 8, None, _floats(5, 8),
                          [5, 8, 1]),
    "mha_batch_first_masked": (lambda: _mha(True, True), 8, None, _padding_mask(6), [4, 2, 6]),
    "mha_seq_first": (lambda: _mha(False, False), 8, None, _floats(6, 8), [2, 4, 8]),
    "sdpa_masked": (_sdpa_masked, 8, None, _padding_mask(5), [4, 2, 5]),
    "encoder_layer_masked": (
        lambda: Call(lambda s, x, m: s.layer(x, src_key_padding_mask=m),
                     layer=nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)),
        8, None, _padding_mask(5), [2, 5, 8]),
    "decoder_layer_causal": (_decoder, 8, None,
                             lambda b: (torch.randn(b, 4, 8), torch.randn(b, 5, 8)), [4, 2, 5]),
    "flattened_layernorm": (_flattened_layernorm, 8, None, _floats(5, 8), [5, 8, 1]),
    "views_conv_groupnorm": (_views_conv_groupnorm, 6, None, _floats(2, 3, 4, 4), [2, 3, 1]),
    "permuted_block": (_permuted_block, 4, "spatial", _floats(4, 5, 5), [4, 5, 1]),
}
DEFAULT = ["conv1d_groups", "layernorm_rmsnorm", "encoder_layer_masked"]
# Refused today, loudly (found by this sweep; each family alone passes elsewhere): none. The
# last two, nn.Embedding and nn.EmbeddingBag on the same ids (the backward's slice_scatter over
# the whole batch dim, Note [A slice over the whole batch dim] in dpfx/passes/verify/forward.py) and
# nn.TransformerDecoderLayer with a causal mask held in a closure (Note [Tensors the model holds
# are not inputs] in dpfx/backend/inputs.py), train.
KNOWN_REFUSALS = {}


def _sweep_one(name, batches_only=None):
    body, d, pool, make, batches = FAMILIES[name]
    torch.manual_seed(0)
    model = Head(body(), d, pool)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0)
    for b in batches_only or batches:
        inputs, y = make(b), torch.randint(0, 3, (b,))
        got = run_dpfx_multi(dp, model, F.cross_entropy, inputs, y)
        want = loop_dp_sgd_grads(model, F.cross_entropy, inputs, y, max_grad_norm=C)
        assert_close(got, want, rtol=2e-4, atol=1e-6)
    assert dp.compile_count == 2, name


def _cold_then_warm(name, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _sweep_one(name)
    torch._dynamo.reset()
    hits = counters["inductor"]["fxgraph_cache_hit"]
    _sweep_one(name, FAMILIES[name][4][:2])
    assert counters["inductor"]["fxgraph_cache_hit"] - hits == 2


@pytest.mark.parametrize("name", DEFAULT)
def test_representative_families(name, tmp_path, monkeypatch):
    _cold_then_warm(name, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, raises=KNOWN_REFUSALS[n]))
    if n in KNOWN_REFUSALS else n for n in FAMILIES if n not in DEFAULT])
def test_every_family(name, tmp_path, monkeypatch):
    _cold_then_warm(name, tmp_path, monkeypatch)
