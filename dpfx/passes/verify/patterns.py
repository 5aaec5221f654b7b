"""The graph patterns the proofs read: walks over the backward graph and the forms dpfx emits.

    g = as_nx(gm.graph)
    leaked = reached(g, data_sources(gm.graph, an), blocked=set(tagged(gm.graph, "clipped_sum")))
    apply = clip_apply_of(c)            # the clip_apply node a clipped sum reduces
    covered = norm_sources(factor)      # what a clip factor's per-sample norm is taken over

Each helper recognizes one form and nothing looser: a proof rule is the composition of these
with a check (backward.py, block.py), so a form is recognized the same way by every proof that
reads it. The tags they follow are ``node.meta["dpfx"]``, written by passes/clip_noise.py.
"""
from __future__ import annotations

import operator

import networkx as nx
import torch
import torch.fx as fx

import dpfx.ops  # noqa: F401  (registers the dpfx:: ops the graphs hold)
from dpfx.errors import PrivacyError
from dpfx.graph.batch import BatchAnalysis

aten = torch.ops.aten


def as_nx(graph: fx.Graph) -> nx.DiGraph:
    g = nx.DiGraph()
    for node in graph.nodes:
        g.add_node(node)
        for a in node.all_input_nodes:
            g.add_edge(a, node)
    return g


def tagged(graph: fx.Graph, tag: str) -> list[fx.Node]:
    return [n for n in graph.nodes if n.meta.get("dpfx") == tag]


def data_sources(graph: fx.Graph, an: BatchAnalysis, skip: set = frozenset()) -> list[fx.Node]:
    """The inputs that carry an example's data: the tangents and every saved activation that
    carries the batch (less ``skip``)."""
    return [n for n in graph.find_nodes(op="placeholder")
            if n not in skip and (an.is_batched(n) or n.name.startswith("tangents"))]


def reached(g: nx.DiGraph, sources: list, blocked: set = frozenset()) -> set[fx.Node]:
    """The sources and every node a path from one of them reaches without entering ``blocked``:
    one walk from all of them (a walk per source would read the graph once per tangent and
    saved tensor)."""
    seen = {s for s in sources if s not in blocked}
    todo = list(seen)
    while todo:
        for m in g.successors(todo.pop()):
            if m not in seen and m not in blocked:
                seen.add(m)
                todo.append(m)
    return seen


def leak_path(cut: nx.DiGraph, sources, out) -> list[fx.Node]:
    for s in sources:
        if nx.has_path(cut, s, out):
            return nx.shortest_path(cut, s, out)
    return [out]


def is_add_noise(node) -> bool:
    return isinstance(node, fx.Node) and \
        node.target is torch.ops.higher_order.auto_functionalized_v2 and \
        node.args[:1] == (torch.ops.dpfx.add_noise_.default,)


def release_ancestors(g: nx.DiGraph, out: fx.Node, memo: dict | None = None) -> set[fx.Node]:
    """What ``out`` is computed from. Through a dpfx::add_noise_ call, only the base that its
    getitem releases counts (the call reads every parameter's clipped sum, but sum k's new
    value depends on base k alone): otherwise each parameter would inherit every other one's
    clipped sums and, with per-layer clipping, their bounds. ``memo`` keeps what each such
    getitem reaches, the same for every output read from it (a stack's slices, Note [Vector
    parameters' per-sample gradients stacked] in clip_noise.py: each reaches every part)."""
    seen, todo = {out}, [out]
    while todo:
        node = todo.pop()
        if node.target is operator.getitem and is_add_noise(node.args[0]) and \
                isinstance(node.args[1], int) and \
                1 <= node.args[1] <= len(node.args[0].kwargs.get("_all_bases", ())):
            if memo is not None and node is not out:
                if node not in memo:
                    memo[node] = frozenset(release_ancestors(g, node))
                seen |= memo[node]
                continue
            call = node.args[0]
            inputs = [call.kwargs["_all_bases"][node.args[1] - 1]]
            seen.add(call)
            inputs += [x for x in (call.kwargs.get("divisor"),) if isinstance(x, fx.Node)]
        else:
            inputs = list(g.predecessors(node))
        for a in inputs:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


