"""The two proofs dpfx makes before it hands a graph to Inductor.

1. ``check_forward``: no forward op mixes examples. Example i's loss may depend on example i only;
   otherwise clipping g_i bounds nothing. Flagged: any op whose inputs carry the batch dim and whose
   output does not (a reduction over examples: BatchNorm's batch statistics, ``x.mean(0)``, a loss
   computed inside the model), any op with a ``dim`` argument that names the batch dim (softmax,
   cumsum, sort over examples), any tensor whose batch layout cannot be proven, and an index into
   the batch dim by anything but each row's own index (``passes/indexing.py``).

2. ``verify_backward``: every trainable parameter's gradient output is clipped and noised. With the
   backward graph as a networkx DiGraph, removing the ``clipped_sum`` nodes must disconnect every
   data source (the tangents and every saved activation that carries the batch) from every gradient
   output; each output must descend from a ``noise_scale`` node whose factor is sigma * C and
   whose input is a slice of a standard normal draw that no other parameter's slice overlaps,
   or (CPU) from the graph's one ``dpfx::add_noise_`` call, with std sigma * C, one noised sum
   per parameter or disjoint constant slices of one (stacked vector parameters) (with
   ``noise="optimizer"``: be the tagged clipped sum, with no noise in the graph); every clipped
   tensor must be one of the tensors its clip factor's per-sample norm is taken over; each clip
   factor must be ``where(isfinite(norm), min(1, C / (norm + eps)), 0)`` (automatic clipping:
   ``where(isfinite(norm), C / (norm + gamma), 0)``), eps or gamma exactly the configured one,
   with the C of the parameter's clipping group, and the coefficient that scales the per-sample gradients that
   factor itself ("sum") or the factor times B (a "mean" loss's 1/B undone); every floating-point operand of a clipped sum that depends on
   the data must be ``where(isfinite(norm), ., 0)`` of its factor's norm (an example with a
   non-finite gradient adds exactly zero, not 0 * NaN); each output is exactly
   (moves of its clipped sums + its noise_scale node) / D, or the add_noise_ call's noised
   clipped side with (multiplier, divisor) exactly 1/D, nothing reweighting one against the
   other (Note [The release is checked as a whole]); and, re-running the batch analysis on
   the rewritten graph, no op other than the clipped sums (and adaptive clipping's count) may
   combine examples. Under clipping="adaptive" C and the noise std read the graph's one bound
   input, and the count of unclipped examples has sensitivity 1/2 and its own noise (Note [The
   adaptive bound is proven as an input]). With ``batch_buckets`` every isfinite(norm) above is
   isfinite(norm) & (arange(B) < real_examples), and D and a mean's B are the one real_examples
   input (Note [Padded rows are proven out]). A violation is a ``PrivacyError`` naming the
   parameter.

See tests/passes/test_verifier.py, which hands the verifier broken graphs.
"""
from __future__ import annotations

import operator
import re

import networkx as nx
import sympy
import torch
import torch.fx as fx

import dpfx.ops  # noqa: F401  (registers the dpfx:: ops the graphs hold)
from dpfx.config import DPConfig
from dpfx.errors import PrivacyError
from dpfx.graph.batch import (Ambiguous, BatchAnalysis, BatchDim, _declared_layouts,
                             _nonnegative)
from dpfx.passes.indexing import index_problem

aten = torch.ops.aten
prims = torch.ops.prims

# Ops whose dim argument restructures a tensor without combining examples.
_DIM_OPS_THAT_KEEP_EXAMPLES_APART = {
    aten.permute.default,
    aten.transpose.int,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
}


def module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, kind = list(stack.values())[-1]
        kind_name = getattr(kind, "__name__", str(kind).rsplit(".", 1)[-1].strip("'>"))
        # Dynamo names the traced module by its local: L['self'], or L['model'] in dpfx's wrapper
        path = re.sub(r"^L\['\w+'\]\.?", "", path) or "<root>"
        return f"module '{path}' ({kind_name})"
    trace = node.meta.get("stack_trace", "")
    lines = [ln.strip() for ln in trace.strip().splitlines()
             if ln.strip() and not set(ln.strip()) <= set("^~ ")]
    return f"code `{lines[-1]}`" if lines else "the model's forward"


def _fix_for(node: fx.Node) -> str:
    where = module_of(node)
    if "BatchNorm" in where:
        return ("BatchNorm in training mode averages over the batch. Replace it with GroupNorm "
                "(dpfx.replace_batchnorm(model)), or put the module in eval mode.")
    return ("Make example i's output depend on example i only: compute the loss outside the "
            "dpfx-compiled module, and reduce over feature dims, never over dim 0.")


def _dim_args(node: fx.Node) -> list:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    found = []
    for i, arg in enumerate(schema.arguments):
        if arg.name not in ("dim", "dims"):
            continue
        if i < len(node.args):
            found.append(node.args[i])
        elif arg.name in node.kwargs:
            found.append(node.kwargs[arg.name])
        elif arg.has_default_value() and arg.default_value is not None:
            found.append(arg.default_value)   # unbind's dim=0, not "every dim"
        else:
            found.append("default")
    return found


def forward_problems(gm: fx.GraphModule, an: BatchAnalysis, skip: set = frozenset()
                     ) -> list[str]:
    return [f"op {node.target} in {module_of(node)} {reason}. {_fix_for(node)}"
            for node, reason in mixing_ops(gm, an, skip=skip)]


def _batch_free_block_output(node: fx.Node) -> bool:
    """An output of a compiled block that the block's own analysis found batch-free (a buffer
    it saves for its backward): the block's forward check proved that nothing in it reduced
    over examples, so it holds no example's data."""
    if node.target is not operator.getitem or not isinstance(node.args[1], int):
        return False
    declared = _declared_layouts(node.args[0])
    return declared is not None and declared[node.args[1]] is None


