"""The GPU's fused attention kernels, run on the CPU: dpfx's forward check, rules, verifier and
self-check on the graphs a GPU user's transformer gives, through Inductor.

On a GPU, ``F.scaled_dot_product_attention`` stays one op in the ATen graph (float32:
``_scaled_dot_product_efficient_attention``; bf16 and fp16:
``_scaled_dot_product_flash_attention``; and their backwards; on the CPU it decomposes into
matrix products and a softmax). ATen has no CPU kernel for them, so ``fused_attention_on_cpu``
registers one for each forward and backward (plain attention arithmetic, the outputs laid out as
the meta kernels say the CUDA ones are: the efficient output (B, T, H, D) in memory, its
log-sum-exp padded to a multiple of 32 with +inf, flash's output laid out as the query) and
routes ``F.scaled_dot_product_attention`` to one. Like the CUDA kernels without dropout, the RNG
seed and offset they return are never written: here each call returns new values, which is what
made dpfx's self-check refuse Hugging Face GPT-2 on an H200 before Note [Attention kernels' side
outputs are not compared] (passes/verify/forward.py, lower/selfcheck/compare.py). The
references are the batch-of-one loop with torch's own CPU attention.
"""
import contextlib
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from support.models import tiny_gpt2_lm
from support.reference import check_one_compiled_pair

aten = torch.ops.aten
C = 0.05
FUSED = {"efficient": "aten._scaled_dot_product_efficient_attention",
         "flash": "aten._scaled_dot_product_flash_attention"}


def _scores(q, k, bias, is_causal, scale):
    att = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if bias is not None:
        att = att + bias
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        att = att.masked_fill(causal, float("-inf"))
    return att


def _bhtd(t):
    """(B, H, T, D) values stored as (B, T, H, D), the CUDA kernels' output layout."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@contextlib.contextmanager
def fused_attention_on_cpu(kernel="efficient"):
    unwritten = itertools.count(12345)

    def forward(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, scale=None):
        att = _scores(q, k, bias, is_causal, scale)
        t = q.shape[-2]
        lse = torch.full((*q.shape[:2], -(-t // 32) * 32), float("inf"), dtype=torch.float32)
        lse[..., :t] = torch.logsumexp(att.float(), -1)
        seed, offset = (torch.tensor(next(unwritten) * 7919) for _ in range(2))
        return _bhtd(torch.softmax(att, -1) @ v), lse, seed, offset

    def backward(g, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask,
                 is_causal=False, scale=None):
        p = torch.softmax(_scores(q, k, bias, is_causal, scale), -1)
        dp = g @ v.transpose(-2, -1)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        s = q.shape[-1] ** -0.5 if scale is None else scale
        return (_bhtd(ds @ k * s), _bhtd(ds.transpose(-2, -1) @ q * s),
                _bhtd(p.transpose(-2, -1) @ g), torch.empty(0))

    def flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, scale=None):
        att = _scores(q, k, None, is_causal, scale)
        seed = torch.tensor([next(unwritten), next(unwritten)], dtype=torch.uint64)
        offset = torch.tensor(next(unwritten), dtype=torch.uint64)
        out = torch.empty_like(q).copy_(torch.softmax(att, -1) @ v)   # laid out as the query
        return (out, torch.logsumexp(att.float(), -1), None, None,
                q.shape[-2], k.shape[-2], seed, offset, torch.empty(0, dtype=q.dtype))

    def flash_backward(g, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal,
                       seed, offset, scale=None):
        grads = backward(g, q, k, v, None, out, lse, seed, offset, dropout_p, None, is_causal,
                         scale)[:3]
        return tuple(torch.empty_like(t).copy_(d) for t, d in zip((q, k, v), grads))

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if kernel == "flash" and attn_mask is None:
            return aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, scale=scale)[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:   # as torch's SDPA does
            attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(
                attn_mask.logical_not(), float("-inf"))
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale)[0]

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_efficient_attention", forward, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention_backward", backward, "CPU")
    lib.impl("_scaled_dot_product_flash_attention", flash, "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", flash_backward, "CPU")
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
        lib._destroy()


class Attention(nn.Module):
    """(B, T, 8) -> (B, 3): a causal self-attention layer through F.scaled_dot_product_attention,
    mean over time, a head."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 3)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(h.transpose(1, 2).flatten(2).mean(1))


def _check(dp, model, loss_fn, make, batches, reduction, kernel="efficient"):
    """dpfx (sigma 0) through a fused kernel against torch's own attention in the loop."""
    check_one_compiled_pair(dp, model, loss_fn, make, batches, reduction, max_grad_norm=C,
                            around=lambda: fused_attention_on_cpu(kernel), bites=False)
    backward = dp._dpfx_backend.last_backward.gm.graph
    assert any(f"{FUSED[kernel]}_backward" in str(n.target) for n in backward.nodes), \
        "the fused kernel ran"


def _sequences(b, t=5):
    g = torch.Generator().manual_seed(b)
    return (torch.randn(b, t, 8, generator=g) * 3,), torch.arange(b) % 3


@pytest.mark.parametrize("kernel", ["efficient", "flash"])
def test_attention_layer_through_the_fused_kernel(kernel):
    """Each fused kernel's outputs as its meta kernel states them (flash: undefined sequence
    offsets, integer maximal lengths, a uint64 RNG state, an empty debug mask)."""
    torch.manual_seed(0)
    model = Attention()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction="sum")
    _check(dp, model, F.cross_entropy, _sequences, [4, 0, 1, 5, 3], "sum", kernel)


def test_side_outputs_compared_would_refuse(monkeypatch):
    """Without Note [Attention kernels' side outputs are not compared], the self-check reads the
    kernel's never-written seed as a batch-free output that changed: the refusal seen on the GPU."""
    import dpfx.passes

    monkeypatch.setattr(dpfx.passes, "attention_side_output", lambda node: False)
    torch.manual_seed(0)
    model = Attention()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction="sum")
    (x,), y = _sequences(4)
    with fused_attention_on_cpu(), pytest.raises(dpfx.PrivacyError, match="batch-free output"):
        F.cross_entropy(dp(x), y, reduction="sum").backward()


def test_gpt2_through_the_fused_kernel():
    """Hugging Face GPT-2 (tied head, causal SDPA attention) as a GPU runs it, batch sizes
    equal to the sequence length and the width among them."""
    torch.manual_seed(0)
    model, lm_loss, make = tiny_gpt2_lm()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction="sum")
    _check(dp, model, lm_loss, make, [3, 0, 1, 4, 8], "sum")
