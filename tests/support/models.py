"""Small models shared by the core tests and the golden graphs."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """The canonical 2-layer MLP."""

    def __init__(self, d_in=8, hidden=16, d_out=4, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, d_out, bias=bias)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class SeqModel(nn.Module):
    """A sequence model: Linear on a (B, T, d) input, a learned positional parameter with no batch
    dim, an elementwise scale, and a mean over time before the head."""

    def __init__(self, T=6, d=8, hidden=16, n_classes=4):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, T, d) * 0.1)
        self.proj = nn.Linear(d, hidden)
        self.gamma = nn.Parameter(torch.ones(hidden))
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, x):
        h = torch.relu(self.proj(x + self.pos)) * self.gamma
        return self.head(h.mean(1))


class TiedMLP(nn.Module):
    """One Linear applied twice: its per-sample gradients must be summed over both uses."""

    def __init__(self, d=8):
        super().__init__()
        self.shared = nn.Linear(d, d)
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


class TiedLM(nn.Module):
    """A token table that is also the LM head (GPT-2's tie): lookup, a Linear, the head on every
    position (``last_only``: the last one), logits (B, T, V) or (B, V)."""

    def __init__(self, vocab=7, d=8, last_only=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.last_only = last_only

    def forward(self, ids):
        h = torch.tanh(self.mix(self.tok(ids)))
        if self.last_only:
            h = h[:, -1]
        return F.linear(h, self.tok.weight)


class TiedAutoencoder(nn.Module):
    """One matrix W (d, k) used as x @ W, h @ W.T and again as g @ W: a transposed use among
    plain ones. Output (B, T, k), or its mean over T with ``pooled``."""

    def __init__(self, d=6, k=3, pooled=False):
        super().__init__()
        self.W = nn.Parameter(torch.randn(d, k) / d ** 0.5)
        self.pooled = pooled

    def forward(self, x):
        h = torch.tanh(x @ self.W)
        out = torch.tanh(h @ self.W.t()) @ self.W
        return out.mean(1) if self.pooled else out


class TwoLookupLM(nn.Module):
    """One table looked up twice (the ids and their reversal) and used as the head of the pooled
    state: two embedding uses and one mm use of one parameter."""

    def __init__(self, vocab=9, d=4):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)

    def forward(self, ids):
        h = self.tok(ids) + self.tok(ids.flip(1))
        return F.linear(torch.tanh(self.mix(h)).mean(1), self.tok.weight)


class MatmulParam(nn.Module):
    """A raw parameter used with ``@`` on a 3-D input (no nn.Linear)."""

    def __init__(self, d=5, k=3):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, k) * 0.3)

    def forward(self, x):
        return (x @ self.w).sum(1)


def mse(out, y):
    return F.mse_loss(out, y)


def xent(out, y):
    return F.cross_entropy(out, y)


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(2, c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(2, c)

    def forward(self, x):
        return torch.relu(x + self.gn2(self.conv2(torch.relu(self.gn1(self.conv1(x))))))


class ResNetGN(nn.Module):
    """A ResNet-style CNN with GroupNorm: stem, one residual block, strided conv, pooled head."""

    def __init__(self, c=4, n_classes=3):
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1)
        self.block = ResBlock(c)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.head = nn.Linear(2 * c, n_classes)

    def forward(self, x):
        h = self.down(self.block(torch.relu(self.stem(x))))
        return self.head(h.mean((2, 3)))


class ProjectedResNet(nn.Module):
    """A stem, an identity residual block, and a downsampling block whose shortcut is a strided
    1x1 convolution (ResNet's projection shortcut). The downsampling block's two convolutions
    read one activation, so its gradient is the sum of their input gradients, which the block
    before reads twice: in its second GroupNorm's backward and through its identity shortcut."""

    def __init__(self, c=4, n_classes=3):
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1, bias=False)
        self.gn0 = nn.GroupNorm(2, c)
        self.block = ResBlock(c)
        self.conv1 = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(2, 2 * c)
        self.conv2 = nn.Conv2d(2 * c, 2 * c, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(2, 2 * c)
        self.short = nn.Conv2d(c, 2 * c, 1, stride=2, bias=False)
        self.head = nn.Linear(2 * c, n_classes)

    def forward(self, x):
        h = self.block(torch.relu(self.gn0(self.stem(x))))
        out = self.gn2(self.conv2(torch.relu(self.gn1(self.conv1(h)))))
        return self.head(torch.relu(out + self.short(h)).mean((2, 3)))


class ChannelsLastLinearPool(nn.Module):
    """A Linear on the channels-last permute of a conv's output, permuted back and pooled (the
    pattern of torchvision's ConvNeXt block): the mean over the permuted tensor is restrided
    with ``as_strided``, whose backward scatters the gradient into a flat ``(6*B,)`` buffer with
    ``as_strided_scatter`` and reads it back (Note [as_strided reads storage] in
    dpfx/graph/batch.py)."""

    def __init__(self, dim=4, hidden=6, n_classes=3):
        super().__init__()
        self.conv = nn.Conv2d(3, dim, 3, padding=1)
        self.fc = nn.Linear(dim, hidden)
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, x):
        h = self.fc(self.conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


class TiedTable(nn.Module):
    """A raw table indexed by token ids (``table[x]``, whose backward is ``index_put``) that is
    also the LM head; ``wrap``: the ids given as negative indices (row r as r - V)."""

    def __init__(self, vocab=8, dim=3, wrap=False):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, dim))
        self.mix = nn.Linear(dim, dim)
        self.wrap = wrap

    def forward(self, x):
        ids = x - self.table.shape[0] if self.wrap else x
        h = torch.tanh(self.mix(self.table[ids].mean(1)))
        return F.linear(h, self.table)


