"""The vmap fallback: a per-sample form for a weight-gradient op that no rule matches.

Example: a per-head weight used through einsum, ``torch.einsum("bhi,hio->bo", x, w)``, reaches the
backward graph as a batched matrix product that contracts over the batch, and no rule covers it::

    bmm_1 = bmm(permute_6, view_6)          # f32[1, 8, B] @ f32[1, B, 3] -> f32[1, 8, 3]

The fallback moves the example dim of every batch-carrying operand to the front
(``Emitter.batch_to_front``: example i's slice keeps the operand's rank, with ``outer*inner`` where
``outer*B*inner`` was), traces ``vmap(bmm)`` over that dim with make_fx under the graph's own fake
mode and Inductor's decompositions, and splices the traced ATen nodes into the graph. functorch's
batching rules write the per-example op as ordinary batched ATen (here a broadcast ``mul``), which
Inductor fuses like any other node::

    vmap(bmm)(f32[B, 1, 8, 1], f32[B, 1, 1, 3])  ->  f32[B, 1, 8, 3]

The fallback is never silent: the parameter's rule reads ``vmap-fallback(aten.bmm.default)`` in
``dpfx.explain``, and compiling warns once with a ``FallbackWarning`` naming parameter and op.

# Note [Why the vmap fallback is private and exact]
Private: vmap computes row i of its output from the i-th slice of each mapped operand and from the
unmapped operands only. ``check_vmap`` demands that every data-dependent operand is mapped (carries
the batch with a proven layout) and that every unmapped one is data-independent, so row i is a
function of example i's data alone, whatever the op computes; clipping row i bounds example i's
influence. Exact: the rows sum to the op's output only if the op is a sum of per-example terms. A
multilinear contraction is, when every batch-carrying operand carries the batch in the index the
op contracts (the index that pairs the operands: no cross-example products) with the same layout.
``CONTRACTIONS`` lists those ops and which dim of each operand they contract. Any other op (a max or
a mean over examples, a product of two batch sums) would give private but wrong gradients, so the
fallback refuses it. tests/rules/test_rule_fallback.py pins both down against torch.func.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.node import map_arg

from dpfx.rules.registry import Rule
from dpfx.graph.batch import BatchDim, sym_expr
from dpfx.errors import DPFXWarning

aten = torch.ops.aten

# op -> {operand position: the dim of that operand the op contracts}. Each is multilinear in its
# operands and sums over one index shared by them, so a batch carried in that index splits the
# output into per-example terms.
CONTRACTIONS: dict = {
    aten.mm.default: {0: 1, 1: 0},
    aten.bmm.default: {0: 2, 1: 1},
    aten.mv.default: {0: 1, 1: 0},
    aten.dot.default: {0: 0, 1: 0},
    aten.vdot.default: {0: 0, 1: 0},
}


class FallbackWarning(DPFXWarning):
    """A parameter's per-sample gradient comes from the vmap fallback, not from a rule."""