def mixing_ops(gm: fx.GraphModule, an: BatchAnalysis, skip: set[str]) -> list[tuple]:
    """(node, reason) for every op that combines examples, except nodes tagged in ``skip``."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta.get("dpfx") in skip or node in an.draws:
            continue     # Note [A random draw holds no example] in graph/batch.py
        batched_in = [a for a in node.all_input_nodes if an.is_batched(a)]
        val = node.meta.get("val")
        if not batched_in or not isinstance(val, (torch.Tensor, tuple, list)):
            continue
        if not an.is_batched(node):
            if not attention_side_output(node) and not _batch_free_block_output(node):
                found.append((node, "reduces over the batch dim"))
            continue
        lay = an.layout(node)
        if isinstance(lay, Ambiguous):
            found.append((node, f"cannot be proven to keep examples apart ({lay.reason})"))
            continue
        if node.target in _ATTENTION and (why := _attention_across_batch(node, an)):
            found.append((node, why))
            continue
        if why := index_problem(node, an):
            found.append((node, why))
            continue
        if node.target in _DIM_OPS_THAT_KEEP_EXAMPLES_APART:
            continue
        src = an.layout(batched_in[0])
        if not isinstance(src, BatchDim) or batched_in[0] is not node.args[0]:
            continue
        if src.dim in _named_dims(node, batched_in[0].meta["val"].dim()) and \
                not _whole_range(node, an, src.dim):
            found.append((node, f"works along the batch dim {src.dim}"))
    return found


# Note [A slice over the whole batch dim]
# ``x[:, None]`` slices dim 0 from 0 to the end; dynamo drops the no-op slice from the forward, but
# its backward is ``slice_scatter(zeros, g, 0, 0, INT64_MAX)``, an op with a dim argument that
# names the batch dim. A slice or slice_scatter from 0, step 1, to at least the dim's size (for
# every value of the size symbols; or INT64_MAX, which ATen clamps) copies example i's entries to
# example i's: slice returns its input, slice_scatter returns src, overwriting the whole base.
# (nn.Embedding and nn.EmbeddingBag reading the same ids, tests/lower/test_inductor_sweep.py;
# tests/graph/test_merged_batch.py::test_partial_slice_over_the_batch_is_refused)
def _whole_range(node: fx.Node, an: BatchAnalysis, dim: int) -> bool:
    if node.target is aten.slice.Tensor:
        names, rest = ("dim", "start", "end", "step"), node.args[1:]
    elif node.target is aten.slice_scatter.default:
        names, rest = ("dim", "start", "end", "step"), node.args[2:]
    else:
        return False
    given = dict(zip(names, rest)) | {k: v for k, v in node.kwargs.items() if k in names}
    size = an.shape(node.args[0].meta["val"])[dim]
    end = given.get("end")
    end = end.meta.get("val") if isinstance(end, fx.Node) else end
    return given.get("dim", 0) % node.args[0].meta["val"].dim() == dim and \
        given.get("start") in (None, 0) and given.get("step", 1) == 1 and \
        (end is None or end == _TO_THE_END or (isinstance(end, (int, torch.SymInt)) and
                                                _nonnegative(an.size(end) - size)))


_TO_THE_END = 2 ** 63 - 1     # ATen clamps a slice's end to the dim's size


# Note [Ops that read across dims they do not name]
# The dim check above catches an op that works along the batch dim only where the op names its
# dims (``softmax(x, 0)``, ``sum(x, [0])``). Normalizations, convolutions and poolings read
# across dims fixed by their meaning instead: a LayerNorm across its last len(normalized_shape)
# dims, a GroupNorm and a convolution across everything but dim 0 (the rows), a pooling across its
# spatial dims. Their outputs keep the batch dim's size, so the batch analysis carries the
# batch's layout through them (Note [Multi-output ops inherit per output] in batch.py), and
# that is right only where the batch lies in the dims the op keeps apart: HF OPT's LayerNorm on
# hidden states flattened to (B*T, d) reads each of the B*T rows alone, so example b's rows stay
# example b's; a convolution whose spatial dim holds the batch (a (B, C) activation transposed
# to (1, C, B)) slides its kernel across examples and is refused here, even when it is frozen
# and no rule would look at it. (tests/graph/test_merged_batch.py::test_ops_across_the_batch_are_refused)
def _conv_dims(node: fx.Node, rank: int) -> set[int]:
    return set(range(1, rank))


def _layer_norm_dims(node: fx.Node, rank: int) -> set[int]:
    normalized = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape", [])
    return set(range(rank - len(normalized), rank))


def _layer_norm_backward_dims(node: fx.Node, rank: int) -> set[int]:
    normalized = node.args[2] if len(node.args) > 2 else node.kwargs.get("normalized_shape", [])
    return set(range(rank - len(normalized), rank))


def _last(k: int):
    """Pooling over the last k (spatial) dims."""
    return lambda node, rank: set(range(max(rank - k, 0), rank))


# Note [Attention kernels keep the leading dims apart]
# On a GPU, F.scaled_dot_product_attention stays one fused op in the ATen graph (efficient, flash
# or cuDNN attention; on the CPU it decomposes into matrix products and a softmax, which the
# checks above read op by op). Each kernel attends along the sequence dim (-2) of query, key and
# value and contracts the head dim (-1), and keeps every leading (batch, head) index apart: so it
# keeps examples apart exactly when every batched input holds the batch in one of the two leading
# dims of the kernels' (batch, heads, sequence, head dim) layout, which
# ``_attention_across_batch`` checks for all of them (query, key, value, an additive mask; in the
# backward also the output's gradient, the saved output and the log-sum-exp, (batch, heads,
# queries)). Besides the attention output and its log-sum-exp (per example, per head, per query),
# the kernels return the state of their dropout RNG, sequence offsets of packed (nested) inputs,
# their maximal lengths and an unused debug mask: integer book-keeping or empty tensors that carry
# no example's data and that the backward reads again. Their getitems are batch-free outputs of a
# batched op, which the check would otherwise read as a reduction over the batch
# (``attention_side_output``). (tests/graph/test_merged_batch.py::test_fused_attention_kernels;
# tests/lower/test_fused_attention.py runs HF GPT-2 through them on the CPU, tests/gpu/test_cuda.py on a GPU.)
_ATTENTION = {op.default for op in (
    getattr(aten, name, None) for name in (
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"))
    if op is not None}
_ATTENTION_SIDE_OUTPUTS = {"philox_seed", "philox_offset", "rng_state", "unused", "cum_seq_q",
                           "cum_seq_k", "max_q", "max_k", "debug_attn_mask"}


def attention_side_output(node: fx.Node) -> bool:
    parent = node.args[0] if node.target is operator.getitem and node.args else None
    if not isinstance(parent, fx.Node) or parent.target not in _ATTENTION \
            or not isinstance(node.args[1], int):
        return False
    returns = parent.target._schema.returns
    val = node.meta.get("val")
    empty = isinstance(val, torch.Tensor) and any(isinstance(s, int) and s == 0
                                                  for s in val.shape)
    return node.args[1] < len(returns) and \
        returns[node.args[1]].name in _ATTENTION_SIDE_OUTPUTS and \
        isinstance(val, torch.Tensor) and (not val.dtype.is_floating_point or empty)


def _attention_across_batch(node: fx.Node, an: BatchAnalysis) -> str | None:
    for a in node.all_input_nodes:
        lay, val = an.layout(a), a.meta.get("val")
        if isinstance(val, torch.Tensor) and an.is_batched(a) and (
                not isinstance(lay, BatchDim) or lay.dim >= 2):
            return f"attends across the batch ({a.name} holds it in dim " \
                   f"{getattr(lay, 'dim', '?')}, not in the batch or head dim)"
    return None


_READS_ACROSS = {
    **{op: _last(k) for k, ops in (
        (1, [aten.avg_pool1d.default, aten.adaptive_max_pool1d.default]),
        (2, [aten.avg_pool2d.default, aten.max_pool2d_with_indices.default,
             aten._adaptive_avg_pool2d.default, aten.adaptive_max_pool2d.default,
             aten.avg_pool2d_backward.default, aten.max_pool2d_with_indices_backward.default,
             aten._adaptive_avg_pool2d_backward.default]),
        (3, [aten.avg_pool3d.default, aten.max_pool3d_with_indices.default,
             aten._adaptive_avg_pool3d.default])) for op in ops},
    aten.take.default: lambda node, rank: set(range(rank)),   # reads the flattened tensor
    aten.convolution.default: _conv_dims,
    aten.convolution_backward.default: _conv_dims,
    aten.native_group_norm.default: _conv_dims,
    aten.native_group_norm_backward.default: _conv_dims,
    aten.native_layer_norm.default: _layer_norm_dims,
    aten.native_layer_norm_backward.default: _layer_norm_backward_dims,
}


def _named_dims(node: fx.Node, rank: int) -> set[int]:
    """The dims an op's ``dim``/``dims`` arguments name; an omitted or empty one means all. Ops
    that read across dims they do not name add those (Note [Ops that read across dims they do
    not name])."""
    named = set()
    if node.target in _READS_ACROSS:
        named |= _READS_ACROSS[node.target](node, rank)
    for dims in _dim_args(node):
        if dims == "default" or dims is None or dims == []:
            dims = list(range(rank))
        dims = [dims] if isinstance(dims, int) else list(dims)
        named |= {d % max(rank, 1) for d in dims if isinstance(d, int)}
    return named


def check_forward(gm: fx.GraphModule, an: BatchAnalysis, skip: set = frozenset()) -> None:
    problems = forward_problems(gm, an, skip)
    if problems:
        raise PrivacyError("the forward pass mixes examples, so per-example clipping would not "
                           "bound any example's influence:\n  - " + "\n  - ".join(problems))


def _as_nx(graph: fx.Graph) -> nx.DiGraph:
    g = nx.DiGraph()
    for node in graph.nodes:
        g.add_node(node)
        for a in node.all_input_nodes:
            g.add_edge(a, node)
    return g


def _tagged(graph: fx.Graph, tag: str) -> list[fx.Node]:
    return [n for n in graph.nodes if n.meta.get("dpfx") == tag]


def verify_backward(gm: fx.GraphModule, an: BatchAnalysis, grads: dict[str, fx.Node],
                    config: DPConfig) -> None:
    """Prove that each node in ``grads`` (parameter name -> gradient output) is private."""
    graph = gm.graph
    g = _as_nx(graph)
    sources = [n for n in graph.find_nodes(op="placeholder")
               if an.is_batched(n) or n.name.startswith("tangents")]
    clipped = _tagged(graph, "clipped_sum")
    leaked = _reached(g, sources, blocked=set(clipped))  # what the data reaches unclipped

    factors = _tagged(graph, "clip_factor")
    if not factors:
        raise PrivacyError("the backward graph has no clip factor node")
    adaptive = _adaptive_bound(graph) if config.adaptive else None
    real = _real_examples(graph) if config.batch_buckets is not None else None
    bound_of = {}      # clip factor -> its C (adaptive clipping: the input holding C_t)
    for factor in factors:
        bound_of[factor] = _check_clip_factor(factor, config, g, adaptive, an, real)
    covered = {f: _norm_sources(f) for f in factors}   # what each factor's norm is taken over
    dependent = _reached(g, sources)
    factor_of = {}
    block_rows = {}     # (dpfx::block_bwd call, parameter index) -> the clipped sum releasing it
    for c in clipped:
        if _is_block_clip(c):   # Note [A block's clipped sums] (rules/block.py, passes/block.py)
            factor_of[c], row = _check_block_clip(c, covered, bound_of, an, config, real)
            if row in block_rows:
                raise PrivacyError(f"{c.name} and {block_rows[row].name} both release parameter "
                                   f"{row[1]} of block call {row[0].name}")
            block_rows[row] = c
            continue
        apply = _clip_apply_of(c)
        ps, coef = apply.args
        base = _broadcast_source(coef)
        if base.meta.get("dpfx") == "clip_coef":
            _check_undoes_the_mean(base, an, config, real)
            base = base.args[0]
        if base not in bound_of:
            raise PrivacyError(f"{c.name} is not scaled by the clip factor")
        factor_of[c] = base
        if _through_moves(ps) not in covered[base]:
            raise PrivacyError(f"{ps.name} enters the clipped sum {c.name} but is not part of "
                               f"the per-sample norm it is clipped by")
        for x in c.all_input_nodes:
            if x not in dependent or not _floating(x):
                continue    # indices and masks cannot be NaN
            value = _finite_masked(x, base.args[0], c)
            if value is not apply and value not in covered[base]:
                raise PrivacyError(f"{value.name} enters the clipped sum {c.name} but is not "
                                   f"part of the per-sample norm it is clipped by")

    deferred = config.noise == "optimizer"
    if deferred and _tagged(graph, "noise"):
        raise PrivacyError("noise='optimizer' graphs must leave the noise to dpfx.DPOptimizer")
    noise_slices = []
    calls = [n for n in graph.nodes if _is_add_noise(n)]
    if len(calls) > 1:  # one key a step; Note [Noise added in place] (ops/noise.py)
        raise PrivacyError(f"the backward graph calls dpfx::add_noise_ {len(calls)} times, not "
                           f"once: two calls could draw the same noise")
    slots = {}          # (add_noise_ call, getitem index) -> [(start, end, parameter)]
    reached = {}        # a released sum's getitem -> what it is computed from
    noise_scales = _tagged(graph, "noise_scale")
    for name, out in grads.items():
        if out in leaked:
            cut = g.copy()
            cut.remove_nodes_from(clipped)
            path = _leak_path(cut, sources, out)
            raise PrivacyError(
                f"the gradient of parameter '{name}' has a path from the data that bypasses "
                f"per-sample clipping: {' -> '.join(n.name for n in path)}")
        ancestors = _release_ancestors(g, out, reached)
        mine = [c for c in clipped if c in ancestors]
        if not mine:
            raise PrivacyError(f"the gradient of parameter '{name}' does not depend on the clip "
                               f"factor")
        bound = config.clip_bounds[config.group_of(name)] if adaptive is None else adaptive
        for c in mine:
            if bound_of[factor_of[c]] != bound:
                raise PrivacyError(f"the gradient of parameter '{name}' is clipped to "
                                   f"{bound_of[factor_of[c]]}, but its group's bound is {bound}")
        if deferred:
            if out.meta.get("dpfx_output") != "clipped_grad":
                raise PrivacyError(f"the gradient output of parameter '{name}' is not the tagged "
                                   f"clipped sum that dpfx.DPOptimizer noises")
            continue
        scales = [n for n in noise_scales if n in ancestors]
        if not scales and not any(c in ancestors for c in calls):
            raise PrivacyError(f"no noise is added to the gradient of parameter '{name}'")
        for s in scales:
            noise_src, std = s.args
            if adaptive is not None:
                _check_adaptive_std(name, std, adaptive, config)
            elif std != config.noise_std:
                raise PrivacyError(f"the noise of parameter '{name}' is not N(0, (sigma*C)^2): "
                                   f"scale {std}, expected {config.noise_std}")
            noise_slices.append((name, _noise_slice(name, noise_src)))
        slot = _check_release(name, out, an, config, real)
        if slot is not None:
            call, index, start, end = slot
            slots.setdefault((call, index), []).append((start, end, name))
    for (call, index), spans in slots.items():
        spans.sort(key=lambda s: s[:2])
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise PrivacyError(f"parameters '{first}' and '{second}' share the noise of sum "
                                   f"{index - 1} of {call.name}")
    if adaptive is not None:
        slice_ = _check_count(graph, adaptive, config, an, real)
        if slice_ is not None:
            noise_slices.append(("<the count of unclipped examples>", slice_))
    _check_disjoint(noise_slices)
    _check_no_other_batch_mixing(gm, an)


# Note [The adaptive bound is proven as an input]
# Under clipping="adaptive" (Note [Adaptive clipping] in privacy/adaptive.py) C_t is no constant
# of the graph: it is the graph's last input, tagged "clip_bound", which the backend fills with
# the step's bound. The proof is the flat one with that input in place of the constant: every
# clip factor is where(isfinite(norm), min(1, C_t / (norm + eps)), 0) of that very input, so an
# example's contribution has norm at most C_t whatever the norms and whatever C_t is; every
# noise_scale multiplies its standard normals by mul(C_t, sigma_grad), the same input times the
# configured sigma_grad; and the graph's last output releases the count of unclipped examples
# as sum_i (float(b_i) - 1/2) for a per-example bool b_i (each term +-1/2: sensitivity 1/2), plus
# sigma_b times one more entry of the step's draw, shared with no parameter (noise="optimizer":
# the raw count, noised by DPOptimizer). A factor or a noise that reads any other tensor, a
# second bound input, or a bound that is not the last input (the backend appends C_t last) is
# refused. (tests/passes/test_adaptive_clipping.py)
def _adaptive_bound(graph: fx.Graph) -> fx.Node:
    placeholders = list(graph.find_nodes(op="placeholder"))
    bounds = [p for p in placeholders if p.meta.get("dpfx") == "clip_bound"]
    val = bounds[0].meta.get("val") if len(bounds) == 1 else None
    if len(bounds) != 1 or bounds[0] is not placeholders[-1] or \
            not isinstance(val, torch.Tensor) or val.dim() != 0 or val.dtype != torch.float32:
        raise PrivacyError("clipping='adaptive': the backward graph must read C_t from one 0-d "
                           "float32 input, its last, tagged clip_bound")
    return bounds[0]


def _check_adaptive_std(name: str, std, bound: fx.Node, config: DPConfig) -> None:
    if not (isinstance(std, fx.Node) and std.target is aten.mul.Tensor and not std.kwargs
            and len(std.args) == 2 and std.args[0] is bound
            and std.args[1] == config.grad_noise_multiplier):
        raise PrivacyError(f"the noise of parameter '{name}' is not N(0, (sigma_grad*C_t)^2) "
                           f"with C_t the graph's clip_bound input and sigma_grad = "
                           f"{config.grad_noise_multiplier}: its scale is {std}")


def _check_count(graph: fx.Graph, bound: fx.Node, config: DPConfig, an: BatchAnalysis,
                 real: fx.Node | None = None):
    """The graph's last output is the count of unclipped examples as Note [The adaptive bound
    is proven as an input] says; returns its noise slice (None for noise="optimizer")."""
    def refuse(why: str):
        raise PrivacyError(f"clipping='adaptive': the count of unclipped examples {why}")

    outs = graph.find_nodes(op="output")[0].args[0]
    out = outs[-1] if isinstance(outs, (tuple, list)) and outs else None
    counts = _tagged(graph, "unclipped_count")
    if not isinstance(out, fx.Node) or len(counts) != 1:
        refuse("is not the graph's last output, one tagged sum")
    count = counts[0]
    x = count.args[0] if count.target is aten.sum.dim_IntList and list(count.args[1:]) == [[0]] \
        and not count.kwargs else None
    if real is not None:    # a padded row's term is where(real_rows, ., 0): 0
        x = x.args[1] if isinstance(x, fx.Node) and x.target is aten.where.self and \
            _real_rows(x.args[0], an, real) and _is_zero(x.args[2]) else None
    ok = isinstance(x, fx.Node) and x.target is aten.sub.Tensor and x.args[1] == 0.5 \
        and not x.kwargs
    ones = x.args[0] if ok else None
    ok = ok and isinstance(ones, fx.Node) and \
        ones.target is prims.convert_element_type.default and ones.args[1] == torch.float32
    flags = ones.args[0] if ok else None
    val = flags.meta.get("val") if isinstance(flags, fx.Node) else None
    if not (ok and isinstance(val, torch.Tensor) and val.dtype == torch.bool and val.dim() == 1
            and an.size(val.shape[0]) == an.batch):
        refuse(f"{count.name} is not sum_i (float(b_i) - 1/2) of one bool b_i per example")
    if flags.target is not aten.logical_and.default or \
            flags.args[0].meta.get("dpfx") != "finite_examples" or \
            flags.args[1].target is not aten.le.Tensor or flags.args[1].args[1] is not bound \
            or flags.args[1].args[0] is not _norm_of_keep(flags.args[0], an, real):
        refuse(f"{flags.name} is not isfinite(norm) & (norm <= C_t) of the clip_bound input")
    if config.noise == "optimizer":
        if out is not count:
            refuse("is not the graph's last output, for dpfx.DPOptimizer to noise")
        return None
    scaled = out.args[1] if out.target is aten.add.Tensor and len(out.args) == 2 \
        and out.args[0] is count and not out.kwargs else None
    if not (isinstance(scaled, fx.Node) and scaled.meta.get("dpfx") == "count_noise_scale"
            and scaled.target is aten.mul.Tensor and len(scaled.args) == 2
            and scaled.args[1] == config.count_noise_multiplier):
        refuse(f"released as {out.name} is not count + N(0, sigma_b^2), sigma_b = "
               f"{config.count_noise_multiplier}")
    return _noise_slice("<the count of unclipped examples>", scaled.args[0])


def _release_ancestors(g: nx.DiGraph, out: fx.Node, memo: dict | None = None) -> set[fx.Node]:
    """What ``out`` is computed from. Through a dpfx::add_noise_ call, only the base that its
    getitem releases counts (the call reads every parameter's clipped sum, but sum k's new
    value depends on base k alone): otherwise each parameter would inherit every other one's
    clipped sums and, with per-layer clipping, their bounds. ``memo`` keeps what each such
    getitem reaches, the same for every output read from it (a stack's slices, Note [Vector
    parameters' per-sample gradients stacked] in clip_noise.py: each reaches every part)."""
    seen, todo = {out}, [out]
    while todo:
        node = todo.pop()
        if node.target is operator.getitem and _is_add_noise(node.args[0]) and \
                isinstance(node.args[1], int) and \
                1 <= node.args[1] <= len(node.args[0].kwargs.get("_all_bases", ())):
            if memo is not None and node is not out:
                if node not in memo:
                    memo[node] = frozenset(_release_ancestors(g, node))
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


# Note [The release is checked as a whole]
# The checks above pin each ingredient: the clip coefficient of every clipped sum, the scale of
# every noise slice. What joins them must not reweight one against the other: a clipped sum
# multiplied by 2 after the fact, or noise multiplied by 0.5 before it is added, would keep every
# ingredient right and still halve the noise-to-sensitivity ratio. So each gradient output must
# be, exactly, cast?(mul(add(moves(clipped sums), noise_scale), 1/D)), or cast?(mul(moves(c),
# 1/D)) with c a clipped sum that accumulates into (moves of) the noise_scale node (an
# embedding's index_put: Note [The clipped sum accumulates into the noise]): the noise_scale
# node added as it is, exactly one noise term, the clipped side reached from clipped_sum nodes
# through norm-preserving data movement and adds of such sides only (a tied weight's uses, each
# clipped sum once), one final scaling by 1/D (the configured expected batch size, or a division
# by the batch size symbol; none for a "sum" loss), and a dtype cast. The CPU form (Note [Noise
# added in place], ops/noise.py) is cast?(moves(getitem(add_noise_ call, k + 1))) with the
# call's std, multiplier and divisor pinned and its base k walked as the clipped side above.
# (tests/passes/test_verifier.py::test_release_reweighted_after_the_checks_is_rejected)
_RELEASE_MOVES = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.t.default, aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.clone.default, aten.alias.default,
    prims.convert_element_type.default,
}


