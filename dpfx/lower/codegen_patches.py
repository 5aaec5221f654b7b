"""Patches to how Inductor generates code for dpfx's graphs (torch 2.13): smaller CPU kernel
groups, and vector strides, dtype rules, fusion refusals and optimization hints each computed
once, for a fast compile; a shared sum stored, for lean code.

    with smaller_cpu_kernel_groups(), polynomial_vector_strides(), dtype_rules_once(), \
            fusion_refusals_kept(), shared_sums_stored():
        compiled = compile_fx_inner(gm, example_inputs)        # (lower/inductor.py)

None of them changes a computed value: each takes a shortcut to an answer Inductor would have
given (tests/lower/test_lowering_patches.py compares the code with and without the compile-time
ones) or, for ``shared_sums_stored``, stores a value once where that lets buffers die. Each Note
says what its patch saves and why; TORCH_VERSIONS names the torch it was written for, and
BENCHMARKS.md ("Levers in the code") what it measured. Any can be dropped when torch changes, at
that cost. One more lives in lower/cpu_builds.py (one C++ build per compile worker), and
``optimization_hints_once`` is entered around dpfx's whole capture (backend/__init__.py).
"""
from __future__ import annotations

import contextlib
import functools

import sympy
import torch

from dpfx.lower.shape_patches import _expr

# torch versions each patch was written and measured for
TORCH_VERSIONS = {"smaller_cpu_kernel_groups": "2.13", "polynomial_vector_strides": "2.13",
                  "dtype_rules_once": "2.13", "fusion_refusals_kept": "2.13",
                  "shared_sums_stored": "2.13", "optimization_hints_once": "2.13"}


# Note [CPU kernel groups of at most 100 arguments]
# Inductor's C++ backend writes consecutive fused kernels into one C++ function until an extern call
# (a GEMM) intervenes or the function's arguments exceed ``CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM``
# (500). A captured backward alternates GEMMs and small kernels; dpfx's tail after the last GEMM
# does not: every parameter's per-sample norm (a ghost norm's Gram product, a reduction over [B]),
# the norms' sum, the clip factor and the clip-scaled operands. On a model with many parameters that
# is one function of thousands of lines and hundreds of parallel loops, which g++ compiles alone,
# after every other kernel has finished. dpfx lowers with a limit of 100: the same loops in several
# functions, compiled in parallel while Inductor generates the rest (limits of 50 and 200 do as
# well; models with short tails are unaffected). Each function opens its own parallel region, a few
# microseconds a step, within a steady step's noise. The limit is a class attribute Inductor reads
# while generating code, so it is set for dpfx's lowering only and restored after; it changes how
# the kernels are grouped, not what they compute. Inductor's FX-graph cache keys do not hold it;
# dpfx's source digest does.
KERNEL_GROUP_ARGS = 100


@contextlib.contextmanager
def smaller_cpu_kernel_groups():
    """Note [CPU kernel groups of at most 100 arguments]."""
    from torch._inductor.codegen.cpp import CppScheduling

    before = CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM
    CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM = min(before, KERNEL_GROUP_ARGS)
    try:
        yield
    finally:
        CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM = before


# Note [Vector strides of polynomial indices]
# Inductor's C++ backend decides how to vectorize each loop from the stride of every load and
# store index along the loop's variable: ``stride_at_vec_range(index, var, vec_length)`` first
# rewrites the index's FloorDiv and ModularIndexing terms for a vector of ``vec_length`` lanes,
# then runs ``sympy.simplify`` on the index and on ``index(var + 1) - index(var)``. The full
# ``simplify`` (a search over rewrites) is slow on indices that hold the unbacked batch
# (``512*d0 + d1 + 8192*u0 + 384``), and dpfx's graphs hold many, called thousands of times in
# one lowering. An index that is a polynomial in its symbols (no FloorDiv,
# ModularIndexing or other functions: the usual affine index of a contiguous or strided
# tensor) has nothing for the first step to rewrite, and its stride along ``var`` is the
# polynomial ``index(var + 1) - index(var)``, which ``sympy.expand`` puts in canonical form:
# a constant stride comes out as the same Integer, a symbolic one as an equal expression.
# Any other index goes to Inductor's function. Where g++ bounds the first step, the lowering
# ending sooner only waits longer for it. The same stride expression as Inductor's, so the
# same generated code (tests/lower/test_lowering_patches.py compares the code
# too). Set for dpfx's lowering only, and restored after.
@contextlib.contextmanager
def polynomial_vector_strides():
    """Note [Vector strides of polynomial indices]."""
    from torch._inductor.codegen import cpp

    before = getattr(cpp, "stride_at_vec_range", None)
    if before is None:
        yield
        return
    cpp.stride_at_vec_range = _polynomial_strides(before)
    try:
        yield
    finally:
        cpp.stride_at_vec_range = before


