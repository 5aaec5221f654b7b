"""A block's backward graph as two private halves, split at the clip coefficient.

For a block (a decoder layer called as ``dpfx::block_fwd``), the whole model's clip factor is
not known while the block's backward runs: later blocks' norms come first, earlier ones after.
So the block's backward is rewritten per sample like a model's (the same rules), and then,
instead of a clip factor of its own, it takes each parameter's coefficient and finite-example
mask as inputs:

    part A:  (saved, output grads)          -> input grads, norms f32[R, B], operands
    part B:  (operands, coefs[P], keeps[P]) -> clipped sums, one per parameter

Row r of ``norms`` is the squared per-sample norm of the gradients of the parameters j with
``rows[j] == r``, as the graph holds them (the root graph scales it as it scales its own
parameters' squares): one row per clipping group the block's parameters fall in (one row under
flat clipping), so the model's graph adds one row per block call, not one per parameter
(Note [One norm row per clipping group]); ``operands`` are what
part B reads of part A: a ghost parameter's book-keeping operands (the layer's input and output
gradient rows), a materialized one's per-sample gradient. Part B is ``Clip.scale`` and the
clipped sums of ``passes/clip_noise.py``, so a block's parameter is clipped exactly as the same
parameter in a one-graph model; the root graph's verifier sees the coefficients and masks go in
(``verify_block``, in passes/verify/block.py, proves what happens inside).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from dpfx.config import DPConfig
from dpfx.errors import PrivacyError
from dpfx.graph.batch import BatchAnalysis, BatchDim
from dpfx.graph.emit import Emitter
from dpfx.passes.clip_noise import clipped_sum, squared_norm
from dpfx.passes.per_sample import ParamGrad, RewriteContext, rewrite_per_sample
from dpfx.passes.stack_time import stack_over_time
from dpfx.passes.verify import verify_block
from dpfx.rules import Clip

aten = torch.ops.aten


@dataclasses.dataclass
class BlockBackward:
    """The two halves and where each of the captured backward's outputs went."""
    part_a: fx.GraphModule
    part_b: fx.GraphModule
    input_grads: list[int]      # captured output positions returned first by part A
    params: list[str]           # parameter order of norms' rows and part B's outputs
    # part B's operands, in order: ("out", k) part A's output k, or ("in", name) part A's input
    operands: list[tuple[str, Any]]
    num_sizes: int              # part B's batch-size inputs (0 or 1), after the operands
    # part A's placeholders, in order: the captured graph's own (names)
    a_inputs: list[str]
    grads: list[ParamGrad]
    layouts: list               # part A's outputs' batch layouts
    rows: list[int]             # parameter j's row of norms


# Note [One norm row per clipping group]
# The model's graph adds every block call's norm rows into its clip factors' norms. With a row
# per parameter, twelve GPT-2 layers put 144 selects and adds into the model's backward, lowered
# and compiled as C++ at every compile (a third of that graph's C++). Part A therefore sums the
# squares of the parameters that share a clipping group into one row: ``rows[j]`` is parameter
# j's row, numbered by first appearance; which parameters share a group is part of the block's
# signature (blocks.py), so two instances share compiled graphs only if their parameters are
# grouped alike. The model's graph takes a row once for all the parameters that share it
# (``Ghost.norm_shared``), and its verifier checks that parameter j's row, ``rows[j]``, is in
# the norm of the factor that scales j's clipped sum; ``verify_block`` checks j's clipped sum
# against j's own squared norm (a row alone would let one parameter's gradient be released in
# another's slot of the same group: released twice) and that norm against j's row.
def norm_rows(groups: list[str] | None, count: int) -> list[int]:
    """Each parameter's norm row: its group's index by first appearance (one row each when
    ``groups`` is None)."""
    if groups is None:
        return list(range(count))
    index: dict[str, int] = {}
    return [index.setdefault(g, len(index)) for g in groups]