def _check_release(name: str, out: fx.Node, an: BatchAnalysis, config: DPConfig,
                   real: fx.Node | None = None) -> tuple[fx.Node, int] | None:
    def refuse(why: str):
        raise PrivacyError(f"the gradient of parameter '{name}' is not (clipped sum + noise) / D "
                           f"as released: {why}")

    node = out
    if node.target is prims.convert_element_type.default:
        node = node.args[0]
    item = node     # the output itself may be a move (tagged private_grad)
    while item.target in _RELEASE_MOVES and item.meta.get("dpfx") in (None, "private_grad"):
        item = item.args[0]
    span = None     # Note [Vector parameters' per-sample gradients stacked] (clip_noise.py)
    if item.target is aten.slice.Tensor and item.meta.get("dpfx") in (None, "private_grad"):
        span, item = item, item.args[0]
    if item.target is operator.getitem and _is_add_noise(item.args[0]):
        if real is not None and config.loss_reduction == "mean" and \
                config.expected_batch_size is None:
            refuse(f"{item.name} is released by dpfx::add_noise_, whose divisor is a size: a "
                   f"padded batch's D is its real_examples input")
        return _check_release_in_place(name, item, an, config, refuse, span)
    if span is not None:
        refuse(f"{span.name} slices what is not a sum that dpfx::add_noise_ released")
    if config.loss_reduction == "mean":
        if config.expected_batch_size is not None:
            exact = node.target is aten.mul.Tensor and isinstance(node.args[1], float) and \
                node.args[1] == 1.0 / config.expected_batch_size
        else:
            divisor = node.args[1] if node.target is aten.div.Tensor else None
            exact = isinstance(divisor, fx.Node) and (divisor is real if real is not None else (
                isinstance(divisor.meta.get("val"), torch.SymInt) and
                an.size(divisor.meta["val"]) == an.batch))
        if not exact:
            refuse(f"{node.name} = {node.target} is not the division by D")
        node = node.args[0]
    if node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
        noise = [x for x in node.args
                 if isinstance(x, fx.Node) and x.meta.get("dpfx") == "noise_scale"]
        if len(noise) != 1:
            refuse(f"{node.name} does not add a noise_scale node as it is")
        stack = [node.args[1] if node.args[0] is noise[0] else node.args[0]]
    else:   # Note [The clipped sum accumulates into the noise] (passes/clip_noise.py)
        noise, stack = [], [node]
    _walk_clipped_side(stack, noise, refuse)
    if len(noise) != 1:
        refuse(f"{len(noise)} noise terms reach it, not one")