MOVES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
         aten.permute.default, aten.unsqueeze.default}


def through_moves(node: fx.Node) -> fx.Node:
    while node.target in MOVES and node.meta.get("dpfx") is None:
        node = node.args[0]
    return node


# The ops that spread a [B] vector over an example's positions (Emitter.per_example).
BROADCASTS = {aten.view.default, aten.reshape.default, aten.expand.default,
              aten.unsqueeze.default}


def broadcast_source(node: fx.Node) -> fx.Node:
    while node.target in BROADCASTS and node.meta.get("dpfx") is None:
        node = node.args[0]
    return node


def clip_apply_of(clipped: fx.Node) -> fx.Node:
    """The clip_apply node a clipped sum reduces, under its finiteness select: a direct input
    (materialize) or one reached through data movement (the book-keeping product's operand)."""
    applies = [through_moves(x) for x in clipped.all_input_nodes]
    applies = [through_moves(x.args[1]) if x.meta.get("dpfx") == "finite_mask" else x
               for x in applies]    # a missing select is reported by finite_masked
    applies = [x for x in applies if x.meta.get("dpfx") == "clip_apply"]
    if len(applies) != 1:
        raise PrivacyError(f"clipped sum {clipped.name} does not reduce exactly one clip_apply node")
    return applies[0]


def floating(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.is_complex())


def is_zero(x) -> bool:
    if isinstance(x, fx.Node):
        return x.target is aten.scalar_tensor.default and x.args[0] == 0
    return x == 0


def finite_masked(x: fx.Node, keep: fx.Node, clipped: fx.Node) -> fx.Node:
    """The value that operand ``x`` of ``clipped`` selects: x must be (data movement of)
    where(keep, value, 0) with ``keep`` the clip factor's finite-example mask, so that an example
    with a non-finite norm adds exactly zero (Note [Non-finite examples contribute zero])."""
    mask = through_moves(x)
    if mask.meta.get("dpfx") != "finite_mask" or mask.target is not aten.where.self or \
            broadcast_source(mask.args[0]) is not keep or not is_zero(mask.args[2]):
        raise PrivacyError(f"{x.name} enters the clipped sum {clipped.name} without the select "
                           f"where(isfinite(norm), ., 0) of its clip factor: an example with a "
                           f"non-finite gradient would make the release NaN")
    value = through_moves(mask.args[1])
    while value.target is torch.ops.prims.convert_element_type.default and \
            widens(value.args[0], value):   # a book-keeping operand cast up (exact)
        value = through_moves(value.args[0])
    return value


def widens(src: fx.Node, dst: fx.Node) -> bool:
    a, b = src.meta["val"].dtype, dst.meta["val"].dtype
    return torch.promote_types(a, b) == b


def norm_sources(factor: fx.Node) -> set[fx.Node]:
    """What a clip factor's per-sample norm is taken over: its ancestors through the nodes dpfx
    emitted (the norm, the per-sample forms), stopping at the captured graph's own nodes. Walking
    on through torch's backward would accept anything upstream of the norm: with per-layer
    clipping, fc2's output gradient is upstream of fc1's per-sample gradients without being
    part of fc1's norm. A row picked out of the stacked norms that ``dpfx::observe_norms`` sees
    descends from that row's group only (ops/norms.py)."""
    seen, todo = set(), [factor]
    while todo:
        node = todo.pop()
        if node is not factor and not node.meta.get("dpfx_emitted"):
            continue
        inputs = node.all_input_nodes
        if node.target is aten.select.int and inputs and \
                inputs[0].target is torch.ops.dpfx.observe_norms.default:
            stacked = inputs[0].args[0]
            if stacked.target is aten.cat.default:
                inputs = [stacked.args[0][node.args[2]]]
        for a in inputs:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen | {through_moves(x) for x in seen}   # clipped sums are compared the same way