@functools.lru_cache(maxsize=None)
def _polynomial_strides(inductors):
    """``inductors``'s ``stride_at_vec_range``, with polynomial indices taken by expansion."""

    @functools.lru_cache(maxsize=None)
    def stride_at_vec_range(index, var, vec_length=None):
        if isinstance(index, sympy.Expr) and isinstance(var, sympy.Symbol) \
                and index.is_polynomial():
            if not index.has(var):
                return sympy.S.Zero
            return sympy.expand(index.xreplace({var: var + 1}) - index)
        return inductors(index, var, vec_length)

    return stride_at_vec_range


# Note [Inductor's dtype rules, set up once]
# Every op of every kernel body Inductor generates asks ``DtypePropagationOpsHandler()`` for its
# output dtype. The class is a singleton, but its ``__init__`` runs on each call and rebuilds
# the whole rule table: some 200 ``setattr`` of ``functools.partial`` objects and a ``dir()``
# check, tens of microseconds a call, and a large model's two graphs make thousands of calls
# (dpfx's larger backward most of them). During dpfx's
# lowering the table is built again only when Inductor's rule registries differ from those it
# was last built from (a rule registered or replaced since); otherwise the call returns the
# singleton as it is, with the same attributes. Set for dpfx's lowering only, and restored
# after.
# (tests/lower/test_lowering_patches.py: the same generated code, the table rebuilt when a rule
# changes)
@contextlib.contextmanager
def dtype_rules_once():
    """Note [Inductor's dtype rules, set up once]."""
    try:
        from torch._inductor import utils
        from torch._inductor.codegen import common
        from torch._inductor.dtype_propagation import DtypePropagationOpsHandler
        rules, pointwise = utils.op_dtype_propagation_rules, common.pointwise_overrides_data
    except (ImportError, AttributeError):
        yield
        return
    before = DtypePropagationOpsHandler.__init__

    def __init__(self):
        state = (dict(rules), dict(pointwise))
        if getattr(self, "_dpfx_built_from", None) == state:
            return
        before(self)
        self._dpfx_built_from = state

    DtypePropagationOpsHandler.__init__ = __init__
    try:
        yield
    finally:
        DtypePropagationOpsHandler.__init__ = before


# Note [Fusion refusals kept across Inductor's fusion rounds]
# Inductor's scheduler fuses in up to ten rounds; each round asks ``can_fuse`` of every pair of
# nodes that use one buffer (up to 64 pairs per node). dpfx's clip coefficient, a [B] buffer, is
# read by a kernel per parameter, and each reads it at its own index, so no pair shares a dependency
# and every one is refused "no shared data", round after round: about half of the questions are
# asked again of a pair of unchanged nodes refused the round before. That refusal is a function of
# the pair alone: the checks before it (streams, node kinds, order, templates, devices) and the
# shared-data score it tests (exact dependencies, buffer overlap, nested and mixed-order reductions,
# speculative loop reordering, rolled back on a refusal) read the two nodes and Inductor's settings,
# never which other nodes have fused; and those checks only refuse, but for a template's
# multi-output fusion, itself a function of the pair. A node changes only by fusing (a new node) or
# by
# pruning (a new ``read_writes``). So during dpfx's lowering a plain or fused node pair refused
# for no shared data is refused again at once while both nodes and both ``read_writes`` objects
# are the ones it was refused with; every other question goes to Inductor. The same fusions,
# so the same generated code (tests/lower/test_lowering_patches.py compares it, and checks each kept
# refusal against Inductor's answer). Set for dpfx's lowering only, and restored after.
_NO_SHARED_DATA = "no shared data"


