"""The rule for a block's parameters (``dpfx::block_grad``, ops/blocks.py): ghost only.

A block called as one op returns each parameter's plain gradient from ``block_grad(key, [norms,
*operands])``. Its per-sample form is the block's own: the squared norm of parameter j is in row
``rows[j]`` of the ``norms`` that ``block_bwd`` computed, a row shared by the block's parameters
in j's clipping group and taken once into the group's norm (``Ghost.norm_shared``; Note [One
norm row per clipping group] in passes/block.py), and the clipped sum is output j of
``block_clip`` given the clip coefficients and finite masks. Every parameter of one block call clipped by the
same ``Clip`` emits the same ``block_clip`` node (the emitter shares equal nodes), so flat
clipping runs part B once per block call; per-layer groups that split a block run it once per
group. There is no materialized form: a block never builds (B, *param.shape).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dpfx.ops.blocks import kernels
from dpfx.rules.registry import Ghost, Rule, register

aten = torch.ops.aten


def _call(node: fx.Node) -> fx.Node | None:
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
            and node.args[0].target is torch.ops.dpfx.block_grad.default:
        return node.args[0]
    return None


def check_block(node: fx.Node, ctx) -> str | None:
    if _call(node) is None:
        return "not an output of dpfx::block_grad"
    return None


def ghost_block(node: fx.Node, ctx) -> Ghost:
    call = _call(node)
    key, args = call.args
    norms, operands = args[0], list(args[1:])
    j = node.args[1]
    emit = ctx.emit
    norm_sq = emit(aten.select.int, norms, 0, kernels(key).rows[j])

    def clipped_sum(clip) -> fx.Node:
        count = len(kernels(key).params)
        out = emit(torch.ops.dpfx.block_clip.default, key, [clip.coef] * count,
                   [clip.keep] * count, operands, tag="block_clip")
        return emit(operator.getitem, out, j, tag="clipped_sum")

    return Ghost(norm_sq, clipped_sum, norm_shared=True)


def rewrite_block(node: fx.Node, ctx) -> fx.Node:
    from dpfx.errors import CaptureError
    raise CaptureError(
        f"dpfx: the parameters of block {kernels(_call(node).args[0]).name} were given the "
        f"materialized per-example form, which per-block graphs do not have (their gradient is "
        f"formed from one block call's norms). Compile without blocks (blocks=False)")


def cost_block(node: fx.Node, ctx) -> dict:
    # the block's part A and B run whatever the strategy; nothing here is per-sample sized
    return {"time": 0, "memory": 1, "ghost_memory": 0}


BLOCK = register(Rule("block", targets=(torch.ops.dpfx.block_grad.default,), check=check_block,
                      rewrite=rewrite_block, cost=cost_block, ghost=ghost_block))


def ghost_only(node: fx.Node) -> bool:
    """Whether ``node`` is a gradient only the ghost form can rewrite."""
    return _call(node) is not None