def _walk_clipped_side(stack: list, noise: list, refuse) -> None:
    """Walk the clipped side of a release down to its clipped sums: adds of such sides and
    norm-preserving moves only, each clipped sum once; a clipped sum accumulated into (moves of)
    a noise_scale node appends that node to ``noise``."""
    reached = set()
    while stack:
        x = stack.pop()
        if not isinstance(x, fx.Node):
            refuse(f"the constant {x!r} is added to the noise")
        if x.meta.get("dpfx") == "clipped_sum":
            if x in reached:
                refuse(f"the clipped sum {x.name} is added twice")
            reached.add(x)
            if x.target in _ACCUMULATES_INTO_ARG0 and _through_release_moves(x.args[0]).meta.get(
                    "dpfx") == "noise_scale":
                noise.append(x.args[0])
            continue
        if x.target is aten.add.Tensor and len(x.args) == 2 and not x.kwargs:
            stack.extend(x.args)
        elif x.target is operator.getitem and x.args[0].meta.get("dpfx") == "clipped_sum":
            stack.append(x.args[0])     # the weight output of a book-keeping convolution_backward
        elif x.target in _RELEASE_MOVES and x.meta.get("dpfx") is None:
            stack.append(x.args[0])
        else:
            refuse(f"{x.name} = {x.target} lies between the clipped sum and the noise")


