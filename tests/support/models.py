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
    dpfx/passes/batch.py)."""

    def __init__(self, dim=4, hidden=6, n_classes=3):
        super().__init__()
        self.conv = nn.Conv2d(3, dim, 3, padding=1)
        self.fc = nn.Linear(dim, hidden)
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, x):
        h = self.fc(self.conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))
