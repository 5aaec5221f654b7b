"""Inserting ATen nodes into a graph with their fake values, so later passes and Inductor see shapes.

Example::

    emit = Emitter(gm.graph, fake_mode, before=output_node)
    b = emit.batch_size()                       # sym_size(x, 0), a SymInt node
    y = emit(aten.bmm.default, a, w)            # node with meta["val"] = fake result
"""
from __future__ import annotations

from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.node import map_arg

from dpfx.graph.batch import BatchAnalysis, BatchDim, sym_expr

aten = torch.ops.aten
prims = torch.ops.prims

# Data movement that keeps each example's entries, only rearranged (squared_norm's walk back):
# the moves the verifier looks through when it compares clipped tensors with a norm's sources
# (MOVES in passes/verify/patterns.py), no others.
_ENTRY_MOVES = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.unsqueeze.default,
}


def _val(x: Any) -> Any:
    return map_arg(x, lambda n: n.meta["val"])


# Note [Emitted nodes are shared]
# Rules emit their forms parameter by parameter, so a tensor that several parameters read is
# processed once per reader: Llama's q, k and v projections (and gate and up) read one normalized
# hidden state, and each ghost norm took its own Gram matrix of it and each clipped sum its own
# clip-scaled copy. Every node emitted is therefore looked up first by (op, arguments, tag): a
# pure ATen op on the same inputs is the same value, so the earlier node serves. Emitted nodes
# all go before one anchor in emission order, so the earlier node always precedes its new users.
# Random ops (the noise draw: tagged nondeterministic_seeded), mutating ops and anything outside
# aten/prims/Python's operator module are emitted anew every time: two noise draws must never
# become one. A node's tag is part of its key, so the verifier's tagged roles stay distinct.
# (tests/rules/test_linear.py::test_shared_input_is_processed_once)
# dpfx's own functional ops that the emitter may share (a block's part B, one call for all the
# block's parameters clipped by one factor: rules/block.py)
_PURE_DPFX_OPS = {torch.ops.dpfx.block_clip.default}


def _pure_key(op, args, kwargs, tag) -> tuple | None:
    if isinstance(op, torch._ops.OpOverload):
        if (op.namespace not in ("aten", "prims") and op not in _PURE_DPFX_OPS
                or op._schema.is_mutable
                or torch.Tag.nondeterministic_seeded in op.tags):
            return None
    elif getattr(op, "__module__", None) != "_operator":
        return None
    key = (op, _frozen(args), _frozen(kwargs), tag)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _frozen(x: Any) -> Any:
    """A hashable stand-in for an argument: lists as tuples, floats by their exact text (so that
    0.0 and -0.0 stay apart)."""
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(_frozen(a) for a in x))
    if isinstance(x, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in x.items()))
    if isinstance(x, (float, bool)):
        return (type(x).__name__, repr(x))
    return x