def _is_add_noise(node) -> bool:
    return isinstance(node, fx.Node) and \
        node.target is torch.ops.higher_order.auto_functionalized_v2 and \
        node.args[:1] == (torch.ops.dpfx.add_noise_.default,)


def _check_release_in_place(name: str, item: fx.Node, an: BatchAnalysis, config: DPConfig,
                            refuse, span: fx.Node | None = None) -> tuple:
    """The release of Note [Noise added in place] (ops/noise.py): the output is cast?(moves(
    getitem(call, k + 1))) of an auto_functionalized_v2 of dpfx::add_noise_ whose std is sigma *
    C and whose (multiplier, divisor) is exactly 1/D, whose sum k is a whole base of its own (no
    view of one), and whose base k is a clipped side; or cast?(moves(``span``)), ``span`` a
    slice [start, end) of a 1-D getitem(call, k + 1), step 1, constant bounds (Note [Vector
    parameters' per-sample gradients stacked] in clip_noise.py). Returns (call, index, start,
    end): the entries of sum k this parameter takes, which no other parameter's may overlap."""
    call, index = item.args
    kwargs = call.kwargs
    bases = kwargs.get("_all_bases")
    n = kwargs.get("_sums_length")
    expected = {"std", "multiplier", "divisor", "_sums_length", "_all_bases",
                *(f"_sums_{k}_base_index" for k in range(n if isinstance(n, int) else 0))}
    if set(kwargs) != expected or not isinstance(bases, (list, tuple)) or len(bases) != n or \
            any(kwargs[f"_sums_{k}_base_index"] != k for k in range(n)) or \
            len(set(bases)) != n or len(call.args) != 1:
        refuse(f"{call.name} is not one dpfx::add_noise_ over {n} whole, distinct sums")
    if not isinstance(index, int) or not 1 <= index <= n:
        refuse(f"{item.name} is not one of {call.name}'s noised sums")
    if kwargs["std"] != config.noise_std:
        raise PrivacyError(f"the noise of parameter '{name}' is not N(0, (sigma*C)^2): scale "
                           f"{kwargs['std']}, expected {config.noise_std}")
    multiplier, divisor = kwargs["multiplier"], kwargs["divisor"]
    if config.loss_reduction == "mean" and config.expected_batch_size is not None:
        exact = multiplier == 1.0 / config.expected_batch_size and _is_one(divisor)
    elif config.loss_reduction == "mean":
        val = divisor.meta.get("val") if isinstance(divisor, fx.Node) else None
        exact = multiplier == 1.0 and isinstance(val, torch.SymInt) and \
            an.size(val) == an.batch
    else:
        exact = multiplier == 1.0 and _is_one(divisor)
    if not exact:
        refuse(f"{call.name} scales by {multiplier} / {divisor}, not by 1/D")
    noise = []
    _walk_clipped_side([bases[index - 1]], noise, refuse)
    if noise:
        refuse(f"its clipped sum accumulates into noise before {call.name} adds more")
    if span is None:
        return call, index, 0, float("inf")     # the whole sum
    length = item.meta["val"].shape[0] if item.meta["val"].dim() == 1 else None
    given = list(span.args[1:])
    dim, start, end, step = given + [0, None, None, 1][len(given):]
    if span.kwargs or not isinstance(length, int) or dim != 0 or step != 1 or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x for x in (start, end)):
        refuse(f"{span.name} is not a slice [start, end) of {item.name}, step 1, with constant "
               f"bounds")
    return call, index, min(start, length), min(end, length)


