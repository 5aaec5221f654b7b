"""The block proof: a block's clipped sums, inside the block and where the model's graph reads them.

    verify_block(gm, an, clipped, cuts, squares, rows)  # the block's backward (passes/block.py)
    factor, row = check_block_clip(c, covered, bound_of, an, config, real)   # the model's graph

A block (a decoder layer called as ``dpfx::block_fwd``) is compiled once and its backward split
at the clip coefficient (passes/block.py): the block's graph takes each parameter's coefficient
and finite-example mask as inputs. Its proof is in two halves, one per graph, which together
are the flat proof of clip.py for each of the block's parameters (Note [A block's clipped sums]):
``verify_block`` runs when the block's backward is compiled, ``check_block_clip`` for each
``dpfx::block_clip`` output in the backward proof of the model's graph (backward.py).
"""
from __future__ import annotations

import operator

import networkx as nx
import torch
import torch.fx as fx

from dpfx.config import DPConfig
from dpfx.errors import PrivacyError
from dpfx.graph.batch import BatchAnalysis
from dpfx.ops.blocks import graph_operands, kernels
from dpfx.passes.verify.clip import check_clipped_sum, scaling_factor
from dpfx.passes.verify.patterns import (as_nx, broadcast_source, clip_apply_of, data_sources,
                                        norm_sources, reached, release_ancestors, tagged)

aten = torch.ops.aten


def verify_block(gm: fx.GraphModule, an: BatchAnalysis, clipped: list[fx.Node],
                 cuts: list[tuple[fx.Node, fx.Node]], squares: list[fx.Node],
                 rows: list[fx.Node] | None = None) -> None:
    """What the root graph relies on for each parameter j of the block: its output j is a sum
    over examples in which every term that carries an example is scaled by ``coef_j`` and
    selected by ``keep_j``, and the operand scaled is one that ``squares[j]``, parameter j's own
    squared norm, is taken over (not another parameter's of its group: that would release one
    gradient twice), and ``squares[j]`` is part of ``rows[j]``, the norm row the model's graph
    reads for j. No path from the data reaches a clipped output except through those
    products."""
    graph = gm.graph
    g = as_nx(graph)
    sources = data_sources(graph, an, skip={n for pair in cuts for n in pair})
    sums = tagged(graph, "clipped_sum")
    leaked = reached(g, sources, blocked=set(sums))
    dependent = reached(g, sources)
    if len(set(clipped)) != len(clipped):
        raise PrivacyError("two of the block's parameters are released from one clipped sum")
    taken: dict[fx.Node, int] = {}
    for j, row in enumerate(rows or []):
        if row is not squares[j] and squares[j] not in nx.ancestors(g, row):
            raise PrivacyError(f"block parameter {j}'s squared norm is not part of its norm row")
    for j, (out, (coef, keep), sq) in enumerate(zip(clipped, cuts, squares)):
        if out in leaked:
            raise PrivacyError(f"block parameter {j}'s clipped sum has a path from the data that "
                               f"bypasses its clip coefficient")
        ancestors = release_ancestors(g, out)
        mine = [c for c in sums if c in ancestors]
        if not mine:
            raise PrivacyError(f"block parameter {j}'s output is not a clipped sum")
        # what j's norm row is taken over: its ancestors through dpfx's own nodes, stopping at
        # the captured graph's (a later layer's output gradient is upstream of this parameter's
        # per-sample gradient without being part of its norm)
        covered = norm_sources(sq)
        for c in mine:
            if taken.setdefault(c, j) != j:
                raise PrivacyError(f"{c.name} is released for block parameters {taken[c]} and {j}")
            apply = clip_apply_of(c)
            _, scale = apply.args
            if broadcast_source(scale) is not coef:
                raise PrivacyError(f"{c.name} is not scaled by block parameter {j}'s coefficient")
            check_clipped_sum(c, apply, keep, covered, dependent, f"parameter {j}'s norm")


# Note [A block's clipped sums]
# A block called as one op (ops/blocks.py) returns parameter j's clipped sum as output j of
# ``dpfx::block_clip(key, coefs, keeps, operands)``. What happens inside was proven when the
# block was compiled (``verify_block`` above): output j sums examples' terms each scaled by
# coefs[j] and selected by keeps[j], over operands that row rows[j] of the block's norms is taken
# over. Here the root graph proves the rest: coefs[j] is a clip coefficient of this graph (its
# factor's C is the parameter's group's), keeps[j] is that factor's finite mask, the operands
# are those of one ``dpfx::block_bwd`` call (the handle it returned for the operands it holds,
# then its inputs that are operands: ops/blocks.graph_operands), and row rows[j] of that call's
# norms (the row of j's clipping group) is part of the norm the factor is computed from.
def is_block_clip(node: fx.Node) -> bool:
    return node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
        and node.args[0].target is torch.ops.dpfx.block_clip.default


def check_block_clip(c: fx.Node, covered: dict, bound_of: dict, an: BatchAnalysis,
                     config: DPConfig, real: fx.Node | None = None
                     ) -> tuple[fx.Node, tuple[fx.Node, int]]:
    """The model's graph's half of Note [A block's clipped sums] for ``c``, a getitem of a
    ``dpfx::block_clip`` call; returns its clip factor and the (block_bwd call, parameter
    index) it releases."""
    call, j = c.args
    key, coefs, keeps, operands = call.args
    k = kernels(key)
    base = scaling_factor(coefs[j], an, config, real)
    if base not in bound_of:
        raise PrivacyError(f"{c.name} (block {k.name}) is not scaled by a clip factor")
    if keeps[j] is not base.args[0]:
        raise PrivacyError(f"{c.name} (block {k.name}) is not selected by its clip factor's "
                           f"finite-example mask")
    calls = {o.args[0] for o in operands if o.target is operator.getitem
             and o.args[0].target is torch.ops.dpfx.block_bwd.default}
    if len(calls) != 1:
        raise PrivacyError(f"{c.name} (block {k.name}) does not read one dpfx::block_bwd call")
    bwd = calls.pop()
    expected = [("out", o.args[1]) if o.target is operator.getitem and o.args[0] is bwd
                else ("in", bwd.args[1].index(o)) if o in bwd.args[1] else None
                for o in operands]
    if expected != graph_operands(k):
        raise PrivacyError(f"{c.name} (block {k.name}) reads operands other than its "
                           f"block_bwd call's")
    # parameter j's row, which verify_block proved covers j's clipped sum
    rows = [n for n in covered[base] if n.target is aten.select.int
            and n.args[1:] == (0, k.rows[j]) and n.args[0].target is operator.getitem
            and n.args[0].args == (bwd, k.norms)]
    if not rows:
        raise PrivacyError(f"{c.name} (block {k.name}): norm row {k.rows[j]} of its block call "
                           f"(parameter {j}'s) is not part of the per-sample norm it is "
                           f"clipped by")
    return base, (bwd, j)
