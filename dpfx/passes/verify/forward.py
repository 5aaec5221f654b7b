"""Invariant 1, the forward proof: no forward op mixes examples.

    check_forward(gm, an)       # PrivacyError naming each op, its module and the fix

Example i's loss may depend on example i only; otherwise clipping g_i bounds nothing. Flagged:
any op whose inputs carry the batch dim and whose output does not (a reduction over examples:
BatchNorm's batch statistics, ``x.mean(0)``, a loss computed inside the model), any op with a
``dim`` argument that names the batch dim (softmax, cumsum, sort over examples), any tensor
whose batch layout cannot be proven, and an index into the batch dim by anything but each row's
own index (``passes/indexing.py``). ``mixing_ops`` is the rule itself, which the backward proof
reruns on the rewritten graph and the loss check (loss/check.py) on the replayed loss.
"""
from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx

from dpfx.errors import PrivacyError
from dpfx.graph.batch import Ambiguous, BatchAnalysis, BatchDim, declared_layouts, nonnegative
from dpfx.graph.rng_wrappers import rng_state
from dpfx.passes.indexing import index_problem

aten = torch.ops.aten

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
    declared = declared_layouts(node.args[0])
    return declared is not None and declared[node.args[1]] is None


def mixing_ops(gm: fx.GraphModule, an: BatchAnalysis, skip: set[str]) -> list[tuple]:
    """(node, reason) for every op that combines examples, except nodes tagged in ``skip``."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta.get("dpfx") in skip or node in an.draws:
            continue     # Note [A random draw holds no example] in graph/batch.py
        # the op, not its wrapper (Note [An op run under a saved RNG state] in
        # graph/rng_wrappers.py)
        if (wrapped := an.wrapped.get(node)) is not None:
            if not isinstance(wrapped.target, torch._ops.OpOverload) or \
                    wrapped.meta.get("val") is None:
                if any(an.is_batched(a) for a in wrapped.all_input_nodes):
                    found.append((node, f"runs {wrapped.target} under a saved RNG state, and "
                                        f"dpfx cannot read that op's outputs"))
                continue
            node = wrapped
        batched_in = [a for a in node.all_input_nodes if an.is_batched(a)]
        val = node.meta.get("val")
        if not batched_in or not isinstance(val, (torch.Tensor, tuple, list)):
            continue
        if not an.is_batched(node):
            if not attention_side_output(node) and not _batch_free_block_output(node) and \
                    not rng_state(node):
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
                                                nonnegative(an.size(end) - size)))


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
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
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
