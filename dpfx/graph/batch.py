"""Batch-dim analysis: for every tensor of an ATen FX graph, which dim holds the examples.

Example, with B the batch symbol that dpfx marks on dim 0 of every user input:

    x       f32[B, 6, 8]      BatchDim(dim=0)
    view    f32[6*B, 8]       BatchDim(dim=0, outer=1, inner=6)   # view(x, [6*B, 8])
    permute f32[8, 6*B]       BatchDim(dim=1, outer=1, inner=6)

A dim of size ``outer * B * inner`` is a row-major flattening of (outer, B, inner): ``inner`` is
what was flattened *after* the batch (a sequence), ``outer`` what came before it. Whether a tensor
is batched at all is read off its symbolic shape (the batch symbol appears in a size), which is
exact; *where* in a flattened dim the batch sits is followed through the dataflow with sympy,
because ``(B, T) -> B*T`` and ``(T, B) -> T*B`` have the same size but opposite layouts.

``data_dependent`` holds every node computed from the examples: batched nodes, the extra
``data_sources`` (the backward's tangents, which carry the loss even when batch-free), and all
their descendants. ``draws`` holds the batched tensors computed from random draws and constants
alone (dropout's mask: Note [A random draw holds no example]).

Three answers per tensor: ``None`` (batch-free), a ``BatchDim``, or an ``Ambiguous`` (batched, but
the layout could not be proven). Rules refuse to fire on ``Ambiguous``; the forward check reports it.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import sympy
import torch
import torch.fx as fx

from dpfx.graph.rng_wrappers import WrappedOp, rng_wrapped, saves_state

aten = torch.ops.aten
prims = torch.ops.prims


@dataclasses.dataclass(frozen=True)
class BatchDim:
    dim: int
    outer: sympy.Expr = sympy.Integer(1)
    inner: sympy.Expr = sympy.Integer(1)
    # What the tensor's values are, when they are indices along its batch dim (Note [An arange
    # over the rows]): "row", each element's position along ``dim``; "unit", the example (or
    # user) that owns the element; None, anything else. Not part of the layout's identity.
    index_of: str | None = dataclasses.field(default=None, compare=False)
    # A random draw's layout (Note [A random draw holds no example]): it reads no example, so any
    # layout describes it. Carried so that a draw saved for the backward stays one there.
    drawn: bool = dataclasses.field(default=False, compare=False)

    @property
    def is_plain(self) -> bool:
        return self.outer == 1 and self.inner == 1

    def moved(self, dim: int) -> "BatchDim":
        return BatchDim(dim, self.outer, self.inner, self.index_of)


@dataclasses.dataclass(frozen=True)
class Ambiguous:
    reason: str


Layout = BatchDim | Ambiguous | None


def sym_expr(size: Any) -> sympy.Expr:
    if isinstance(size, torch.SymInt):
        return sympy.sympify(size.node.expr)
    if isinstance(size, torch.SymFloat):
        return _plain(sympy.sympify(size.node.expr))
    if isinstance(size, float):
        return sympy.nsimplify(size)
    return sympy.Integer(int(size))


def _plain(expr: sympy.Expr) -> sympy.Expr:
    """A float expression of sizes (``1.0 / len(y)``) in plain sympy arithmetic: torch's own
    functions for Python's division, conversion and powers replaced by sympy's."""
    from torch.utils._sympy import functions as F

    rules = {F.ToFloat: lambda a: a, F.FloatTrueDiv: lambda a, b: a / b,
             F.IntTrueDiv: lambda a, b: a / b, F.FloatPow: lambda a, b: a ** b,
             F.PowByNatural: lambda a, b: a ** b}
    for cls, rule in rules.items():
        expr = expr.replace(lambda e, c=cls: isinstance(e, c), lambda e, r=rule: r(*e.args))
    return expr


# Note [Size arithmetic is memoized]
# A graph asks the same few size questions over and over (every view of a (B, T, d) activation
# compares B*T with B*T), and sympy's simplify costs a millisecond each: it would be most of the
# batch analysis, which runs four times per compile (forward, backward, after stacking, in the
# proof). Sizes are polynomials in the size symbols almost always, where expand decides equality
# exactly; simplify remains for the rest (quotients, floor divisions). Answers are cached per
# expression.
@functools.lru_cache(maxsize=4096)
def _whole(expr: sympy.Expr) -> bool:
    """True if ``expr`` is a polynomial with integer coefficients (a valid size), not a fraction."""
    _, den = sympy.fraction(sympy.cancel(sympy.together(expr)))
    return den == 1


@functools.lru_cache(maxsize=4096)
def sizes_equal(a, b) -> bool:
    """Size expressions a == b: structurally (cheap, the common case), else exactly."""
    if a == b:
        return True
    diff = sympy.expand(a - b)
    if diff == 0:
        return True
    if diff.is_number or diff.is_polynomial():
        return False
    return sympy.simplify(diff) == 0


@functools.lru_cache(maxsize=4096)
def _simplify(expr: sympy.Expr) -> sympy.Expr:
    return sympy.simplify(expr)


@functools.lru_cache(maxsize=4096)
def nonnegative(expr: sympy.Expr) -> bool:
    """``expr >= 0`` proven for every value of its size symbols (non-negative integers)."""
    subs = {s: sympy.Dummy(s.name, integer=True, nonnegative=True) for s in expr.free_symbols}
    return sympy.expand(expr.subs(subs)).is_nonnegative is True


def _same_layout(a: Layout, b: BatchDim) -> bool:
    return isinstance(a, BatchDim) and a.dim == b.dim and sizes_equal(a.outer, b.outer) and \
        sizes_equal(a.inner, b.inner)


def product(exprs) -> sympy.Expr:
    out = sympy.Integer(1)
    for e in exprs:
        out = out * e
    return out


# Note [as_strided reads storage]
# ``as_strided(x, size, stride, offset)`` reads x's storage, not x's indices: output element k is
# storage position offset + sum_d k_d stride_d. Inductor's decompositions write restrides with it
# (a mean over a channels-last permute, the pooling of a ConvNeXt block, gives
# ``as_strided(mean, [B, C, 1, 1], [C, 1, C, C])``), and autograd's backward of one scatters the
# gradient into a zero buffer of the storage's ``C*B`` elements with ``as_strided_scatter`` and
# reads it back with another as_strided. The layout is proven, never inherited from the shape:
#   1. the storage read (or written) is a tensor laid out dense with the batch outermost: dim d,
#      of size B * inner, is its only batched dim, and its strides are the contiguous strides of
#      an order of its dims that ends with d, so example b's elements are exactly the positions
#      [b E, (b + 1) E) past its offset, E = inner * stride_d; x's proven layout must say the
#      same, BatchDim(d, 1, inner);
#   2. the view has one batched dim j, of size B * inner', with inner' * stride_j == E, and, with
#      every stride's sign proven, its positions for each example (dim j within the example,
#      every other dim in full, from the offset) lie in [0, E) for every value of the size
#      symbols (sympy): example b then reads, or writes, only block b, and the view's layout is
#      BatchDim(j, 1, inner');
#   3. ``as_strided_scatter(base, src, ...)`` is a copy of base with src written at the view's
#      positions: its output (with base's strides) is checked as in 1 and must be contiguous
#      (Inductor clones the base contiguous before scattering into it), src's layout is the view's
#      from 2, and base holds no example's data (a fill: full, zeros) or has the output's layout.
# Anything else is Ambiguous. The strides are the traced ones; Inductor lays out an as_strided
# input with exactly those whenever they hold no unbacked symbol (GraphLowering.run_node), and a
# batch-outermost tensor's strides never hold the batch. At B = 1 a tensor holds one example, so
# no view can mix examples whatever eager's strides for the size-1 dim.
# (tests/capture/test_model_families.py::test_linear_on_permuted_activation_then_pooling,
# tests/passes/test_verifier.py::test_as_strided_across_examples_is_refused and
# ::test_as_strided_scatter_across_examples_is_rejected)
_STRIDED = {aten.as_strided.default, aten.as_strided_scatter.default}


# Note [A random draw holds no example]
# Dropout draws its mask over the whole activation: ``inductor_random([k*U, d], seed, "rand")``
# (or ``rand_like``, ``bernoulli.p``) then ``gt(mask, p)``, multiplied into the activation. The
# draw reads sizes, a seed and its ``_like`` input's shape, never a value of the data, so it holds
# no example's data and every layout of its batch dim describes it; without one a merged dim
# (``per_user``'s k*U rows, a (B*T, d) view) is Ambiguous and the model is refused. A draw, and a
# pointwise op whose tensor inputs are draws or batch-free values computed from no data (``gt``,
# a cast), go in ``draws``: they take the batch-major layout (Note [A constant broadcast over k
# rows per example]) and cast no vote when a consumer inherits its layout (``_inherit``), so
# ``mul(mask, h)`` is laid out as h is; the forward check skips them (an op over draws alone reads
# no example). Their layout is marked ``drawn``, so a mask saved for the backward is a draw there
# too (its ``mul(g, mask)`` is laid out as g is). Whatever reads a draw together with data is
# analysed as before: ``sort`` or an index into the rows by a draw is not pointwise, gets no
# layout from the draw, and is refused where it works along the rows (``randint`` and
# ``randperm`` are not draws here: their values are indices).
# (tests/graph/test_random_draws.py)
_DRAWS = {aten.rand.default, aten.randn.default, aten.rand_like.default,
          aten.randn_like.default, aten.bernoulli.p, aten.uniform.default}
_SHAPE_ONLY = {aten.rand_like.default, aten.randn_like.default, aten.bernoulli.p,
               aten.uniform.default}     # read their first input's shape, not its values


def _is_draw_op(target) -> bool:
    if target in _DRAWS:
        return True
    inductor_random = getattr(prims, "inductor_random", None)   # Inductor's replace_random
    return inductor_random is not None and target is inductor_random.default


# Note [Multi-output ops inherit per output]
# A merged dim k*B is a batch layout like any other once a view proves it: HF OPT flattens its
# hidden states (B, T, d) -> (B*T, d) before the last LayerNorm, augmentation multiplicity flattens
# (B, K, C, H, W) -> (B*K, C, H, W) before a convolution and a GroupNorm. Single-output ops
# already inherit BatchDim(0, inner=T) from the input dim of the same size (``_inherit``); the
# ops that return tuples (native_layer_norm's (out, mean, rstd), native_group_norm, their
# backwards, convolution_backward, max_pool2d_with_indices) do the same for each output, rather
# than read the shape, which can only say "B" or "mixes the batch with other dims".
# Inheriting says where the rows are, not that the op keeps them apart: that is the forward
# check's (mixing_ops in passes/verify/forward.py), which refuses an op working along the
# batch's dim, whether the op names the dim or, like a LayerNorm, a GroupNorm, a convolution or
# a pooling, reads across dims fixed by its meaning (Note [Ops that read across dims they do
# not name]). The views that split the merged dim back must split it as it was merged
# (``_through_view``), and the per-sample rules sum each example's rows (Note [A convolution
# over K rows per example]).
# (tests/graph/test_merged_batch.py)


def declared_layouts(node: fx.Node) -> tuple | None:
    """The outputs' layouts of a compiled block's op, as the block's own analysis found them
    (a saved activation viewed (B*T, d) is batch-major there; read from its shape alone it
    would be ambiguous)."""
    from dpfx.ops import blocks

    if node.op != "call_function" or node.target not in (
            torch.ops.dpfx.block_fwd.default, torch.ops.dpfx.block_bwd.default):
        return None
    layouts = blocks.op_layouts(blocks.kernels(node.args[0]),
                                node.target is torch.ops.dpfx.block_fwd.default)
    return tuple(layouts) if layouts is not None else None


class BatchAnalysis:
    """Layouts of every node of ``graph``. ``seeds`` gives layouts of placeholders by name."""

    def __init__(self, graph: fx.Graph, batch_symbols: set[sympy.Symbol], seeds: dict[str, Layout],
                 data_sources: set[fx.Node] = frozenset()):
        if not batch_symbols:
            raise ValueError("batch analysis needs at least one batch symbol")
        self.batch_symbols = set(batch_symbols)
        self.data_sources = set(data_sources)
        self.batch = sorted(batch_symbols, key=str)[0]
        self._subs = {s: self.batch for s in batch_symbols if s != self.batch}
        self._sizes: dict[sympy.Expr, sympy.Expr] = {}   # size symbol expressions, substituted
        # id(val) -> (val, its sizes): Note [Shapes are read once]
        self._shapes: dict[int, tuple] = {}
        self._batched: dict[sympy.Expr, bool] = {}       # size expression -> has the batch
        self.layouts: dict[fx.Node, Any] = {}
        self.data_dependent: set[fx.Node] = set()
        self.draws: set[fx.Node] = set()    # Note [A random draw holds no example]
        # Note [An op run under a saved RNG state]: each wrapper's op, and the wrappers' values
        self.wrapped: dict[fx.Node, WrappedOp] = {}
        self.values: dict[fx.Node, Any] = {}
        for node in graph.nodes:
            self.layouts[node] = self._transfer(node, seeds)
            if node in data_sources or self._batched_val(self.value(node)) or any(
                a in self.data_dependent for a in node.all_input_nodes
            ):
                self.data_dependent.add(node)

    def rerun(self, graph: fx.Graph) -> "BatchAnalysis":
        """The analysis of ``graph`` (rewritten in place) from the same placeholder layouts."""
        seeds = {n.name: self.layouts.get(n) for n in graph.find_nodes(op="placeholder")}
        return BatchAnalysis(graph, self.batch_symbols, seeds, self.data_sources)

    # -- queries ---------------------------------------------------------------------------------
    # Note [Shapes are read once]
    # Every transfer function reads its output's shape and its inputs' as sympy expressions, so a
    # value read by many nodes would be converted once per reader (a recurrent model's analyses
    # convert each shape about fifteen times). A fake tensor's sizes do not change, so each
    # value's are converted once per analysis, keyed by the value itself (held, so that its id is
    # not reused); every call gets its own list. Whether a size expression holds the batch is
    # remembered likewise. That halves the batch analysis (BENCHMARKS.md, "Levers in the code").
    def shape(self, val: torch.Tensor) -> list[sympy.Expr]:
        hit = self._shapes.get(id(val))
        if hit is None or hit[0] is not val:
            hit = (val, tuple(self.size(s) for s in val.shape))
            self._shapes[id(val)] = hit
        return list(hit[1])

    def size(self, size) -> sympy.Expr:
        """A size (int or SymInt) as a sympy expression, the batch written as ``self.batch``
        (memoized: Note [Size arithmetic is memoized])."""
        if not isinstance(size, torch.SymInt):
            return sympy.Integer(int(size))
        expr = size.node.expr
        if expr not in self._sizes:
            self._sizes[expr] = sympy.sympify(expr).subs(self._subs) if self._subs else expr
        return self._sizes[expr]

    def pretty(self, expr) -> str:
        """``expr`` (or a list of them) with the batch symbol written as B, for reports."""
        if isinstance(expr, (list, tuple)):
            return "[" + ", ".join(self.pretty(e) for e in expr) + "]"
        return str(sympy.sympify(expr).subs(self.batch, sympy.Symbol("B")))

    def has_batch(self, expr: sympy.Expr) -> bool:
        expr = expr if isinstance(expr, sympy.Basic) else sympy.sympify(expr)
        known = self._batched.get(expr)
        if known is None:
            known = self._batched[expr] = self.batch in expr.free_symbols
        return known

    def _batched_val(self, val: Any) -> bool:
        if isinstance(val, torch.Tensor):
            return any(self.has_batch(s) for s in self.shape(val))
        if isinstance(val, (tuple, list)):
            return any(self._batched_val(v) for v in val)
        return False

    def value(self, node: fx.Node) -> Any:
        """The node's fake value; a wrapper's is its op's (Note [An op run under a saved RNG
        state])."""
        return self.values[node] if node in self.values else node.meta.get("val")

    def is_batched(self, node: Any) -> bool:
        return isinstance(node, (fx.Node, WrappedOp)) and self._batched_val(
            node.meta.get("val") if isinstance(node, WrappedOp) else self.value(node))

    def layout(self, node: fx.Node) -> Layout:
        return self.layouts.get(node)

    # -- transfer functions ----------------------------------------------------------------------
    def from_shape(self, val: torch.Tensor) -> Layout:
        dims = [d for d, s in enumerate(self.shape(val)) if self.has_batch(s)]
        if not dims:
            return None
        if len(dims) > 1:
            return Ambiguous(f"the batch size appears in dims {dims} of shape {self.shape(val)}")
        size = self.shape(val)[dims[0]]
        if sizes_equal(size, self.batch):
            return BatchDim(dims[0])
        return Ambiguous(f"dim {dims[0]} of size {size} mixes the batch with other dims")

    def _transfer(self, node: fx.Node, seeds: dict[str, Layout]) -> Any:
        wrapped = rng_wrapped(node)
        if wrapped is not None:
            return self._through_rng_wrapper(node, wrapped, seeds)
        val = node.meta.get("val")
        if node.target is operator.getitem and isinstance(val, (tuple, list)) and \
                isinstance(self.layouts.get(node.args[0]), tuple):
            return self.layouts[node.args[0]][node.args[1]]   # a wrapper's op's outputs
        if isinstance(val, (tuple, list)):
            if node.op == "placeholder":
                return None
            declared = declared_layouts(node)
            if declared is not None:
                return declared
            return tuple(   # Note [Multi-output ops inherit per output]
                self._inherit(node, v) if isinstance(v, torch.Tensor) else None for v in val
            )
        if not isinstance(val, torch.Tensor) or not self._batched_val(val):
            return None
        if node.op == "placeholder":
            seed = seeds.get(node.name, self.from_shape(val))
            if isinstance(seed, BatchDim) and seed.drawn:
                self.draws.add(node)
            return seed
        if self._draw(node):
            self.draws.add(node)
            lay = self._broadcast(val)
            return dataclasses.replace(lay, drawn=True) if lay else self.from_shape(val)
        if node.target is operator.getitem:
            parent = self.layouts.get(node.args[0])
            if isinstance(parent, tuple) and isinstance(node.args[1], int):
                lay = parent[node.args[1]]
                if isinstance(lay, BatchDim) and lay.drawn:
                    self.draws.add(node)      # a wrapped draw's output
                return lay
            return self.from_shape(val)
        if node.target is aten.cat.default:
            return self._through_cat(node, val)
        if node.target in _STRIDED:
            return self._through_as_strided(node, val)
        if node.target is prims.iota.default:
            return self._arange(node, val)
        src = node.args[0] if node.args else None
        src_layout = self.layouts.get(src) if isinstance(src, fx.Node) else None
        if isinstance(src_layout, BatchDim):
            moved = self._move(node, src, src_layout, val)
            if moved is not NotImplemented:
                return moved
        elif node.target is aten.expand.default and isinstance(src, fx.Node) \
                and not self.is_batched(src) and src not in self.data_dependent:
            broadcast = self._broadcast(val)
            if broadcast is not None:
                return broadcast
        return self._inherit(node, val)

    def _through_rng_wrapper(self, node: fx.Node, wrapped: WrappedOp, seeds) -> Any:
        """Note [An op run under a saved RNG state]: the op's layouts; before them the state's
        (None) where the wrapper returns it."""
        self.wrapped[node] = wrapped
        val = wrapped.meta.get("val")
        inner = self._transfer(wrapped, seeds) if val is not None else None
        self.layouts[wrapped] = inner
        if wrapped in self.draws:
            self.draws.discard(wrapped)
            if isinstance(inner, BatchDim):
                inner = dataclasses.replace(inner, drawn=True)
        if saves_state(node):
            self.values[node] = (None, val)
            return None, inner
        self.values[node] = val
        if isinstance(inner, BatchDim) and inner.drawn:
            self.draws.add(node)
        return inner

    # Note [A constant broadcast over k rows per example]
    # A batch-free tensor that holds no data expanded along a dim of size k*B (HF's multiple
    # choice: the default token_type_ids buffer expanded to the (B * choices) flattened rows)
    # has the same values in every row, so every layout of the merged dim describes it; without
    # one the dim is Ambiguous and the model is refused. It takes the batch-major one, (B, k)
    # flattened (BatchDim(d, 1, k)), which is how models flatten the rows it is combined with
    # (``input_ids.view(-1, T)`` of (B, choices, T)); a consumer laid out otherwise still finds
    # the two layouts in disagreement and refuses. A batch-free value computed from the data (a
    # batch statistic) is not a constant: it keeps the old reading, and the op that computed it
    # is refused by the forward check either way.
    # (tests/loss/test_hf_labels.py::test_multiple_choice_with_labels)
    def _broadcast(self, val: torch.Tensor) -> BatchDim | None:
        shape = self.shape(val)
        dims = [d for d, s in enumerate(shape) if self.has_batch(s)]
        if len(dims) != 1:
            return None
        k = _simplify(shape[dims[0]] / self.batch)
        if not _whole(k) or self.has_batch(k) or not k.is_Integer or int(k) < 1:
            return None
        return BatchDim(dims[0], sympy.Integer(1), k)

    def _draw(self, node: fx.Node) -> bool:
        """A random draw, or a pointwise op over draws and batch-free values computed from no
        data (Note [A random draw holds no example])."""
        if node.op != "call_function":
            return False
        ins = node.all_input_nodes
        if _is_draw_op(node.target):     # its sizes say only how many draws
            ins = [a for a in ins if isinstance(self.value(a), torch.Tensor) and not (
                node.target in _SHAPE_ONLY and a is node.args[0])]
        elif not (isinstance(node.target, torch._ops.OpOverload) and
                  torch.Tag.pointwise in node.target.tags and
                  any(a in self.draws for a in ins)):
            return False
        return all(a in self.draws or (not self.is_batched(a) and a not in self.data_dependent)
                   for a in ins)

    # Note [An arange over the rows]
    # HF builds its padding mask by indexing the mask's rows with ``arange(batch)[:, None, None,
    # None]``; under ``per_user`` the rows are a merged dim of k per user, and the arange is
    # ``prims.iota(k*U)``. An iota holds no data, so, like a constant broadcast over the rows
    # (Note [A constant broadcast over k rows per example]), any layout describes it; it takes the
    # batch-major one, BatchDim(0, 1, k), as the rows it indexes are laid out. What its values
    # say is tracked beside the layout (``BatchDim.index_of``): an iota from 0 by 1 holds at
    # every position its own row number ("row"); over a plain batch, k = 1, the row is the example
    # ("unit"). Moves keep the values where they keep each element's position along the batch
    # dim (unsqueeze, expand, permute, a view that keeps the dim's flattening, a cast between
    # integer dtypes); a view that re-flattens keeps "unit" only, since the layout it proves says
    # which unit owns each element; any arithmetic drops both. The forward check then accepts an
    # index into a batch dim only by such an index of the same layout (passes/indexing.py): row p
    # reads its own row, or its own unit's row of a tensor with one row per unit. An iota of
    # another start or step, or of a length that is not a constant multiple of B, has a layout
    # and no index values; one over a symbolic multiple is left to the shape (Ambiguous).
    # (tests/graph/test_arange_rows.py)
    def _arange(self, node: fx.Node, val: torch.Tensor) -> Layout:
        k = _simplify(self.shape(val)[0] / self.batch)
        if val.dim() != 1 or not _whole(k) or self.has_batch(k) or not k.is_Integer or int(k) < 1:
            return self.from_shape(val)
        counts = node.kwargs.get("start", 0) == 0 and node.kwargs.get("step", 1) == 1 and \
            not val.dtype.is_floating_point and val.dtype != torch.bool
        index_of = ("unit" if k == 1 else "row") if counts else None
        return BatchDim(0, sympy.Integer(1), k, index_of)

    def _move(self, node: fx.Node, src: fx.Node, bd: BatchDim, val: torch.Tensor) -> Any:
        """Layout through ops that move dims; NotImplemented for everything else."""
        t = node.target
        rank_in = self.value(src).dim()
        if t in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            return self._through_view(self.shape(self.value(src)), bd, self.shape(val))
        if t is aten.permute.default:
            dims = [d % rank_in for d in node.args[1]]
            return bd.moved(dims.index(bd.dim))
        if t is aten.t.default:
            return bd.moved(1 - bd.dim) if rank_in == 2 else bd
        if t is aten.transpose.int:
            d0, d1 = (d % rank_in for d in node.args[1:3])
            return bd.moved({d0: d1, d1: d0}.get(bd.dim, bd.dim))
        if t is aten.unsqueeze.default:
            d = node.args[1] % (rank_in + 1)
            return bd.moved(bd.dim + 1 if d <= bd.dim else bd.dim)
        if t is aten.expand.default:
            return bd.moved(bd.dim + val.dim() - rank_in)
        if bd.index_of and (t in (aten.clone.default, aten.alias.default) or (
                t is prims.convert_element_type.default and
                {self.value(src).dtype, val.dtype} <= {torch.int64, torch.int32})):
            return bd      # the same values (Note [An arange over the rows])
        return NotImplemented

    def _through_view(self, ins: list, bd: BatchDim, outs: list) -> Layout:
        d = bd.dim
        if len(outs) > d and all(sizes_equal(a, b) for a, b in zip(ins[:d + 1], outs)):
            return bd  # the view only reshapes dims after the batch (Flatten and its backward)
        stride = bd.inner * product(ins[bd.dim + 1:])
        prefix = product(ins[: bd.dim]) * bd.outer
        for j in reversed(range(len(outs))):
            if not self.has_batch(outs[j]):
                continue
            inner = _simplify(stride / product(outs[j + 1:]))
            if not _whole(inner):
                continue
            outer = _simplify(outs[j] / (self.batch * inner))
            if (
                _whole(outer)
                and not self.has_batch(outer)
                and sizes_equal(product(outs[:j]) * outer, prefix)
            ):
                same = sizes_equal(outer, bd.outer) and sizes_equal(inner, bd.inner)
                keeps = bd.index_of if bd.index_of == "unit" or same else None
                return BatchDim(j, outer, inner, keeps)   # Note [An arange over the rows]
        return Ambiguous(f"view {ins} -> {outs} splits or scrambles the batch dim")

    def _through_cat(self, node: fx.Node, val: torch.Tensor) -> Layout:
        """``cat`` along the dim that holds the batch (``torch.stack`` of per-step outputs, as
        Inductor decomposes it): parts of sizes ``o_k * B * inner`` in that dim, all with the same
        ``inner``, concatenate into ``(sum o_k) * B * inner``, the row-major flattening of
        (sum o_k, B, inner). Along any other dim the layout is the parts' own."""
        parts = [p for p in node.args[0] if isinstance(p, fx.Node)]
        rank = val.dim()
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % rank
        lays = [self.layouts.get(p) for p in parts]
        if not all(isinstance(lay, BatchDim) and self.value(p).dim() == rank
                   for p, lay in zip(parts, lays)) or len({lay.dim for lay in lays}) != 1:
            return self._inherit(node, val)
        if lays[0].dim != dim:
            return self._inherit(node, val)
        if len({lay.inner for lay in lays}) != 1:
            return Ambiguous(f"{node.name} concatenates parts that flatten the batch differently")
        outer = sympy.simplify(sum((lay.outer for lay in lays), sympy.Integer(0)))
        expect = outer * self.batch * lays[0].inner
        if not sizes_equal(expect, self.shape(val)[dim]):
            return Ambiguous(f"{node.name} concatenates along the batch dim with sizes that do "
                             f"not add up to (outer, B, inner)")
        return BatchDim(dim, outer, lays[0].inner)

    def _through_as_strided(self, node: fx.Node, val: torch.Tensor) -> Layout:
        """Note [as_strided reads storage]."""
        x = node.args[0]
        if not self.is_batched(x):
            return self.from_shape(val)   # batch-free values broadcast, as by expand
        scatter = node.target is aten.as_strided_scatter.default
        if scatter:
            stored, src = val, node.args[1]
            size, stride = self.shape(src.meta["val"]), self._ints(node.args[3])
            offset = node.args[4] if len(node.args) > 4 else node.kwargs.get("storage_offset")
        else:
            stored, src = x.meta["val"], node
            size, stride = self.shape(val), [self.size(s) for s in val.stride()]
            offset = val.storage_offset()
        blocks = self._example_blocks(stored)
        if isinstance(blocks, str):
            return Ambiguous(f"{node.name} addresses storage where {blocks}")
        dim, inner, block = blocks
        stored_layout = BatchDim(dim, sympy.Integer(1), inner)
        if scatter:
            if not self._contiguous(stored):
                return Ambiguous(f"{node.name} scatters into a tensor that is not contiguous")
            filled = x.op == "call_function" and not any(
                a in self.data_dependent for a in x.all_input_nodes)   # no example's data
            if not filled and not _same_layout(self.layouts.get(x), stored_layout):
                return Ambiguous(f"{node.name} scatters into a tensor whose batch layout is not "
                                 f"its storage's")
        elif not _same_layout(self.layouts.get(x), stored_layout):
            return Ambiguous(f"{node.name} reads a tensor whose batch layout is not its storage's")
        base = self.size(stored.storage_offset())
        start = (base if offset is None else self._ints([offset])[0]) - base
        reads = self._per_example_positions(size, stride, start, block)
        if isinstance(reads, str):
            return Ambiguous(f"{node.name} with sizes {self.pretty(size)} and strides "
                             f"{self.pretty(stride)}: {reads}")
        if scatter:
            if not _same_layout(self.layouts.get(src), reads):
                return Ambiguous(f"{node.name} writes a tensor whose batch layout is not the "
                                 f"one its positions keep apart")
            return stored_layout
        return reads

    def _example_blocks(self, val: torch.Tensor) -> tuple[int, sympy.Expr, sympy.Expr] | str:
        """(d, inner, E) for a tensor that lies dense in storage with the batch outermost: dim d,
        of size B * inner, is the only one holding the batch, and the strides are the contiguous
        strides of an order of the dims that ends with d, so example b's elements are exactly the
        positions [b E, (b + 1) E) past the tensor's offset, E = inner * stride of d. Otherwise
        the reason."""
        sizes, strides = self.shape(val), [self.size(s) for s in val.stride()]
        dims = [d for d, s in enumerate(sizes) if self.has_batch(s)]
        if len(dims) != 1:
            return f"the batch size appears in dims {dims} of shape {self.pretty(sizes)}"
        (d,) = dims
        inner = _simplify(sizes[d] / self.batch)
        if not _whole(inner) or self.has_batch(inner):
            return f"dim {d} of size {self.pretty(sizes[d])} is not a whole number of examples"
        left, step, last = [e for e in range(len(sizes)) if sizes[e] != 1], sympy.Integer(1), d
        while left:
            match = [e for e in left if sizes_equal(strides[e], step)]
            if len(match) != 1:
                return f"strides {self.pretty(strides)} of shape {self.pretty(sizes)} are not dense"
            last = match[0]
            left.remove(last)
            step = step * sizes[last]
        if last != d:
            return (f"strides {self.pretty(strides)} of shape {self.pretty(sizes)} do not put "
                    f"the batch outermost")
        return d, inner, inner * strides[d]

    def _per_example_positions(self, size: list, stride: list, start: sympy.Expr,
                               block: sympy.Expr) -> BatchDim | str:
        """The layout of a strided view at ``start`` of storage holding example b at positions
        [b E, (b + 1) E), E = ``block``: ``BatchDim(j, 1, inner)`` if dim j, of size B * inner,
        is the only one holding the batch, ``inner * stride[j] == E``, and every position of the
        view's other indices (dim j's within an example among them) lies in [0, E), which puts
        example b's positions in block b. Otherwise the reason."""
        dims = [d for d, s in enumerate(size) if self.has_batch(s)]
        if len(dims) != 1:
            return f"the batch size appears in dims {dims}"
        (j,) = dims
        inner = _simplify(size[j] / self.batch)
        if not _whole(inner) or self.has_batch(inner) or not sizes_equal(inner * stride[j], block):
            return (f"dim {j} does not step from one example's block ({self.pretty(block)}) to "
                    f"the next")
        low = high = start
        for n, s in [(inner, stride[j])] + [(size[d], stride[d]) for d in range(len(size))
                                            if d != j]:
            if nonnegative(s):
                high = high + (n - 1) * s
            elif nonnegative(-s):
                low = low + (n - 1) * s
            else:
                return f"the sign of stride {self.pretty(s)} is not known"
        if not (nonnegative(low) and nonnegative(block - 1 - high)):
            return (f"positions [{self.pretty(low)}, {self.pretty(high)}] are not within one "
                    f"example's block [0, {self.pretty(block)})")
        return BatchDim(j, sympy.Integer(1), inner)

    def _contiguous(self, val: torch.Tensor) -> bool:
        step = sympy.Integer(1)
        for n, s in reversed(list(zip(self.shape(val), val.stride()))):
            if n != 1 and not sizes_equal(self.size(s), step):
                return False
            step = step * n
        return True

    def _ints(self, values: list) -> list[sympy.Expr]:
        """Sizes, strides or offsets given as ints or as nodes of the graph's size arithmetic."""
        return [self.size(v.meta["val"] if isinstance(v, fx.Node) else v) for v in values]

    def _inherit(self, node: fx.Node, val: torch.Tensor) -> Layout:
        """Pointwise and other shape-preserving ops: take the layout of the input dim whose size
        expression equals the output's batched dim; fall back to reading the shape."""
        out_shape = self.shape(val)
        out_dims = [d for d, s in enumerate(out_shape) if self.has_batch(s)]
        if len(out_dims) != 1:
            return self.from_shape(val)
        (d,) = out_dims
        candidates = set()
        for a in node.all_input_nodes:
            if a in self.draws:
                continue         # Note [A random draw holds no example]
            lay = self.layouts.get(a)
            if isinstance(lay, BatchDim) and isinstance(self.value(a), torch.Tensor):
                in_size = self.shape(self.value(a))[lay.dim]
                if sizes_equal(in_size, out_shape[d]):
                    candidates.add((lay.outer, lay.inner))
        if len(candidates) == 1:
            outer, inner = candidates.pop()
            return BatchDim(d, outer, inner)
        if len(candidates) > 1:
            return Ambiguous(f"inputs of {node.name} disagree on the batch layout")
        return self.from_shape(val)