def _is_one(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x == 1


# Clipped-sum ops that add their values into their first argument: index_put(base, ...,
# accumulate=True) in its masked form. Their base may be the noise itself.
_ACCUMULATES_INTO_ARG0 = {aten._unsafe_masked_index_put_accumulate.default}


def _through_release_moves(node: fx.Node) -> fx.Node:
    while isinstance(node, fx.Node) and node.target in _RELEASE_MOVES and \
            node.meta.get("dpfx") is None:
        node = node.args[0]
    return node


# Sources of i.i.d. N(0, 1) entries that a "noise" node may be.
_STANDARD_NORMAL = {aten.randn.default, torch.ops.dpfx.standard_normal.default}


def _noise_slice(name: str, node: fx.Node) -> tuple[fx.Node, sympy.Expr, sympy.Expr]:
    """The (noise node, start, end) that ``node`` views: a contiguous run of one standard normal
    draw, reached through views and one step-1 slice of dim 0."""
    while node.target in (aten.view.default, aten.reshape.default):
        node = node.args[0]
    if node.target is not aten.slice.Tensor or tuple(node.args[1:2]) != (0,) or \
            (len(node.args) > 4 and node.args[4] != 1):
        raise PrivacyError(f"the noise of parameter '{name}' is not a contiguous slice of one "
                           f"standard normal draw (found {node.name} = {node.target})")
    source, start, end = node.args[0], _size_expr(node.args[2]), _size_expr(node.args[3])
    if source.meta.get("dpfx") != "noise" or source.target not in _STANDARD_NORMAL:
        raise PrivacyError(f"the noise of parameter '{name}' comes from {source.name} = "
                           f"{source.target}, not from a standard normal draw")
    return source, start, end


def _check_disjoint(slices: list) -> None:
    """Two parameters that shared noise entries would get correlated noise: along their
    difference there would be none at all. Integer bounds: sorted, each against the next;
    symbolic bounds (a parameter with a symbolic dim): against every other slice."""
    fixed = sorted((s for s in slices if s[1][1].is_Integer and s[1][2].is_Integer),
                   key=lambda s: (id(s[1][0]), int(s[1][1])))
    pairs = list(zip(fixed, fixed[1:]))
    symbolic = [s for s in slices if not (s[1][1].is_Integer and s[1][2].is_Integer)]
    pairs += [(a, b) for i, a in enumerate(symbolic) for b in symbolic[i + 1:] + fixed]
    for (a, (src_a, start_a, end_a)), (b, (src_b, start_b, end_b)) in pairs:
        if src_a is src_b and not _proven_le(end_a, start_b) and not _proven_le(end_b, start_a):
            raise PrivacyError(f"parameters '{a}' and '{b}' may share noise entries "
                               f"([{start_a}, {end_a}) and [{start_b}, {end_b}) of {src_a.name})")


def _proven_le(a: sympy.Expr, b: sympy.Expr) -> bool:
    if a.is_Integer and b.is_Integer:
        return a <= b
    return (sympy.simplify(a - b) <= 0) == sympy.true


def _size_expr(x) -> sympy.Expr:
    if isinstance(x, fx.Node):
        x = x.meta["val"]
    return x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(x)


def _check_no_other_batch_mixing(gm: fx.GraphModule, an: BatchAnalysis) -> None:
    """After the rewrite, the clipped sums are the only ops that may combine examples: a rule
    that read a batch-wide value (a count over the whole batch, say) would leak through it."""
    mixing = mixing_ops(gm, an.rerun(gm.graph), skip={"clipped_sum", "block_clip",
                                                       "unclipped_count"})
    if mixing:
        raise PrivacyError(
            "the rewritten backward graph combines examples outside the clipped sums:\n  - "
            + "\n  - ".join(f"{node.name} = {node.target}: {why}" for node, why in mixing))


_MOVES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.permute.default, aten.unsqueeze.default}


