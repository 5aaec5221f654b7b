"""Module-level checks and fixes that need no graph: BatchNorm is the one every DP user meets.

    model = dpfx.replace_batchnorm(model)     # BatchNorm{1,2,3}d -> GroupNorm, in place

BatchNorm in training mode normalizes each example with statistics of the whole batch, so
example i's output depends on every other example and per-example clipping bounds nothing. The
forward check (passes/verify/forward.py) catches it in the graph too; this check runs first because
torch's batch_norm tests the batch size in Python, before dpfx sees any graph.
"""
from __future__ import annotations


import torch.nn as nn

from dpfx.errors import PrivacyError


def module_problems(model: nn.Module) -> list[str]:
    return [f"module '{name or '<root>'}' ({type(module).__name__}) {why}"
            for name, module in model.named_modules()
            for why in [_mixing(module)] if why]


def _mixing(module: nn.Module) -> str | None:
    """Why a normalization layer mixes the batch, and the fix; None when it does not. Eval-mode
    BatchNorm and InstanceNorm with frozen running statistics normalize each example alone
    (capture/swaps.py writes them out)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        if module.training:
            return ("is in training mode: BatchNorm averages over the batch, so each example's "
                    "output depends on the others. Replace it with GroupNorm "
                    "(dpfx.replace_batchnorm(model)), or put it in eval mode (module.eval()) "
                    "with frozen statistics.")
        if module.running_mean is None:
            return ("has no running statistics (track_running_stats=False), so it normalizes "
                    "with the batch's statistics even in eval mode: each example's output "
                    "depends on the others. Replace it with GroupNorm "
                    "(dpfx.replace_batchnorm(model)).")
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.training \
            and module.track_running_stats:
        return ("is in training mode with track_running_stats=True: each step averages the "
                "examples' statistics into its running buffers, which the model then releases "
                "unclipped and un-noised. Use track_running_stats=False (normalization per "
                "example is unchanged), or put it in eval mode with frozen statistics.")
    return None


def check_modules(model: nn.Module, norm_layers: list[nn.Module] | None = None) -> None:
    """Refuse a module that mixes the batch. ``norm_layers`` (from ``norm_layers``): look only
    at those first, and walk the model for the message only when one of them mixes; every
    training call runs this."""
    if norm_layers is not None and not any(_mixing(m) for m in norm_layers):
        return
    problems = module_problems(model)
    if problems:
        raise PrivacyError(problems[0])


_NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def norm_layers(model: nn.Module) -> list[nn.Module]:
    """The modules ``_mixing`` can object to."""
    return [m for m in model.modules() if isinstance(m, _NORM_LAYERS)]


def without_batch_mixing(model: nn.Module) -> nn.Module:
    """A model ``dpfx.validate`` can inspect after reporting ``module_problems``: BatchNorm
    swapped for GroupNorm, InstanceNorm's statistics tracking off, in place."""
    for module in model.modules():
        if isinstance(module, nn.modules.instancenorm._InstanceNorm):
            module.track_running_stats = False
            module.running_mean = module.running_var = None
    return replace_batchnorm(model)


def replace_batchnorm(model: nn.Module, max_groups: int = 32) -> nn.Module:
    """Swap every BatchNorm{1,2,3}d for a GroupNorm over the same channels, in place.

    The number of groups is the largest divisor of the channel count not above ``max_groups``,
    as is usual for DP image models (Opacus' fixer uses the gcd with 32)."""
    for name, child in model.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            channels = child.num_features
            groups = max(g for g in range(1, min(max_groups, channels) + 1) if channels % g == 0)
            setattr(model, name, nn.GroupNorm(groups, channels, eps=child.eps, affine=child.affine))
        else:
            replace_batchnorm(child, max_groups)
    return model


__all__ = ["check_modules", "module_problems", "norm_layers", "replace_batchnorm",
           "without_batch_mixing"]