class Emitter:
    def __init__(self, graph: fx.Graph, fake_mode, analysis: BatchAnalysis, before: fx.Node):
        self.graph = graph
        self.fake_mode = fake_mode
        self.analysis = analysis
        self.before = before
        self._symbol_sources: dict[sympy.Symbol, tuple[fx.Node, int | None]] = {}
        for node in graph.find_nodes(op="placeholder"):
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt) and isinstance(sym_expr(val), sympy.Symbol):
                self._symbol_sources.setdefault(sym_expr(val), (node, None))
            elif isinstance(val, torch.Tensor):
                for d, s in enumerate(val.shape):
                    e = sym_expr(s)
                    if isinstance(e, sympy.Symbol):
                        self._symbol_sources.setdefault(e, (node, d))
        self._cache: dict[Any, fx.Node] = {}
        self._emitted: dict[tuple, fx.Node] = {}

    def __call__(self, op, *args, tag: str | None = None, fresh: bool = False,
                 **kwargs) -> fx.Node:
        """``fresh``: a new node even where an equal one exists (a copy that must be its own)."""
        if op is aten.permute.default and list(args[1]) == list(range(len(args[1]))):
            return args[0]
        # See Note [Emitted nodes are shared]
        key = None if fresh else _pure_key(op, args, kwargs, tag)
        if key is not None and key in self._emitted:
            return self._emitted[key]
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(op, tuple(args), kwargs)
        with self.fake_mode:
            node.meta["val"] = op(*_val(args), **_val(kwargs))
        node.meta["dpfx_emitted"] = True   # the verifier tells dpfx's nodes from torch's
        if tag is not None:
            node.meta["dpfx"] = tag
        if key is not None:
            self._emitted[key] = node
        return node

    # -- sizes -----------------------------------------------------------------------------------
    def symbol(self, sym: sympy.Symbol) -> fx.Node:
        if sym in self._cache:
            return self._cache[sym]
        if sym == self.analysis.batch:
            sources = [(n, d) for s, (n, d) in self._symbol_sources.items()
                       if s == sym or s in self.analysis._subs]
        else:
            sources = [self._symbol_sources[sym]] if sym in self._symbol_sources else []
        if not sources:
            raise RuntimeError(f"dpfx: no graph input carries the size symbol {sym}")
        node, dim = sources[0]
        self._cache[sym] = node if dim is None else self(aten.sym_size.int, node, dim)
        return self._cache[sym]

    def batch_size(self) -> fx.Node:
        return self.symbol(self.analysis.batch)

    def size(self, expr: sympy.Expr) -> Any:
        """An int, or a SymInt node computing ``expr`` from graph inputs."""
        expr = sympy.expand(sympy.sympify(expr))
        if expr.is_Integer:
            return int(expr)
        if isinstance(expr, sympy.Symbol):
            return self.symbol(expr)
        if isinstance(expr, (sympy.Mul, sympy.Add)):
            import operator
            combine = operator.mul if isinstance(expr, sympy.Mul) else operator.add
            parts = [self.size(a) for a in expr.args]
            out = parts[0]
            for p in parts[1:]:
                out = self(combine, out, p)
            return out
        raise RuntimeError(f"dpfx: cannot build the size expression {expr} in the graph")

    # -- layouts ---------------------------------------------------------------------------------
    # Note [One batch-major copy per operand]
    # A time-major operand (rows T*B, example i's rows strided B apart) reaches the front of the
    # batch only through view -> permute -> reshape, which no strides can express: Inductor keeps
    # it as a lazy index map and each consumer that needs memory realizes its own copy. A Gram
    # matrix reads its operand twice (X and X^T), so the LSTM's stacked gate gradient (B, 32, 512)
    # was copied twice, both copies live at the backward's peak. With ``copy=True`` the permuted
    # tensor is cloned to contiguous in the graph: one buffer, which the reshape and the
    # transpose then only view (tests/rules/test_linear.py::test_time_major_gram_operand_copied_once).
    def batch_to_front(self, node: fx.Node, bd: BatchDim, copy: bool = False) -> fx.Node:
        """(..., outer*B*inner at bd.dim, ...) -> (B, ..., outer*inner at bd.dim + 1, ...).

        ``copy``: where the batch is not the outer factor (a time-major ``T*B``), make the
        batch-major tensor one contiguous copy (Note [One batch-major copy per operand])."""
        shape = self.analysis.shape(node.meta["val"])
        d, rank = bd.dim, len(shape)
        if bd.is_plain:
            if d == 0:
                moved = node
            else:
                moved = self(aten.permute.default, node, [d] + [i for i in range(rank) if i != d])
            return self(aten.unsqueeze.default, moved, d + 1)
        split = [*shape[:d]] + ([bd.outer] if bd.outer != 1 else []) + [self.analysis.batch, bd.inner]
        split += shape[d + 1:]
        b_pos = d + (1 if bd.outer != 1 else 0)
        viewed = self(aten.view.default, node, [self.size(s) for s in split])
        perm = [b_pos] + [i for i in range(len(split)) if i != b_pos]
        moved = self(aten.permute.default, viewed, perm)
        if bd.outer == 1:
            return moved
        if copy:
            moved = self(aten.clone.default, moved, memory_format=torch.contiguous_format)
        merged = [self.analysis.batch, *shape[:d], bd.outer * bd.inner, *shape[d + 1:]]
        return self(aten.reshape.default, moved, [self.size(s) for s in merged])

    # Note [One squared norm per tensor]
    # A Linear layer's output gradient g enters two per-sample norms: the weight's ghost norm
    # ||a_i||^2 ||g_i||^2 and the bias's ||g_i||^2 (its per-sample gradient is g_i itself). Asked
    # separately, each is a reduction over the same (B, out) tensor that Inductor cannot merge
    # (one reads permute(g), the other a reshape of it). ``squared_norm`` therefore walks back from
    # the tensor it is asked about to the tensor its entries come from and computes, and caches,
    # each example's sum of squares of *that* tensor: the same number, since data movement only
    # rearranges an example's entries. Two kinds of step are taken: a captured node whose input
    # and output both have a proven batch layout (the batch analysis says where example i's
    # entries are on either side), and a node dpfx emitted on a tensor whose dim 0 is the example
    # (a per-sample form) that keeps dim 0 where and what it is (a view or reshape with dim 0 of
    # size B on both sides, a permute that fixes dim 0). The verifier accepts the result because
    # it compares clipped tensors with the norm's sources through the same data movement
    # (passes/verify/patterns.py, through_moves). Pinned by
    # tests/rules/test_linear.py::test_one_squared_norm_per_tensor.
    def squared_norm(self, node: fx.Node, bd: BatchDim, widen: bool = True) -> fx.Node:
        """[B]: each example's sum of squares of ``node``'s entries (batch layout ``bd``),
        computed once per source tensor and dtype: in float32 or wider, or, with ``widen=False``,
        in the entries' own dtype (a ghost norm's factors: an fp16 operand whose squares
        overflow drops its example, as its fp16 per-sample gradient would overflow)."""
        node, bd = self._entries_source(node, bd)
        own = node.meta["val"].dtype
        dtype = torch.promote_types(own, torch.float32) if widen else own
        key = ("squared_norm", node, bd, dtype)
        if key not in self._cache:
            front = self.batch_to_front(node, bd)
            if own != dtype:
                front = self(prims.convert_element_type.default, front, dtype)
            sq = self(aten.mul.Tensor, front, front)
            self._cache[key] = self(aten.sum.dim_IntList, sq, list(range(1, sq.meta["val"].dim())))
        return self._cache[key]

    def _entries_source(self, node: fx.Node, bd: BatchDim) -> tuple[fx.Node, BatchDim]:
        """The tensor (and its layout) whose entries, example by example, are ``node``'s."""
        an, front = self.analysis, BatchDim(0)
        while node.target in _ENTRY_MOVES and isinstance(node.args[0], fx.Node):
            src = node.args[0]
            if not node.meta.get("dpfx_emitted"):
                src_bd = an.layout(src)
                if an.layout(node) != bd or not isinstance(src_bd, BatchDim):
                    break
            elif bd == front and self._keeps_dim0(node, src):
                src_bd = front
                if not src.meta.get("dpfx_emitted") and an.layout(src) != front:
                    break
            else:
                break
            node, bd = src, src_bd
        return node, bd

    def _keeps_dim0(self, node: fx.Node, src: fx.Node) -> bool:
        """``node`` maps block i of ``src``'s dim 0 (of size B) to its own block i."""
        batch = self.analysis.batch
        sizes = [self.analysis.shape(n.meta["val"]) for n in (node, src)]
        if any(not s or s[0] != batch for s in sizes):
            return False
        return node.target is not aten.permute.default or list(node.args[1])[0] == 0

    def per_example(self, vec: fx.Node, bd: BatchDim, rank: int) -> fx.Node:
        """``vec`` ([B], one value per example) shaped to broadcast against a rank-``rank`` tensor
        whose dim ``bd.dim`` is the flattening ``outer*B*inner``: each example's value repeated
        over its own positions of that dim."""
        batch = self.analysis.batch
        if not bd.is_plain:
            spread = self(aten.view.default, vec, [1, self.batch_size(), 1])
            spread = self(aten.expand.default, spread,
                          [self.size(bd.outer), self.batch_size(), self.size(bd.inner)])
            vec = self(aten.reshape.default, spread, [self.size(bd.outer * batch * bd.inner)])
            batch = bd.outer * batch * bd.inner
        shape = [1] * rank
        shape[bd.dim] = self.size(batch)
        return self(aten.view.default, vec, shape)
