"""The self-check's eager reference: the verified graph, copied before Inductor lowers it.

    half = Half.of(gm, compiled)          # at compile time, before lowering rewrites gm
    want = half.reference(list(args))     # the proven graph, run by the FX interpreter

The copy runs in the boxed convention (Note [The self-check's runs free their inputs] in
selfcheck/batches.py), creates each tensor where it is first read, mutates in place where
nothing else sees it, releases each gradient on its own (selfcheck/stream.py) and is built only
when a check runs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx as fx
# torch's private: the one FX codegen that emits a boxed call (the inputs in one list, which the
# code clears as it starts), what lets the eager reference free each input after its last use
# (Note [The self-check's runs free their inputs] in selfcheck/batches.py). Used here only.
from torch.fx.graph import _BoxedCodeGen

from dpfx.lower.selfcheck.stream import fresh, stream_graph


def eager_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph as it is now, kept for running eagerly (lowering rewrites ``gm`` in place), its
    mutating calls on dead intermediates made in place (Note [The eager reference mutates in
    place where nothing else sees it])."""
    return fx.GraphModule(gm, _eager_graph(gm))


def _eager_graph(gm: fx.GraphModule) -> fx.Graph:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.find_nodes(op="call_function",
                                 target=torch.ops.higher_order.auto_functionalized_v2):
        _mutate_in_place(node)
    _sink_tensor_sources(graph)
    graph.set_codegen(_BoxedCodeGen())    # Note [The self-check's runs free their inputs]
    return graph


def _attributes(gm: fx.GraphModule, graph: fx.Graph) -> dict:
    """What the graph's get_attr nodes read from ``gm``, by name, as it is now: the root of the
    module built from ``graph`` later (Note [The eager reference is built when the check runs])."""
    values = {}
    for node in graph.find_nodes(op="get_attr"):
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        values[node.target] = value
    return values


# Note [The eager reference creates a tensor where it is first read]
# A captured graph may create a tensor from sizes alone long before it reads it: GPT-2 small's
# backward makes the [V, d] zeros its tied table's clipped sum accumulates into near its start,
# and reads them at its end. Inductor allocates a buffer when it is needed; the eager run held
# them through the whole backward, at the check's peak (GPT-2 small's are 154 MB). So in the
# eager copy a node that
# makes a tensor from no tensor (``full``, ``zeros``, ``scalar_tensor``, ``iota``; never a
# random op, whose place in the order decides its draws) moves to just before its first reader:
# the same values, created later.
def _sink_tensor_sources(graph: fx.Graph) -> None:
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or not node.users \
                or not isinstance(node.target, torch._ops.OpOverload) \
                or torch.Tag.nondeterministic_seeded in node.target.tags \
                or not isinstance(node.meta.get("val"), torch.Tensor) \
                or any(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes):
            continue
        min(node.users, key=order.__getitem__).prepend(node)


# Note [The eager reference mutates in place where nothing else sees it]
# A mutating op in a captured graph is ``auto_functionalized_v2(op, _all_bases=[...])``: run
# eagerly, it clones every base and mutates the clones. The release of a CPU graph is one such
# call, ``dpfx::add_noise_`` on every parameter's clipped sum (ops/noise.py), so an eager run of
# the verified backward would hold two copies of the model's gradients at once, one more than
# the compiled backward, whose lowering re-inplaces the call. A base that is a fresh
# value of the graph (computed by an op whose result aliases none of its inputs) and that no node
# but this call reads is invisible to the rest of the graph once the call starts, so mutating it
# in place computes the same values: ``_only_clone_these_bases`` lists the others, which keep
# their clones (graph inputs, views, values read elsewhere).
def _mutate_in_place(node: fx.Node) -> None:
    bases = node.kwargs.get("_all_bases", [])
    keep = node.kwargs.get("_only_clone_these_bases")
    keep = range(len(bases)) if keep is None else keep
    node.kwargs = {**node.kwargs, "_only_clone_these_bases": tuple(
        i for i in keep if not (fresh(bases[i]) and set(bases[i].users) == {node}))}


# Note [The eager reference is built when the check runs]
# Lowering rewrites the graph in place, so the check's copy is taken before; but a check may never
# run (Note [A self-check is not repeated on code it has passed]): on a warm cache, generating and
# compiling the copies' Python would be nearly all of it. So a Half holds the copied graph and the
# values its get_attr nodes read, and builds the module at its first use.
@dataclasses.dataclass
class Half:
    """One graph (forward or backward): its eager copy, compiled callable and placeholders."""
    eager: fx.GraphModule | tuple[fx.Graph, dict]   # the copy, or what builds it
    compiled: Callable
    inputs: list[tuple[str, Any]]         # placeholder name, meta value
    outputs: list[str | None]             # output node names (saved tensors keep them)
    output_vals: list[Any]                # their meta values
    random: bool                          # has random ops besides dpfx's noise
    low_precision: bool = False           # computes in 16-bit floats somewhere (autocast)
    streamed: tuple[int, ...] = ()        # outputs the reference hands to record, not returns

    @classmethod
    def of(cls, gm: fx.GraphModule, compiled: Callable) -> "Half":
        out = gm.graph.find_nodes(op="output")[0].args[0]
        out = out if isinstance(out, (list, tuple)) else [out]
        graph = _eager_graph(gm)
        streamed = stream_graph(graph)
        eager = (graph, _attributes(gm, graph)) \
            if not graph.find_nodes(op="call_module") else fx.GraphModule(gm, graph)
        return cls(eager, compiled,
                   [(n.name, n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder")],
                   [o.name if isinstance(o, fx.Node) else None for o in out],
                   [o.meta.get("val") if isinstance(o, fx.Node) else None for o in out],
                   has_random_ops(gm), _computes_in_16_bits(gm), streamed)

    @property
    def reference(self) -> fx.GraphModule:
        if isinstance(self.eager, tuple):
            graph, attributes = self.eager
            self.eager = fx.GraphModule(attributes, graph)
        return self.eager


def _computes_in_16_bits(gm: fx.GraphModule) -> bool:
    """Whether a value of the graph is a 16-bit float: its float32 outputs (norms, clipped sums
    under bfloat16 autocast) then carry 16-bit rounding, which Inductor's fused kernels and the
    eager graph accumulate differently."""
    return any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.is_floating_point()
               and v.element_size() <= 2 for n in gm.graph.nodes)


def has_random_ops(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and torch.Tag.nondeterministic_seeded in n.target.tags
               and n.meta.get("dpfx") != "noise" and _dropout_p(n) != 0
               for n in gm.graph.nodes)


def _dropout_p(node: fx.Node):
    """An op's ``dropout_p`` argument (SDPA kernels are tagged random for their dropout)."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dropout_p":
            if arg.name in node.kwargs:
                return node.kwargs[arg.name]
            return node.args[i] if i < len(node.args) else arg.default_value
    return None