# Note [A block's clipped sums]
# A block called as one op (ops/blocks.py) returns parameter j's clipped sum as output j of
# ``dpfx::block_clip(key, coefs, keeps, operands)``. What happens inside was proven when the
# block was compiled (passes/block.verify_block): output j sums examples' terms each scaled by
# coefs[j] and selected by keeps[j], over operands that row rows[j] of the block's norms is taken
# over. Here the root graph proves the rest: coefs[j] is a clip coefficient of this graph (its
# factor's C is the parameter's group's), keeps[j] is that factor's finite mask, the operands
# are those of one ``dpfx::block_bwd`` call (the handle it returned for the operands it holds,
# then its inputs that are operands: ops/blocks.graph_operands), and row rows[j] of that call's
# norms (the row of j's clipping group) is part of the norm the factor is computed from.
def _is_block_clip(node: fx.Node) -> bool:
    return node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
        and node.args[0].target is torch.ops.dpfx.block_clip.default


def _check_block_clip(c: fx.Node, covered: dict, bound_of: dict, an: BatchAnalysis,
                      config: DPConfig, real: fx.Node | None = None
                      ) -> tuple[fx.Node, tuple[fx.Node, int]]:
    from dpfx.ops.blocks import graph_operands, kernels

    call, j = c.args
    key, coefs, keeps, operands = call.args
    k = kernels(key)
    base = _broadcast_source(coefs[j])
    if base.meta.get("dpfx") == "clip_coef":
        _check_undoes_the_mean(base, an, config, real)
        base = base.args[0]
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
    # parameter j's row, which passes/block.verify_block proved covers j's clipped sum
    rows = [n for n in covered[base] if n.target is aten.select.int
            and n.args[1:] == (0, k.rows[j]) and n.args[0].target is operator.getitem
            and n.args[0].args == (bwd, k.norms)]
    if not rows:
        raise PrivacyError(f"{c.name} (block {k.name}): norm row {k.rows[j]} of its block call "
                           f"(parameter {j}'s) is not part of the per-sample norm it is "
                           f"clipped by")
    return base, (bwd, j)


def _through_moves(node: fx.Node) -> fx.Node:
    while node.target in _MOVES and node.meta.get("dpfx") is None:
        node = node.args[0]
    return node


def _clip_apply_of(clipped: fx.Node) -> fx.Node:
    """The clip_apply node a clipped sum reduces, under its finiteness select: a direct input
    (materialize) or one reached through data movement (the book-keeping product's operand)."""
    applies = [_through_moves(x) for x in clipped.all_input_nodes]
    applies = [_through_moves(x.args[1]) if x.meta.get("dpfx") == "finite_mask" else x
               for x in applies]    # a missing select is reported by _finite_masked
    applies = [x for x in applies if x.meta.get("dpfx") == "clip_apply"]
    if len(applies) != 1:
        raise PrivacyError(f"clipped sum {clipped.name} does not reduce exactly one clip_apply node")
    return applies[0]


def _check_clip_factor(factor: fx.Node, config: DPConfig, g: nx.DiGraph,
                       adaptive: fx.Node | None = None, an: BatchAnalysis | None = None,
                       real: fx.Node | None = None) -> float | fx.Node:
    """``factor`` is where(isfinite(norm), min(1, C / (norm + eps)), 0), or for automatic
    clipping where(isfinite(norm), C / (norm + gamma), 0) (Note [Clip functions] in config.py),
    with ``norm`` the per-sample norms, isfinite written abs(norm) < inf, eps the configured
    constant added to that very norm, and C one of the configured bounds; returns C. Either form
    scales an example of norm n to n * factor <= C: the clamp bounds the first, gamma > 0 the
    second, and any other denominator (a norm scaled down, a constant of the wrong sign) could
    let an example past C. Under adaptive clipping C is the ``adaptive`` input itself (Note [The
    adaptive bound is proven as an input]); with batch buckets isfinite(norm) is isfinite(norm)
    & real_rows (Note [Padded rows are proven out])."""
    bounds = set(config.clip_bounds.values()) if adaptive is None else {adaptive}
    automatic = config.clipping == "automatic"
    ok = factor.target is aten.where.self and _is_zero(factor.args[2])
    keep, scale = factor.args[:2] if ok else (None, None)
    norm = _norm_of_keep(keep, an, real) if ok else None
    ok = norm is not None and norm.meta.get("dpfx") == "per_sample_norms"
    if automatic:
        ratio = scale if ok else None
    else:
        ok = ok and scale.target is aten.clamp_max.default and scale.args[1] == 1.0
        ratio = scale.args[0] if ok else None
    ok = ok and ratio.target is aten.mul.Tensor and any(ratio.args[1] is b or (
        adaptive is None and ratio.args[1] == b) for b in bounds)
    inverse = ratio.args[0] if ok else None
    ok = ok and isinstance(inverse, fx.Node) and inverse.target is aten.reciprocal.default
    denom = inverse.args[0] if ok else None
    ok = ok and isinstance(denom, fx.Node) and denom.target is aten.add.Tensor \
        and denom.args[0] is norm and denom.args[1] == config.clip_eps and not denom.kwargs
    if not ok:
        form = ("C / (norm + gamma)" if automatic else "min(1, C / (norm + eps))")
        keep_form = "isfinite(norm) & (arange(B) < real_examples)" if real is not None \
            else "isfinite(norm)"
        raise PrivacyError(f"the clip factor is not where({keep_form}, {form}, 0) of the "
                           f"per-sample norms with C in {sorted(map(str, bounds))} and "
                           f"{'gamma' if automatic else 'eps'} = {config.clip_eps}")
    return ratio.args[1]


