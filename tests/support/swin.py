"""A toy Swin written as torchvision writes it (torchvision is not a test dependency):
window partition into (B * windows) rows, shifted windows, patch merging, a permute before the
pooled head. Used by tests/graph/test_merged_batch.py."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def shifted_window_attention(input, qkv, proj, bias_table, window_size, num_heads, shift_size):
    """torchvision's shifted_window_attention (torchvision 0.2x), without dropout."""
    B, H, W, C = input.shape
    pad_r = (window_size[1] - W % window_size[1]) % window_size[1]
    pad_b = (window_size[0] - H % window_size[0]) % window_size[0]
    x = F.pad(input, (0, 0, 0, pad_r, 0, pad_b))
    _, pad_H, pad_W, _ = x.shape
    shift_size = list(shift_size)
    if window_size[0] >= pad_H:
        shift_size[0] = 0
    if window_size[1] >= pad_W:
        shift_size[1] = 0
    if sum(shift_size) > 0:
        x = torch.roll(x, shifts=(-shift_size[0], -shift_size[1]), dims=(1, 2))
    num_windows = (pad_H // window_size[0]) * (pad_W // window_size[1])
    x = x.view(B, pad_H // window_size[0], window_size[0], pad_W // window_size[1], window_size[1],
               C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B * num_windows, window_size[0] * window_size[1], C)
    q, k, v = qkv(x).reshape(x.size(0), x.size(1), 3, num_heads, C // num_heads).permute(
        2, 0, 3, 1, 4)
    q = q * (C // num_heads) ** -0.5
    attn = q.matmul(k.transpose(-2, -1)) + bias_table
    if sum(shift_size) > 0:
        attn_mask = x.new_zeros((pad_H, pad_W))
        h_slices = ((0, -window_size[0]), (-window_size[0], -shift_size[0]), (-shift_size[0], None))
        w_slices = ((0, -window_size[1]), (-window_size[1], -shift_size[1]), (-shift_size[1], None))
        count = 0
        for h in h_slices:
            for w in w_slices:
                attn_mask[h[0]:h[1], w[0]:w[1]] = count
                count += 1
        attn_mask = attn_mask.view(pad_H // window_size[0], window_size[0],
                                   pad_W // window_size[1], window_size[1])
        attn_mask = attn_mask.permute(0, 2, 1, 3).reshape(num_windows,
                                                          window_size[0] * window_size[1])
        attn_mask = attn_mask.unsqueeze(1) - attn_mask.unsqueeze(2)
        attn_mask = attn_mask.masked_fill(attn_mask != 0, float(-100.0))
        attn_mask = attn_mask.masked_fill(attn_mask == 0, float(0.0))
        attn = attn.view(x.size(0) // num_windows, num_windows, num_heads, x.size(1), x.size(1))
        attn = attn + attn_mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, num_heads, x.size(1), x.size(1))
    attn = F.softmax(attn, dim=-1)
    x = attn.matmul(v).transpose(1, 2).reshape(x.size(0), x.size(1), C)
    x = proj(x)
    x = x.view(B, pad_H // window_size[0], pad_W // window_size[1], window_size[0], window_size[1],
               C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B, pad_H, pad_W, C)
    if sum(shift_size) > 0:
        x = torch.roll(x, shifts=(shift_size[0], shift_size[1]), dims=(1, 2))
    return x[:, :H, :W, :].contiguous()


class SwinBlock(nn.Module):
    def __init__(self, c, heads, ws, shift):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.bias = nn.Parameter(torch.randn(heads, ws * ws, ws * ws) * 0.02)
        self.mlp = nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))
        self.heads, self.ws, self.shift = heads, ws, shift

    def forward(self, x):
        x = x + shifted_window_attention(self.norm1(x), self.qkv, self.proj, self.bias,
                                         [self.ws, self.ws], self.heads, [self.shift, self.shift])
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.reduction, self.norm = nn.Linear(4 * c, 2 * c, bias=False), nn.LayerNorm(4 * c)

    def forward(self, x):
        x0, x1 = x[..., 0::2, 0::2, :], x[..., 1::2, 0::2, :]
        x2, x3 = x[..., 0::2, 1::2, :], x[..., 1::2, 1::2, :]
        return self.reduction(self.norm(torch.cat([x0, x1, x2, x3], -1)))


class TinySwin(nn.Module):
    """torchvision's Swin-T layout at toy size: patch embedding, (shifted) window blocks, patch
    merging, norm, Permute to NCHW, AdaptiveAvgPool2d(1), head."""

    def __init__(self, c=8, n_classes=3):
        super().__init__()
        self.embed, self.embed_norm = nn.Conv2d(3, c, 2, stride=2), nn.LayerNorm(c)
        self.blocks = nn.Sequential(SwinBlock(c, 2, 2, 0), SwinBlock(c, 2, 2, 1))
        self.merge = PatchMerging(c)
        self.norm = nn.LayerNorm(2 * c)
        self.head = nn.Linear(2 * c, n_classes)

    def forward(self, x):
        x = self.embed_norm(self.embed(x).permute(0, 2, 3, 1))
        x = self.norm(self.merge(self.blocks(x)))
        x = F.adaptive_avg_pool2d(x.permute(0, 3, 1, 2), 1).flatten(1)
        return self.head(x)