def block_backward(gm: fx.GraphModule, fw, param_outputs: dict[int, str],
                   tangent_outputs: dict[str, int], params: list[str], config: DPConfig,
                   fake_mode: Any, rows: list[int] | None = None) -> BlockBackward:
    """``params``: the block's trainable parameter names in the order the op passes them;
    ``rows``: each one's norm row (default: a row each)."""
    output = gm.graph.find_nodes(op="output")[0]
    outs = list(output.args[0])
    seeds = dict(fw.layouts)
    for ph, out_idx in tangent_outputs.items():
        seeds[ph] = fw.output_layouts[out_idx] if out_idx < len(fw.output_layouts) else None
    an = BatchAnalysis(gm.graph, fw.batch_symbols, seeds,
                       data_sources={n for n in gm.graph.find_nodes(op="placeholder")
                                     if n.name in tangent_outputs})
    if stack_over_time(gm.graph, an, fake_mode, [outs[i] for i in param_outputs]):
        outs = list(output.args[0])
        an = an.rerun(gm.graph)
    emit = Emitter(gm.graph, fake_mode, an, before=output)
    by_name = {name: i for i, name in param_outputs.items()}
    missing = [p for p in params if p not in by_name]
    if missing:
        raise PrivacyError(f"the block's backward graph gives no gradient for {missing}")
    grads = [ParamGrad(name, by_name[name], outs[by_name[name]]) for name in params]
    rewrite_per_sample(RewriteContext(an, emit, config.strategy), grads)

    # the coefficient and mask inputs, one pair per parameter, after the captured inputs
    placeholders = gm.graph.find_nodes(op="placeholder")
    batch = _batch_size_val(placeholders, an)
    cuts = []
    with gm.graph.inserting_after(placeholders[-1]):
        for j in reversed(range(len(params))):
            keep = gm.graph.placeholder(f"block_keep_{j}")
            coef = gm.graph.placeholder(f"block_coef_{j}")
            with fake_mode:
                coef.meta["val"] = torch.empty(batch, dtype=torch.float32)
                keep.meta["val"] = torch.empty(batch, dtype=torch.bool)
            cuts.append((coef, keep))
    cuts.reverse()
    an = an.rerun(gm.graph)
    emit.analysis = an

    rows = list(range(len(params))) if rows is None else list(rows)
    if len(rows) != len(params) or sorted(set(rows)) != list(range(len(set(rows)))):
        raise PrivacyError(f"a block's norm rows {rows} do not number its {len(params)} "
                           f"parameters' groups from 0")
    sums: dict[int, fx.Node] = {}
    own = []        # each parameter's own squares, what verify_block checks its sum against
    for pg, r in zip(grads, rows):
        sq = squared_norm(pg, emit)
        if sq.meta["val"].dtype != torch.float32:
            sq = emit(torch.ops.prims.convert_element_type.default, sq, torch.float32)
        own.append(sq)
        sums[r] = emit(aten.add.Tensor, sums[r], sq) if r in sums else sq
    squares = [emit(aten.unsqueeze.default, sums[r], 0) for r in range(len(sums))]
    norms = emit(aten.cat.default, squares, tag="block_norms") if len(squares) > 1 \
        else squares[0]
    clipped = [clipped_sum(pg, Clip(coef, keep), emit) for pg, (coef, keep) in zip(grads, cuts)]
    input_grads = [i for i, o in enumerate(outs) if i not in param_outputs and o is not None]
    output.args = (tuple([outs[i] for i in input_grads] + [norms] + clipped),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    verify_block(gm, an, clipped, cuts, own, [squares[r] for r in rows])

    part_a, part_b, operands, num_sizes, layouts = _split(
        gm, {n for pair in cuts for n in pair}, len(input_grads) + 1, an)
    return BlockBackward(part_a, part_b, input_grads, list(params), operands, num_sizes,
                         [n.name for n in placeholders], grads, layouts, rows)


def _batch_size_val(placeholders, an: BatchAnalysis):
    for ph in placeholders:
        lay = an.layout(ph)
        if isinstance(lay, BatchDim) and lay.is_plain:
            return ph.meta["val"].shape[lay.dim]
    raise PrivacyError("the block's backward graph has no input with a batch dim")


def _split(gm: fx.GraphModule, cuts: set[fx.Node], num_a_outputs: int, an: BatchAnalysis
           ) -> tuple[fx.GraphModule, fx.GraphModule, list, int, list]:
    """Part A: every node that does not depend on ``cuts``, returning the first
    ``num_a_outputs`` outputs and what part B reads of it. Part B: the rest."""
    graph = gm.graph
    output = graph.find_nodes(op="output")[0]
    outs = list(output.args[0])
    in_b = set()
    for node in graph.nodes:
        if node in cuts or any(a in in_b for a in node.all_input_nodes):
            if node.op != "output":
                in_b.add(node)
    for o in outs[:num_a_outputs]:
        if o in in_b:
            raise PrivacyError("a block's input gradient or norm depends on its clip coefficient")
    # nodes computed from no input (a zero for a select): part B computes its own
    constant = set()
    for node in graph.nodes:
        if node.op == "call_function" and all(a in constant for a in node.all_input_nodes):
            constant.add(node)
    constant -= in_b
    operands, sizes = [], []    # tensors part A returns; the batch size (B reads it itself)
    for node in graph.nodes:
        if node in in_b or node in constant or node.op == "output" \
                or not any(u in in_b for u in node.users):
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            operands.append(node)
        elif isinstance(val, torch.SymInt) and an.size(val).free_symbols <= {an.batch}:
            sizes.append(node)
        else:
            raise PrivacyError(f"part B of a block reads {node.name} ({val!r}), which is "
                               f"neither a tensor nor the batch size")

    a = fx.Graph()
    env = {}
    for node in graph.nodes:
        if node in in_b or node.op == "output":
            continue
        env[node] = a.node_copy(node, lambda n: env[n])
    # part B's operands: part A's own inputs are read from the op's inputs, not returned (an
    # op's output may not alias its input)
    returned = [o for o in operands if o.op != "placeholder"]
    a.output(tuple([env[o] for o in outs[:num_a_outputs]] + [env[o] for o in returned]))
    layouts = [an.layout(o) for o in outs[:num_a_outputs] + returned]
    sources = [("in", o.name) if o.op == "placeholder"
               else ("out", num_a_outputs + returned.index(o)) for o in operands]

    b = fx.Graph()
    env_b = {}
    for i, node in enumerate(operands):
        ph = b.placeholder(f"operand_{i}")
        ph.meta.update(node.meta)
        env_b[node] = ph
    if sizes:   # sizes part B reads, recomputed there from the batch size
        batch_ph = b.placeholder("batch_size")
        batch_ph.meta["val"] = next(s.meta["val"] for s in sizes
                                    if an.size(s.meta["val"]) == an.batch) \
            if any(an.size(s.meta["val"]) == an.batch for s in sizes) else None
        for node in sizes:
            env_b[node] = _size_node(b, an.size(node.meta["val"]), an.batch, batch_ph)
    for node in graph.nodes:
        if node in cuts:
            env_b[node] = b.node_copy(node, lambda n: env_b[n])
    for node in graph.nodes:
        if node in constant or node in in_b and node not in cuts:
            env_b[node] = b.node_copy(node, lambda n: env_b[n])
    b.output(tuple(env_b[o] for o in outs[num_a_outputs:]))
    b.eliminate_dead_code()
    return fx.GraphModule(gm, a), fx.GraphModule(gm, b), sources, int(bool(sizes)), layouts


def _size_node(graph: fx.Graph, expr, batch, batch_ph: fx.Node):
    """``expr``, a polynomial in the batch size with integer coefficients, as nodes."""
    import operator

    import sympy

    if expr == batch:
        return batch_ph
    if expr.is_Integer:
        return int(expr)
    if isinstance(expr, sympy.Mul):
        parts = [_size_node(graph, a, batch, batch_ph) for a in expr.args]
        op = operator.mul
    elif isinstance(expr, sympy.Add):
        parts = [_size_node(graph, a, batch, batch_ph) for a in expr.args]
        op = operator.add
    elif isinstance(expr, sympy.Pow) and expr.exp.is_Integer and expr.exp > 0:
        parts = [_size_node(graph, expr.base, batch, batch_ph)] * int(expr.exp)
        op = operator.mul
    else:
        raise PrivacyError(f"part B of a block needs the size {expr}, which dpfx cannot "
                           f"compute from the batch size")
    out = parts[0]
    for p in parts[1:]:
        out = graph.call_function(op, (out, p))
    return out