# Note [Padded rows are proven out]
# With ``batch_buckets`` a batch of B examples runs padded to P rows (Note [Padded rows contribute
# zero] in clip_noise.py). The proof does not trust that the padded rows hold nothing: every
# finite-example mask ("finite_examples": the keep of every clip factor, of every select of a
# clipped sum's operands, of every block's clipped sums, and of adaptive clipping's count) must
# be logical_and(abs(norm) < inf, real_rows) with real_rows exactly lt(arange(0, P, 1),
# real_examples), P the batch size symbol and real_examples the graph's one input so tagged (a
# 0-d float32, which the backend fills with B). So row i >= B has clip factor 0 and each of its
# terms is selected to exactly 0, whatever its values. A mean loss's clip coefficient and the
# division by D must read that same input (the graph holds g_i / B: P would scale an example
# past C), so there the in-place add_noise_ release (whose divisor is a size) is refused.
# Adaptive clipping's count must be sum_i where(real_rows, float(b_i) - 1/2, 0). A graph whose
# masks have the plain form where buckets are configured is refused.
# (tests/test_buckets.py::test_a_mask_without_the_real_rows_is_refused)
def _real_examples(graph: fx.Graph) -> fx.Node:
    found = [p for p in graph.find_nodes(op="placeholder")
             if p.meta.get("dpfx") == "real_examples"]
    val = found[0].meta.get("val") if len(found) == 1 else None
    if not (isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype == torch.float32):
        raise PrivacyError("batch_buckets: the backward graph must read the count of real "
                           "examples from one 0-d float32 input tagged real_examples")
    return found[0]


def _real_rows(node, an: BatchAnalysis | None, real: fx.Node) -> bool:
    """``node`` is lt(arange(0, P, 1), real_examples), P the batch size symbol."""
    if not (isinstance(node, fx.Node) and node.target is aten.lt.Tensor and len(node.args) == 2
            and node.args[1] is real and not node.kwargs):
        return False
    rows = node.args[0]
    if not (isinstance(rows, fx.Node) and rows.target is aten.arange.start_step
            and len(rows.args) == 3 and rows.args[0] == 0 and rows.args[2] == 1):
        return False
    end = rows.args[1].meta.get("val") if isinstance(rows.args[1], fx.Node) else None
    return isinstance(end, torch.SymInt) and an is not None and an.size(end) == an.batch


def _norm_of_keep(keep, an: BatchAnalysis | None, real: fx.Node | None) -> fx.Node | None:
    """The per-sample norm of a finite-example mask: keep = abs(norm) < inf, or with batch
    buckets logical_and(abs(norm) < inf, real_rows); None for any other form."""
    if not isinstance(keep, fx.Node) or keep.meta.get("dpfx") != "finite_examples":
        return None
    finite = keep
    if real is not None:
        if not (keep.target is aten.logical_and.default and len(keep.args) == 2
                and _real_rows(keep.args[1], an, real)):
            return None
        finite = keep.args[0]
    if not (isinstance(finite, fx.Node) and finite.target is aten.lt.Scalar
            and finite.args[1] == float("inf") and isinstance(finite.args[0], fx.Node)
            and finite.args[0].target is aten.abs.default):
        return None
    return finite.args[0].args[0]


def _check_undoes_the_mean(coef: fx.Node, an: BatchAnalysis, config: DPConfig,
                           real: fx.Node | None = None) -> None:
    """A clip coefficient is the clip factor times B, undoing the 1/B that a mean loss puts on
    each example's gradient in the graph, and there is one only for loss_reduction="mean":
    any other multiplier would let an example's clipped contribution exceed C. With batch
    buckets B is the real_examples input (Note [Padded rows are proven out])."""
    size = coef.args[1] if coef.target is aten.mul.Tensor and len(coef.args) == 2 else None
    val = size.meta.get("val") if isinstance(size, fx.Node) else None
    if real is not None:
        ok = size is real
    else:
        ok = isinstance(val, torch.SymInt) and an.size(val) == an.batch
    if not (config.loss_reduction == "mean" and ok):
        raise PrivacyError(f"the clip coefficient {coef.name} is not the clip factor times the "
                           f"batch size of a mean loss: it would scale an example's clipped "
                           f"gradient past C")


def _floating(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.is_complex())


def _is_zero(x) -> bool:
    if isinstance(x, fx.Node):
        return x.target is aten.scalar_tensor.default and x.args[0] == 0
    return x == 0


# The ops that spread a [B] vector over an example's positions (Emitter.per_example).
_BROADCASTS = {aten.view.default, aten.reshape.default, aten.expand.default,
               aten.unsqueeze.default}


def _broadcast_source(node: fx.Node) -> fx.Node:
    while node.target in _BROADCASTS and node.meta.get("dpfx") is None:
        node = node.args[0]
    return node


def _finite_masked(x: fx.Node, keep: fx.Node, clipped: fx.Node) -> fx.Node:
    """The value that operand ``x`` of ``clipped`` selects: x must be (data movement of)
    where(keep, value, 0) with ``keep`` the clip factor's finite-example mask, so that an example
    with a non-finite norm adds exactly zero (Note [Non-finite examples contribute zero])."""
    mask = _through_moves(x)
    if mask.meta.get("dpfx") != "finite_mask" or mask.target is not aten.where.self or \
            _broadcast_source(mask.args[0]) is not keep or not _is_zero(mask.args[2]):
        raise PrivacyError(f"{x.name} enters the clipped sum {clipped.name} without the select "
                           f"where(isfinite(norm), ., 0) of its clip factor: an example with a "
                           f"non-finite gradient would make the release NaN")
    value = _through_moves(mask.args[1])
    while value.target is torch.ops.prims.convert_element_type.default and \
            _widens(value.args[0], value):   # a book-keeping operand cast up (exact)
        value = _through_moves(value.args[0])
    return value


def _widens(src: fx.Node, dst: fx.Node) -> bool:
    a, b = src.meta["val"].dtype, dst.meta["val"].dtype
    return torch.promote_types(a, b) == b


def _norm_sources(factor: fx.Node) -> set[fx.Node]:
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
    return seen | {_through_moves(x) for x in seen}   # clipped sums are compared the same way


def _reached(g: nx.DiGraph, sources: list, blocked: set = frozenset()) -> set[fx.Node]:
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


def _leak_path(cut: nx.DiGraph, sources, out) -> list[fx.Node]:
    for s in sources:
        if nx.has_path(cut, s, out):
            return nx.shortest_path(cut, s, out)
    return [out]
