"""Where dpfx's emitted nodes run in the backward: the per-sample norms as early as their inputs.

Emission puts every node dpfx adds before the graph's output, so they run after the whole
original backward. That is right for what depends on the clip coefficient (it needs every
parameter's norm), and wrong for the norms themselves: a per-sample LayerNorm weight gradient
read at the end keeps its (B, T, d) output gradient and normalized input alive through every
layer below it, which the non-private backward freed after that layer.

Note [Norms run as early as their inputs]
Each emitted node that the per-sample norms depend on, and that is not larger than its largest
tensor input, moves to right after its last input. Such a node (a view, a one-to-one copy, a Gram
(B, R, R) of (B, R, N) rows with R <= N, an elementwise product, a reduction) lets its inputs die
where the original backward's last use of them is, and holds at most as much in their place. A node
that grows (a materialized per-sample gradient (B, out, in) from (B, T, *) rows with T < out, in, or
a convolution's) stays at the end: run early, it would coincide with the layer's own backward
kernels (on a GroupNorm CNN, moving every emitted node raises the step's peak by a third) and
hold more than its inputs until the clip. Then each moved node whose early place frees less than
it holds goes back down, to just before its first reader (but a part of a stack of vector parameters' per-sample
gradients, whose first reader is the stack): what it frees is every input whose storage it is the
last to read, counted at the input's size for a tensor of the original backward and at what the
input itself freed for one that moved with it. So a copy made early only for a Gram, whose partner
Gram (of a convolution's patches) is late, goes back down with that Gram: together they free nothing
the book-keeping product does not read again. Nothing downstream of a clip coefficient moves: the
clipped sums and the noise stay in emission order, one book-keeping product at a time. Moving a node
up, never above an input, and back down, never below a reader, keeps the order topological; the
values are unchanged.
(tests/passes/test_schedule.py)
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from dpfx.rules import at_nominal
from dpfx.graph.batch import sym_expr

aten = torch.ops.aten


def _size(node: fx.Node) -> float | None:
    """Elements of the node's output at the nominal sizes; 0 for a scalar (a size); None for
    anything else (a tuple), which does not move."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return at_nominal(sympy.Mul(*[sym_expr(s) for s in val.shape]))
    if isinstance(val, (torch.SymInt, torch.SymFloat, int, float)):
        return 0.0
    return None


def _norm_phase(graph: fx.Graph) -> set[fx.Node]:
    """The emitted nodes the per-sample norms are computed from."""
    roots = [n for n in graph.nodes if n.meta.get("dpfx") == "per_sample_norms"]
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen or not node.meta.get("dpfx_emitted"):
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.permute.default, torch.ops.aten.t.default,
          torch.ops.aten.expand.default, torch.ops.aten.unsqueeze.default,
          torch.ops.aten.squeeze.dim, torch.ops.aten.select.int, torch.ops.aten.slice.Tensor,
          torch.ops.aten.transpose.int, torch.ops.aten.alias.default}


def _base(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node


def _readers(base: fx.Node) -> list[fx.Node]:
    """The nodes that read ``base``'s storage: its users, through any chain of views."""
    out, stack = [], list(base.users)
    while stack:
        user = stack.pop()
        if user.op == "call_function" and user.target in _VIEWS:
            stack.extend(user.users)
        else:
            out.append(user)
    return out


def _last_reader(node: fx.Node, base: fx.Node) -> bool:
    """Whether ``node`` is the last to read ``base``'s storage, which can then be freed after it
    (a graph output never is)."""
    readers = _readers(base)
    return all(r.op != "output" and (r is node or r < node) for r in readers)


def place_norms_early(graph: fx.Graph) -> int:
    """Note [Norms run as early as their inputs]. Returns how many nodes moved."""
    movable = _norm_phase(graph)
    if not movable:
        return 0
    placeholders = list(graph.find_nodes(op="placeholder"))
    start = placeholders[-1] if placeholders else None
    # Nodes moved behind the same anchor keep their emission order.
    last_behind: dict[fx.Node, fx.Node] = {}
    moved: list[fx.Node] = []
    for node in list(graph.nodes):
        if node not in movable or node.op != "call_function":
            continue
        size = _size(node)
        if size is None:
            continue
        inputs = node.all_input_nodes
        sizes = [_size(i) for i in inputs]
        if any(s is None for s in sizes) or size > max(sizes + [1.0]):
            continue
        anchor = max(inputs) if inputs else start
        if anchor is None:
            continue
        if anchor.op == "placeholder":   # the graph's inputs stay together at its start
            anchor = start
        after = last_behind.get(anchor, anchor)
        if after.next is not node:
            after.append(node)
            moved.append(node)
        last_behind[anchor] = node
    # What a moved node's early place frees: each input whose storage it is the last to read,
    # a tensor of the original backward at its size, an input that moved with it at what that
    # one freed in turn. A node holding more than that goes back down to just before its first
    # reader (the latest first, so that a chain goes down as a whole).
    freed: dict[fx.Node, float] = {}
    moved_set = set(moved)
    for node in moved:
        total = 0.0
        for base in {_base(x) for x in node.all_input_nodes}:
            if _last_reader(node, base):
                total += freed.get(base, 0.0) if base in moved_set else (_size(base) or 0.0)
        freed[node] = total
    sunk = 0
    for node in reversed(moved):
        size = _size(node)
        if node.target in _VIEWS or not node.users or not size or freed[node] >= size \
                or _stacked(node):
            continue
        first = min(node.users)
        if node.next is not first:
            first.prepend(node)
            sunk += 1
    return len(moved) - sunk


def _stacked(node: fx.Node) -> bool:
    """Whether ``node`` (through views) is a part of a stack of vector parameters' per-sample
    gradients (Note [Vector parameters' per-sample gradients stacked] in clip_noise.py). Its
    first reader is the stack, after the last part: sunk there, a per-sample sum over tokens
    would hold the layer's (B, T, d) output gradient, which the layer's own backward frees,
    through every layer below. It stays where it moved, as when its own norm read it there."""
    return any(r.target is aten.cat.default and r.meta.get("dpfx_emitted")
               for r in _readers(node))
