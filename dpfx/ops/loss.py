"""The loss's ops: the mark where the model ends and the loss begins, the loss's gradient as
a constant Inductor can read, and CTC's per-example losses.

    out = torch.ops.dpfx.model_output(logits)          # removed before aot_autograd
    zero = torch.ops.dpfx.loss_gradient(out, g, dtype)  # 0, whose gradient wrt out is g
    losses = torch.ops.dpfx.ctc_loss_per_example(log_probs, targets, in_lens, tgt_lens, 0, False)

Their uses: Note [The loss inside the graph] (loss/captured.py) and Note [Losses replayed through
a per-example op] (loss/check.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._inductor import decomposition as inductor_decomposition
from torch._inductor.decomposition import register_decomposition


@torch.library.custom_op("dpfx::model_output", mutates_args=())
def model_output(x: torch.Tensor) -> torch.Tensor:
    """Where the model ends and the loss begins (Note [The loss inside the graph]); removed
    from the graph before aot_autograd, so it never runs."""
    return x.clone()


@model_output.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("dpfx::loss_gradient", mutates_args=())
def loss_gradient(out: torch.Tensor, gradient: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zero, whose gradient with respect to ``out`` is ``gradient`` (Note [The loss inside the
    graph], step 4). Inductor's decomposition makes it the constant it is, so the forward never
    reads ``out`` for it; the backward is the one product ``tangent * gradient``."""
    return torch.zeros((), dtype=dtype, device=out.device)


@loss_gradient.register_fake
def _(out, gradient, dtype):
    return torch.empty((), dtype=dtype, device=out.device)


def _loss_gradient_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _loss_gradient_backward(ctx, grad):
    gradient, = ctx.saved_tensors
    return grad * gradient, None, None


loss_gradient.register_autograd(_loss_gradient_backward, setup_context=_loss_gradient_context)


@register_decomposition(torch.ops.dpfx.loss_gradient.default)
def _loss_gradient_zero(out, gradient, dtype):
    return torch.zeros((), dtype=dtype, device=out.device)


# Inductor's table with its random decompositions (what it traces with when ``fallback_random`` is
# off, as on a GPU) is a copy cached at its first use: a process that compiled anything before
# importing dpfx would trace without the decomposition above, and Inductor would then refuse the
# op it finds both decomposed and left in the graph.
if hasattr(getattr(inductor_decomposition, "fast_random_decomps", None), "cache_clear"):
    inductor_decomposition.fast_random_decomps.cache_clear()


@torch.library.custom_op("dpfx::ctc_loss_per_example", mutates_args=())
def ctc_loss_per_example(log_probs: torch.Tensor, targets: torch.Tensor,
                         input_lengths: torch.Tensor, target_lengths: torch.Tensor, blank: int,
                         zero_infinity: bool) -> torch.Tensor:
    return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=blank,
                      reduction="none", zero_infinity=zero_infinity)


@ctc_loss_per_example.register_fake
def _(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    return log_probs.new_empty(log_probs.shape[1])