_CHECK_KEPT_REFUSALS = False    # tests: ask Inductor again and require the same refusal


@contextlib.contextmanager
def fusion_refusals_kept():
    """Note [Fusion refusals kept across Inductor's fusion rounds]."""
    try:
        from torch._inductor.scheduler import (FusedSchedulerNode, Scheduler, SchedulerNode,
                                               WhyNoFuse)
        can_fuse, why = Scheduler.can_fuse, WhyNoFuse.__call__
    except (ImportError, AttributeError):
        yield
        return
    plain = (SchedulerNode, FusedSchedulerNode)
    refused: dict = {}
    last = [None]

    def noted(self, reason, *args):
        last[0] = reason
        return why(self, reason, *args)

    def kept(self, node1, node2, can_reorder=False, allow_mix_order_reduction=True):
        if type(node1) not in plain or type(node2) not in plain:
            return can_fuse(self, node1, node2, can_reorder, allow_mix_order_reduction)
        state = (node1.read_writes, node2.read_writes)
        key = (node1, node2, can_reorder, allow_mix_order_reduction, id(state[0]), id(state[1]))
        if key in refused:
            if _CHECK_KEPT_REFUSALS:
                assert not can_fuse(self, node1, node2, can_reorder, allow_mix_order_reduction)
            return False
        last[0] = None
        fused = can_fuse(self, node1, node2, can_reorder, allow_mix_order_reduction)
        if not fused and last[0] == _NO_SHARED_DATA:
            refused[key] = state    # held, so that no other object takes their ids meanwhile
        return fused

    Scheduler.can_fuse, WhyNoFuse.__call__ = kept, noted
    try:
        yield refused
    finally:
        Scheduler.can_fuse, WhyNoFuse.__call__ = can_fuse, why


# Note [A shared sum stored so that its inputs die]
# Inductor computes a pointwise value read by several kernels inside each of them unless it reads
# more than four buffers (``realize_reads_threshold``): every buffer it reads then lives until the
# last of those kernels. A ResNet's downsampling block sums the input gradients of its two
# convolutions (the 3x3 and the 1x1 shortcut read one activation), and the block before reads that
# sum, through the ReLU's mask, in its GroupNorm backward and again through its identity shortcut,
# kernels apart: both gradients are held through a whole block, at dpfx's step peak on a GroupNorm
# ResNet (torch.compile's graph holds such a pair too, but its peak comes earlier). During dpfx's
# lowering a pointwise node with several readers is stored as a buffer where that lets at least two
# buffers of its size and dtype die at its kernel: buffers whose every reader is the node or a
# single-reader pointwise node inlined into it. It then holds one buffer where it held two or more,
# and its readers load it instead of computing it each from two or more loads, so neither the bytes
# held nor the loads grow (a buffer read only inside one fused kernel is not written at all:
# Inductor drops it); the values are the same (the same expression, computed once). Set for dpfx's
# lowering only, and restored after; dpfx's source digest keys Inductor's FX-graph cache.
# (tests/lower/test_lowering_memory.py)
@contextlib.contextmanager
def shared_sums_stored():
    """Note [A shared sum stored so that its inputs die]."""
    try:
        from torch._inductor import ir
        from torch._inductor.graph import GraphLowering
        run_node = GraphLowering.run_node
    except (ImportError, AttributeError):
        yield []
        return

    lowered: dict = {}      # node -> its value (the interpreter drops a value after its last use)
    made: list[str] = []    # the nodes stored

    def stored(self, n):
        result = lowered[n] = run_node(self, n)
        if _inlined(result) and len(n.users) > 1 and _frees_buffers(lowered, n):
            result.realize()
            made.append(n.name)
        return result

    def _inlined(value):
        return isinstance(value, ir.TensorBox) and isinstance(value.data, ir.StorageBox) \
            and isinstance(value.data.data, ir.Pointwise)

    def _frees_buffers(values, n) -> bool:
        val = n.meta.get("val")
        if n.op != "call_function" or not isinstance(val, torch.Tensor):
            return False
        inlined, frontier, seen = {n}, list(n.all_input_nodes), set()
        while frontier:     # the single-reader pointwise nodes computed inside n's kernels
            m = frontier.pop()
            if m in seen:
                continue
            seen.add(m)
            if len(m.users) == 1 and _inlined(values.get(m)):
                inlined.add(m)
                frontier.extend(m.all_input_nodes)
        size = _numel(val)
        freed = [m for m in seen - inlined
                 if isinstance(values.get(m), ir.TensorBox)
                 and isinstance(values[m].data, ir.StorageBox)
                 and ir.IRNode.is_realized_node(values[m].data.data) and set(m.users) <= inlined
                 and isinstance(m.meta.get("val"), torch.Tensor)
                 and m.meta["val"].dtype == val.dtype and _numel(m.meta["val"]) == size]
        return len(freed) >= 2

    GraphLowering.run_node = stored
    try:
        yield made
    finally:
        GraphLowering.run_node = run_node