def _tensor_operands(node: fx.Node) -> list[tuple[int, fx.Node]]:
    return [(i, a) for i, a in enumerate(node.args)
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def check_vmap(node, ctx) -> str | None:
    op = node.target
    if not isinstance(op, torch._ops.OpOverload):
        return f"{op} is not an ATen op (a tuple output or a Python function)"
    an = ctx.analysis
    if any(isinstance(a, fx.Node) and not isinstance(a.meta.get("val"), torch.Tensor)
           for a in node.all_input_nodes):
        return "an operand is a size computed in the graph; the fallback needs tensor operands"
    layouts = {}
    for i, a in _tensor_operands(node):
        lay = ctx.layout(a)
        if isinstance(lay, BatchDim):
            layouts[i] = lay
        elif an.is_batched(a):
            return f"operand {a.name} carries the batch in an unproven layout ({lay})"
        elif a in an.data_dependent:
            return (f"operand {a.name} depends on the data but has no batch dim, so no example's "
                    f"share of it can be told apart")
    contracted = CONTRACTIONS.get(op)
    if contracted is None:
        return (f"the fallback proves a per-example split only for contractions over the batch "
                f"({', '.join(str(o) for o in CONTRACTIONS)}); {op} is not one")
    for i, lay in layouts.items():
        if contracted.get(i) != lay.dim:
            return (f"operand {i} carries the batch in dim {lay.dim}, not in the contracted dim "
                    f"{contracted.get(i)}")
    if len({(lay.outer, lay.inner) for lay in layouts.values()}) > 1:
        return f"the operands flatten the batch differently ({list(layouts.values())})"
    return None


class FallbackRefused(Exception):
    pass


def rewrite_vmap(node, ctx):
    """Example dim to the front of each batch-carrying operand, then ``vmap(op)`` over it."""
    emit = ctx.emit
    operands = _tensor_operands(node)
    mapped = {i: emit.batch_to_front(a, ctx.layout(a)) for i, a in operands
              if isinstance(ctx.layout(a), BatchDim)}
    inputs = [mapped.get(i, a) for i, a in operands]
    positions = [i for i, _ in operands]
    args, kwargs = list(node.args), node.kwargs

    def one_example(*tensors):
        call = list(args)
        for i, t in zip(positions, tensors):
            call[i] = t
        return node.target(*call, **kwargs)

    in_dims = tuple(0 if i in mapped else None for i in positions)
    traced = _trace(torch.func.vmap(one_example, in_dims=in_dims), inputs, emit.fake_mode)
    out = _splice(traced, inputs, emit)
    want = [ctx.analysis.batch, *ctx.analysis.shape(node.meta["val"])]
    if ctx.analysis.shape(out.meta["val"]) != want:
        raise FallbackRefused(f"vmap of {node.target} gave shape "
                              f"{ctx.analysis.shape(out.meta['val'])}, expected {want}")
    return out


def _trace(fn, inputs: list[fx.Node], fake_mode) -> fx.GraphModule:
    from torch._inductor.decomposition import select_decomp_table

    try:
        with fake_mode:
            return make_fx(fn, tracing_mode="symbolic",
                           decomposition_table=select_decomp_table())(
                *[a.meta["val"] for a in inputs])
    except Exception as e:  # a batching rule or a decomposition that guards on the batch size
        raise FallbackRefused(f"tracing vmap of the op failed: {str(e).splitlines()[0]}") from e


def _splice(traced: fx.GraphModule, inputs: list[fx.Node], emit) -> fx.Node:
    """Re-emit the traced graph's nodes into the backward graph (fake values recomputed there)."""
    env: dict[fx.Node, fx.Node] = {}
    placeholders = iter(inputs)
    for n in traced.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(placeholders)
        elif n.op == "call_function":
            env[n] = emit(n.target, *map_arg(n.args, env.__getitem__),
                          **map_arg(n.kwargs, env.__getitem__))
        elif n.op == "output":
            return map_arg(n.args[0], env.__getitem__)
        else:
            raise FallbackRefused(f"the traced per-example op holds a {n.op} node ({n.target})")
    raise FallbackRefused("the traced per-example op has no output")


def cost_vmap(node, ctx) -> dict:
    """The op's own flops (torch's flop counter; 0 for an op it has no formula for) and the
    per-sample output's size."""
    from torch.utils.flop_counter import FlopCounterMode

    with ctx.emit.fake_mode, FlopCounterMode(display=False) as counter:
        node.target(*map_arg(node.args, lambda a: a.meta["val"]),
                    **map_arg(node.kwargs, lambda a: a.meta["val"]))
    flops = sym_expr(counter.get_total_flops())
    numel = sym_expr(node.meta["val"].numel())
    return {"form": f"vmap({node.target}) over the examples",
            "flops": flops.subs(ctx.analysis._subs), "memory": ctx.analysis.batch * numel}


FALLBACK = Rule("vmap-fallback", (), check_vmap, rewrite_vmap, cost_vmap)


def fallback_rule(node: fx.Node) -> Rule:
    """The fallback, named after the op it stands in for (what ``dpfx.explain`` shows)."""
    return dataclasses.replace(FALLBACK, name=f"vmap-fallback({node.target})")



# Note [The vmap lift: data-independent transforms of a weight]
# A weight used through a transform of the parameters alone (weight standardization
# ``(w - w.mean()) / w.std()``, weight_norm's ``g * v / ||v||``, an orthogonal or user
# parametrization) has gradient ``J_T(w)^T grad_w'``: the backward nodes between the frontiers
# (``grad_w'``, sums over the batch) and the parameter's gradient output are the transform's VJP,
# f(g_1, ..., g_k; c). Instead of one lift rule per op of every transform, when the lift rules do
# not cover that chain the whole chain is replayed as ``vmap(f)`` over the frontiers' per-sample
# forms, with its other inputs c unmapped.
# - Private: row i of the vmap depends on row i of each frontier's per-sample form and on c only;
#   ``chain_inputs`` proves every input of the chain other than the frontiers data-independent
#   (no batch dim, not computed from the data), so row i is a function of example i's data alone.
#   A batch-free input that does depend on the data (the gradient of a forward output without a
#   batch dim, such as a weight that a forward pre-hook stores on the module) is refused.
# - Exact: the rows sum to f(sum_i g_1i, ...) because f is linear in the g's: every backward
#   formula is linear in the gradient it receives, the chain's other inputs are primal values, and
#   the forward check proves that no batch-free saved tensor comes from the data. The chain must be
#   replayed whole: single ops of it need not be linear (matrix_exp's backward concatenates the
#   gradient with a constant block and exponentiates), only their composition is.
# tests/rules/test_weight_transforms.py checks the customers against torch.func.
def chain_inputs(chain: list[fx.Node], frontiers: list[fx.Node], ctx) -> list[fx.Node]:
    """The chain's inputs other than the frontiers, all proven data-independent tensors; raises
    FallbackRefused naming the first that is not."""
    an, inside = ctx.analysis, set(chain) | set(frontiers)
    leaves = []
    for n in chain:
        for a in n.all_input_nodes:
            if a in inside or a in leaves:
                continue
            if not isinstance(a.meta.get("val"), torch.Tensor):
                raise FallbackRefused(f"an input of its backward, {a.name}, is a size computed "
                                      f"in the graph")
            if an.is_batched(a) or a in an.data_dependent:
                raise FallbackRefused(f"an input of its backward, {a.name}, depends on the data")
            leaves.append(a)
    return leaves


# Backward ops with neither a batching rule nor a decomposition: vmap would loop over the
# (symbolic) batch. Written out here in batchable ops.
def _weight_norm_backward(grad_w, v, g, norms, dim):
    """w = g * v / ||v|| (the norm over every dim but ``dim``): torch's weight_norm backward."""
    dims = [d for d in range(v.dim()) if d != dim % v.dim()]
    grad_g = (grad_w * v).sum(dims, keepdim=True) / norms
    grad_v = (g / norms) * (grad_w - v * (grad_g / norms))
    return grad_v, grad_g


_COMPOSITE = {aten._weight_norm_interface_backward.default: _weight_norm_backward}


def lift_chain(out: fx.Node, chain: list[fx.Node], frontiers: dict[fx.Node, fx.Node], ctx):
    """``vmap`` of the chain (topologically ordered nodes ending at ``out``) over the frontiers'
    per-sample forms (example dim 0); its other inputs unmapped."""
    from torch._inductor.decomposition import select_decomp_table

    decomps = select_decomp_table()
    leaves = chain_inputs(chain, list(frontiers), ctx)
    sources = list(frontiers) + leaves

    def replay(*values):
        env = dict(zip(sources, values))
        for n in chain:
            args, kwargs = map_arg(n.args, env.__getitem__), map_arg(n.kwargs, env.__getitem__)
            op = _COMPOSITE.get(n.target) or decomps.get(n.target)
            value = NotImplemented if op is None else op(*args, **kwargs)
            env[n] = n.target(*args, **kwargs) if value is NotImplemented else value
        return env[out]

    in_dims = (0,) * len(frontiers) + (None,) * len(leaves)
    inputs = list(frontiers.values()) + leaves
    try:
        traced = _trace(torch.func.vmap(replay, in_dims=in_dims), inputs, ctx.emit.fake_mode)
    except FallbackRefused as e:
        ops = sorted({str(n.target) for n in chain if isinstance(n.target, torch._ops.OpOverload)})
        raise FallbackRefused(f"torch cannot batch the transform's backward ({', '.join(ops)}) "
                              f"over a symbolic batch size ({e})") from None
    return _splice(traced, inputs, ctx.emit)