class MHANet(nn.Module):
    """nn.MultiheadAttention on a (B, T, F) input, then a mean over time and a Linear head.

    Self-attention (q = k = v = x, one packed in_proj mm) when ``kdim``/``vdim`` are None, else
    cross-attention on three slices of the features with separate q/k/v projection weights. With
    batch_first=False the model transposes to (T, B, E) inside, since dpfx needs the batch in dim 0
    of every input."""

    def __init__(self, embed=8, heads=2, batch_first=True, bias=True, add_bias_kv=False,
                 kdim=None, vdim=None):
        super().__init__()
        self.attn = nn.MultiheadAttention(embed, heads, bias=bias, add_bias_kv=add_bias_kv,
                                          kdim=kdim, vdim=vdim, batch_first=batch_first)
        self.batch_first = batch_first
        self.splits = None if kdim is None and vdim is None else [embed, kdim or embed,
                                                                  vdim or embed]
        self.head = nn.Linear(embed, 3)

    @property
    def features(self):
        return self.attn.embed_dim if self.splits is None else sum(self.splits)

    def forward(self, x):
        q = k = v = x
        if self.splits is not None:
            q, k, v = torch.split(x, self.splits, dim=-1)
        if not self.batch_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
            if self.splits is None:
                k = v = q
        out, _ = self.attn(q, k, v, need_weights=False)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.head(out.mean(1))