def _numel(t: torch.Tensor):
    return _expr(t.numel())


# Note [Optimization hints, computed once per expression]
# The partitioner and Inductor weigh their choices (the min-cut's node weights, a loop's
# parallel depth, memory planning) by an "optimization hint" of each size expression: a value
# for it, with the unbacked batch at Inductor's fallback (8192). For an expression that holds the
# unbacked batch, torch 2.13's ``_optimization_hint_base`` expands, factors and substitutes it
# with sympy on every call, though the expressions repeat (a large model's capture asks
# thousands of times for about a hundred distinct ones). During dpfx's capture each
# answer is kept, keyed by everything the function reads: the expression, the fallback (and
# Inductor's configured one, read when none is given), the shape environment and its version
# (the key torch keeps its own caches by: replacements, divisibility, runtime asserts), and each
# free symbol's replacement and value range. An expression with Inductor's precomputed sizes,
# or a shape environment without a version, is passed to torch's function each time. The same
# answers, so the same generated code (tests/lower/test_lowering_patches.py compares it). Set for
# dpfx's capture only, and restored after.
@contextlib.contextmanager
def optimization_hints_once():
    """Note [Optimization hints, computed once per expression]."""
    try:
        from torch._inductor import sizevars
        from torch.fx.experimental import _size_hinting, symbolic_shapes
        from torch.utils._sympy.symbol import SymT, symbol_is_type
        base = _size_hinting._optimization_hint_base
    except (ImportError, AttributeError):
        yield
        return
    modules = [m for m in (symbolic_shapes, sizevars)
               if getattr(m, "_optimization_hint_base", None) is base]
    known: dict = {}

    def hint(shape_env, expr, precomputed_replacements, fallback=None):
        version = getattr(shape_env, "_version_counter", None)
        if not isinstance(expr, sympy.Expr) or version is None:
            return base(shape_env, expr, precomputed_replacements, fallback)
        free = sorted(expr.free_symbols, key=str)
        if any(symbol_is_type(s, SymT.PRECOMPUTED_SIZE) for s in free):
            return base(shape_env, expr, precomputed_replacements, fallback)
        configured = torch._inductor.config.unbacked_symint_fallback if fallback is None \
            else None
        key = (expr, fallback, configured, shape_env, version, tuple(
            (s, shape_env.replacements.get(s), shape_env.var_to_range.get(s)) for s in free))
        found = known.get(key)
        if found is None:
            found = known[key] = base(shape_env, expr, precomputed_replacements, fallback)
        return found

    for m in modules:
        m._optimization_hint_base = hint
    try:
        yield
    finally:
        for m in modules:
            m._optimization_hint_base = base
