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

from .batch import BatchAnalysis, BatchDim, sym_expr

aten = torch.ops.aten


def _val(x: Any) -> Any:
    return map_arg(x, lambda n: n.meta["val"])


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

    def __call__(self, op, *args, tag: str | None = None, **kwargs) -> fx.Node:
        if op is aten.permute.default and list(args[1]) == list(range(len(args[1]))):
            return args[0]
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(op, tuple(args), kwargs)
        with self.fake_mode:
            node.meta["val"] = op(*_val(args), **_val(kwargs))
        node.meta["dpfx_emitted"] = True   # the verifier tells dpfx's nodes from torch's
        if tag is not None:
            node.meta["dpfx"] = tag
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
    def batch_to_front(self, node: fx.Node, bd: BatchDim) -> fx.Node:
        """(..., outer*B*inner at bd.dim, ...) -> (B, ..., outer*inner at bd.dim + 1, ...)."""
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
        merged = [self.analysis.batch, *shape[:d], bd.outer * bd.inner, *shape[d + 1:]]
        return self(aten.reshape.default, moved, [self.size(s) for s in merged])

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