class SDPAttention(nn.Module):
    """q/k/v Linears, heads split with view/transpose, F.scaled_dot_product_attention, heads merged
    back and an output Linear: the core of a Transformer block, written by hand."""

    def __init__(self, embed, heads, causal, bias=True):
        super().__init__()
        self.q = nn.Linear(embed, embed, bias=bias)
        self.k = nn.Linear(embed, embed, bias=bias)
        self.v = nn.Linear(embed, embed, bias=bias)
        self.o = nn.Linear(embed, embed, bias=bias)
        self.heads = heads
        self.causal = causal

    def split_heads(self, t):
        b, T, e = t.shape
        return t.view(b, T, self.heads, e // self.heads).transpose(1, 2)

    def forward(self, x):
        b, T, e = x.shape
        q, k, v = (self.split_heads(f(x)) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o(a.transpose(1, 2).reshape(b, T, e))


class Block(nn.Module):
    """Pre-norm Transformer block: LayerNorm, causal SDPA attention, LayerNorm, GELU MLP."""

    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = SDPAttention(d, heads, causal=True)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, h):
        h = h + self.attn(self.ln1(h))
        return h + self.proj(F.gelu(self.fc(self.ln2(h))))


class TinyGPT(nn.Module):
    """Token embedding + arange positional embedding, one block, final LayerNorm, LM head tied to
    the token embedding. ``last_only``: logits of the last position (B, V), else (B, T, V)."""

    def __init__(self, vocab, d, T, heads=2, last_only=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(T, d)
        self.block = Block(d, heads)
        self.ln_f = nn.LayerNorm(d)
        self.last_only = last_only

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        h = self.ln_f(self.block(self.tok(idx) + self.pos(positions)))
        if self.last_only:
            h = h[:, -1]
        return F.linear(h, self.tok.weight)


class MHAHead(nn.Module):
    """A model Inductor miscompiled before the fix: batch_first MHA, mean over time, a Linear
    head."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.att = nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc = nn.Linear(d, 3)

    def forward(self, x):
        return self.fc(self.att(x, x, x, need_weights=False)[0].mean(1))


class CharLSTM(nn.Module):
    """The Opacus char-LSTM tutorial's model: Embedding -> LSTM -> Linear on the last hidden state."""

    def __init__(self, vocab=12, embed=6, hidden=8, classes=4):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True)
        self.out_layer = nn.Linear(hidden, classes)

    def forward(self, x):
        x = self.embedding(x)
        _, (h_n, _) = self.lstm(x)
        return self.out_layer(h_n[-1])


def scale_weights(model, s=1.5):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(s)
    return model


class Families(nn.Module):
    """(B, T) token ids -> (B, 3) logits, through one parameter of every rule family."""

    def __init__(self, vocab=11, max_len=8, d=8, heads=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(1, max_len, d) * 0.1)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.norm = nn.LayerNorm(d)
        self.heads = nn.Parameter(torch.randn(heads, d, d // heads) * 0.3)
        self.fc = nn.Linear(d, 3)

    def forward(self, ids):
        h = self.emb(ids) + self.pos[:, :ids.shape[1]]
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = torch.tanh(self.norm(h)).mean(1)
        per_head = h.unsqueeze(1).expand(-1, self.heads.shape[0], -1)
        return self.fc(torch.einsum("bhi,hio->bho", per_head, self.heads).flatten(1))


FRONTIER_RULES = {"emb.weight": ["embedding"], "pos": ["sum"], "conv.weight": ["convolution"],
                  "conv.bias": ["convolution"], "norm.weight": ["sum"], "norm.bias": ["sum"],
                  "heads": ["vmap-fallback(aten.bmm.default)"], "fc.weight": ["mm"],
                  "fc.bias": ["sum"]}


def xent_over_positions(out, y):
    """Cross-entropy averaged over an example's positions: out (1, T, V), y (1, T)."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def tiny_gpt2_lm(vocab: int = 13, t: int = 4, device="cpu"):
    """A one-layer Hugging Face GPT-2 LM from a config (tied head, causal SDPA attention), its
    token loss, and ``make(b)``: b sequences of t tokens, an all-ones attention mask (which keeps
    transformers off a batch-size branch) and the targets, on ``device``. Returns
    (model, lm_loss, make); the model is built under the caller's seed."""
    import pytest
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=vocab, n_positions=t, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = transformers.GPT2LMHeadModel(config)

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    def lm_loss(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    def make(b):
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(1, vocab, (b, t), generator=g)
        y = torch.randint(0, vocab, (b, t), generator=g)
        return (ids.to(device), torch.ones(b, t, dtype=torch.long, device=device)), y.to(device)

    return LM().to(device), lm_loss, make
