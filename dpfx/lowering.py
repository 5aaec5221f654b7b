"""Lowering a rewritten graph with Inductor, under the conditions dpfx needs for it to be exact.

    compiled = lower(gm, example_inputs, kwargs, backend="inductor")

The verifier proves the FX graph; what runs is the code Inductor generates from it. Two things in
torch 2.13 let that code differ from the graph for an unbacked batch, and this module closes both.
It also bounds the size of the C++ functions Inductor writes for dpfx's graphs, which decides
how long g++ takes on them (Note [CPU kernel groups of at most 100 arguments]), has a graph's
kernels built as one unit per compile worker (Note [One C++ build per compile worker] in
cpu_builds.py), takes the vector strides of polynomial indices without ``sympy.simplify``
(Note [Vector strides of polynomial indices]), sets Inductor's dtype rules up once (Note
[Inductor's dtype rules, set up once]), keeps the scheduler's refusals of pairs that share no
data across its fusion rounds (Note [Fusion refusals kept across Inductor's fusion rounds]) and
computes the optimization hint of each size expression once per capture (Note [Optimization
hints, computed once per expression]). One patch changes the code, for memory: a pointwise value
read by several kernels is stored once where that lets the buffers it reads die (Note [A shared
sum stored so that its inputs die]).

# Note [Inductor must not assume what it cannot check]
While lowering, Inductor's ``sizevars.check(expr)`` means "this is true, make sure it is checked".
For an expression on an unbacked symbol that cannot be proven, it becomes a *deferred runtime
assert*; but runtime asserts are frozen before lowering starts, so the assert is never emitted:
the generated code silently assumes it. The first such case found (issue: MultiheadAttention)
is ``View._dynamic_reshape_indexer`` on ``(T, B, 16) -> (T, 2*B, 8)`` (the head split): its
greedy merge compares ``16*u0`` with 16, cannot decide, takes the merge, and "checks"
``Eq(16, 16*u0)``, i.e. assumes B == 1. The index math it emits reads the wrong rows for B > 1:
examples mix. On a cold cache the assumption also narrows u0's range to [1, 2], which becomes a
dynamo guard that fails on the same frame ("Guard failed on the same frame it was created");
on a warm FX-graph cache lowering is skipped, no guard is made, and the wrong kernel runs.

dpfx makes such an assumption an error instead: ``ShapeEnv.guard_or_defer_runtime_assert`` raises
``UncheckedAssumption`` (an ``AssertionError``) for an unprovable expression on an unbacked symbol
once asserts are frozen. The reshape indexer catches ``AssertionError`` and falls back to going
through the flat size, which is exact; anywhere else the compile fails with a ``CaptureError``
that prints the expression. Reproduction: tests/test_inductor_exact.py.

Closing that hole uncovered one more site that had only worked because of the wrong range:
Inductor's bmm lowering asks whether an operand's layout suits the CPU kernel with a plain Python
comparison of its strides (``48*u0 >= 48``), a hard guard on the batch. The answer only decides
whether to copy the operand to contiguous first, so ``bmm_operands_contiguous`` makes that copy
for operands whose matrix dims' sizes or strides hold an unbacked symbol, and the question is never
asked; an operand whose batch appears only in dim 0 is left to Inductor's test, which then compares
plain integers.

# Note [dpfx's own FX-graph cache entries]
Inductor's FX-graph cache keys on the graph and Inductor's config, not on the hook above, so an
entry lowered without it (an earlier dpfx, or plain torch.compile of the same forward graph) could
be handed back. dpfx compiles with a no-op post-grad pass whose uuid hashes dpfx's sources
(every Python and C file of the package), so its entries are its own. The whole package, not
this file alone: the generated code bakes in what dpfx's own ops' fake kernels said (output
strides) and calls their kernels, so a dpfx whose ops changed must not reuse another version's
entries, which the graph alone (the same op names and arguments) would match
(tests/test_inductor.py::test_cache_key_covers_every_dpfx_source). The same pass is in
Inductor's settings for the whole compile, so that AOTAutogradCache's key carries it too (Note
[No caches that skip the inner compiler] in backend.py).
"""
from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import os
import warnings

import sympy
import torch
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.compile_fx import compile_fx_inner
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.virtualized import V
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .cpu_builds import merged_cpu_builds
from .errors import CaptureError
from .warm import canonical_attributes

# Inductor's channels-last layout optimization miscompiles Conv2d on CPU when the batch is
# unbacked (a stride assertion fails at run time; plain torch.compile fails the same way).
INDUCTOR_PATCHES = {"layout_optimization": False}

# Note [Combo kernels on the GPU]
# A GPU step of dpfx is bound by the host launching kernels: every parameter adds its own small
# reductions (its per-example gradient, its norm, its clipped sum), about 30 us of host time each
# on an H100's host. Inductor's combo kernels put independent kernels into one launch: on an
# H200, dpfx's GPT-2 (d=256, B=16) step went from 432 to 287 launches and 11.8 to 9.1 ms, and the
# MLP at B=1024 from 48 to 34 and 3.13 to 2.41 ms (BENCHMARKS.md). Triton only: the C++ backend
# has no combo kernels. They are off in torch by default; should Inductor fail to lower a graph
# with them, ``lower`` warns (ComboKernelsWarning) and lowers the same graph without them.
GPU_PATCHES = {"combo_kernels": True}


def inductor_patches(example_inputs) -> dict:
    """dpfx's Inductor settings for a graph whose inputs are ``example_inputs``."""
    on_gpu = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
    return {**INDUCTOR_PATCHES, **GPU_PATCHES} if on_gpu else INDUCTOR_PATCHES


class UncheckedAssumption(AssertionError):
    """Inductor wanted to assume a fact about an unbacked size that nothing would check."""

    def __init__(self, expr: sympy.Basic):
        super().__init__(f"dpfx: Inductor would assume {expr} about the batch size unchecked")
        self.expr = expr


@contextlib.contextmanager
def no_unchecked_assumptions(shape_env):
    """Note [Inductor must not assume what it cannot check]."""
    if shape_env is None:
        yield
        return
    deferring = shape_env.guard_or_defer_runtime_assert

    def strict(expr, msg, fx_node=None):
        if shape_env.runtime_asserts_frozen and free_unbacked_symbols(expr):
            known = shape_env._maybe_evaluate_static(expr)
            if known is None:
                raise UncheckedAssumption(expr)
            return bool(known)
        return deferring(expr, msg, fx_node)

    shape_env.guard_or_defer_runtime_assert = strict
    try:
        yield
    finally:
        del shape_env.guard_or_defer_runtime_assert


@contextlib.contextmanager
def bmm_operands_contiguous():
    """Note [Inductor must not assume what it cannot check], second part."""
    from torch._inductor import ir
    from torch._inductor.lowering import lowerings

    bmm = torch.ops.aten.bmm.default
    original = lowerings[bmm]

    def lower_bmm(mat1, mat2, *args, **kwargs):
        operands = V.graph.current_node.args[:2]
        if any(_unbacked_matrix_layout(a.meta["val"]) for a in operands
               if isinstance(a, torch.fx.Node)):
            mat1 = ir.ExternKernel.require_contiguous(mat1)
            mat2 = ir.ExternKernel.require_contiguous(mat2)
        return original(mat1, mat2, *args, **kwargs)

    lowerings[bmm] = lower_bmm
    try:
        yield
    finally:
        lowerings[bmm] = original


def _unbacked_matrix_layout(t: torch.Tensor) -> bool:
    """Whether the sizes or strides Inductor's CPU bmm lowering compares (those of the matrix
    dims, 1 and 2) hold an unbacked symbol. The batch dim's size and stride are never compared, so
    an operand whose batch is only there (B, R, N), as a view or a transpose, keeps its layout and
    is not copied (a time-major Gram operand was copied twice: 2 x B*R*N floats held at once)."""
    return bool(free_unbacked_symbols((*t.shape[1:], *t.stride()[1:])))


class _CacheKey(CustomGraphPass):
    """A no-op pass whose uuid gives dpfx's lowerings their own FX-graph cache entries."""

    def __init__(self, user_pass, extra: str = ""):
        self.user_pass = user_pass
        self.extra = extra

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.user_pass is not None:
            self.user_pass(graph)

    def uuid(self) -> bytes:
        theirs = self.user_pass.uuid() if self.user_pass is not None else None
        return f"dpfx-{_source_digest()}-{theirs}-{self.extra}".encode()


def cache_key_pass(user_pass, extra: str = "") -> _CacheKey:
    """Inductor's post-grad custom pass for a dpfx compile: ``user_pass`` (or none) under a uuid
    that names dpfx's sources and ``extra`` (the batch-size decisions the graph was captured
    under: Note [Deciding a branch on the batch size]), for Inductor's and AOTAutogradCache's
    keys."""
    if isinstance(user_pass, _CacheKey):
        return user_pass if not extra else _CacheKey(user_pass.user_pass, extra)
    return _CacheKey(user_pass, extra)


@functools.cache
def _source_digest() -> str:
    """One hash of dpfx's sources (Python and C). The compiled code of a graph bakes in what
    dpfx's own ops' fake kernels said (output shapes and strides) and calls their kernels: a
    dpfx that changed either must not be handed another version's entries, which the graph
    alone (the same op names and arguments) would match."""
    return source_digest(os.path.dirname(os.path.abspath(__file__)))


def source_digest(root: str) -> str:
    """sha256 over the package at ``root``: each .py file (any depth) and csrc/*.c, by path
    relative to ``root`` and content, so the same sources give the same key wherever they lie."""
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                       + glob.glob(os.path.join(root, "csrc", "*.c"))):
        digest.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def lower(gm: torch.fx.GraphModule, example_inputs: list, kwargs: dict, backend: str):
    """The compiled callable (boxed) for a rewritten forward or backward graph."""
    if backend == "eager":
        return make_boxed_func(gm.forward)
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    shape_env = fake_mode.shape_env if fake_mode is not None else None
    key = cache_key_pass(torch._inductor.config.post_grad_custom_post_pass)
    # Note [A warm start without the joint trace] (warm.py): the FX-graph cache stays on under
    # AOTAutogradCache's bundled mode, and the key of a graph rebuilt from that cache is the
    # key of the graph aot_autograd built.
    canonical_attributes(gm)

    def attempt(**settings):
        with no_unchecked_assumptions(shape_env), bmm_operands_contiguous(), \
                smaller_cpu_kernel_groups(), merged_cpu_builds(), polynomial_vector_strides(), \
                dtype_rules_once(), fusion_refusals_kept(), shared_sums_stored(), \
                fake_values_kept(), \
                torch._functorch.config.patch(bundled_autograd_cache=False), \
                torch._inductor.config.patch(post_grad_custom_post_pass=key, **settings):
            return compile_fx_inner(gm, example_inputs, **kwargs)

    try:
        try:
            return attempt()
        except Exception as e:
            if not torch._inductor.config.combo_kernels or _unchecked(e) is not None:
                raise
            # Note [Combo kernels on the GPU]: they only group kernels; without them the same
            # verified graph is lowered kernel by kernel.
            warnings.warn(f"dpfx: Inductor's combo kernels failed on this graph "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                          f"); lowering it without them (more kernel launches, the same "
                          f"values)", ComboKernelsWarning, stacklevel=2)
            return attempt(combo_kernels=False)
    except Exception as e:
        cause = _unchecked(e)
        if cause is None:
            raise
        raise _assumption_error(cause.expr) from e


class ComboKernelsWarning(UserWarning):
    """Inductor's combo kernels failed on a graph, which dpfx then lowered without them."""


def _unchecked(e: BaseException) -> UncheckedAssumption | None:
    cause = e
    while cause is not None and not isinstance(cause, UncheckedAssumption):
        cause = cause.__cause__ or cause.__context__
    return cause


# Note [CPU kernel groups of at most 100 arguments]
# Inductor's C++ backend writes consecutive fused kernels into one C++ function until an extern
# call (a GEMM) intervenes or the function's arguments exceed
# ``CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM`` (500). A captured backward alternates GEMMs and
# small kernels; dpfx's tail after the last GEMM does not: every parameter's per-sample norm
# (a ghost norm's Gram product, a reduction over [B]), the norms' sum, the clip factor and the
# clip-scaled operands. On GPT-2 small (148 parameters) that became one function of 8,900
# lines with 200 parallel loops, which g++ -O3 compiled in 8.9 s, alone, after every other
# kernel had finished. dpfx lowers with a limit of 100: the same loops in five functions of
# 1.3-1.5 s each, compiled in parallel while Inductor generates the rest. GPT-2 small's first
# step took 56.4 against 60.4 s (benchmarks/first_step.py; limits of 50 and 200 did as well as
# 100); GPT-2 at d=256 and the GroupNorm ResNet, whose tails are shorter, did not move. Each
# function opens its own parallel region, a few microseconds a step; steady steps did not
# move. The limit is a class attribute Inductor reads while generating code, so it is set for
# dpfx's lowering only and restored after; it changes how the kernels are grouped, not what
# they compute. Inductor's FX-graph cache keys do not hold it; dpfx's source digest does.
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
# (``512*d0 + d1 + 8192*u0 + 384``), and dpfx's graphs hold many: on the LSTM classifier at
# B = 256 the 8,774 calls took 3.4-3.8 s of a 38 s cold first step (torch.compile's 8,041 on
# its static batch: 1.9 s). An index that is a polynomial in its symbols (no FloorDiv,
# ModularIndexing or other functions: the usual affine index of a contiguous or strided
# tensor) has nothing for the first step to rewrite, and its stride along ``var`` is the
# polynomial ``index(var + 1) - index(var)``, which ``sympy.expand`` puts in canonical form:
# a constant stride comes out as the same Integer, a symbolic one as an equal expression.
# Any other index goes to Inductor's function. The LSTM's calls took 0.2 s instead. Cold first
# steps (benchmarks/first_step.py, two runs each, the 2-core AMD EPYC, 2026-11-27): the ResNet
# at B = 256 18.94 -> 18.06 s, GPT-2 d=256 22.96 -> 21.69 s; the LSTM's did not move (32.04,
# 32.00): its lowering ends sooner and waits longer on g++, which bounds it on two cores; nor
# did GPT-2 small's (58.87 against 59.17 s, one run each).
# Checked on every call of those three first steps: the same stride expression as Inductor's
# every time, so the same generated code (tests/test_lowering_patches.py compares the code
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
# check, 65 us a call on the 2-core AMD EPYC. GPT-2 small's two graphs make 16,690 such calls
# (about 1.1 s of its lowering); dpfx's larger backward makes most of them. During dpfx's
# lowering the table is built again only when Inductor's rule registries differ from those it
# was last built from (a rule registered or replaced since); otherwise the call returns the
# singleton as it is, with the same attributes: 2 us a call. With both notes' patches GPT-2
# small's cold first step took 56.6 and 57.6 s against 57.9 and 58.2 s without (its backward's
# lowering 20.6 and 20.7 against 21.5 and 22.5 s; benchmarks/first_step.py, alternated, the AMD
# EPYC, 2026-11-27; in a noisier hour 57.1 and 67.8 against 65.3 and 69.4 s), GPT-2 d=256's
# 20.5 and 19.5 against 19.9 and 22.1 s. Set for dpfx's lowering only, and restored after.
# (tests/test_lowering_patches.py: the same generated code, the table rebuilt when a rule
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
# nodes that use one buffer (up to 64 pairs per node). dpfx's clip coefficient, a [B] buffer,
# is read by a kernel per parameter (GPT-2 small: 199 nodes), and each reads it at its own index,
# so no pair shares a dependency and every one is refused "no shared data", round after round:
# GPT-2 small's lowering asked 48,003 times, 23,352 of them again for a pair of unchanged nodes
# refused the round before (1.3 of 2.7 s). That refusal is a function of the pair alone: the
# checks before it (streams, node kinds, order, templates, devices) and the shared-data score it
# tests (exact dependencies, buffer overlap, nested and mixed-order reductions, speculative loop
# reordering, rolled back on a refusal) read the two nodes and Inductor's settings, never which
# other nodes have fused; and those checks only refuse, but for a template's multi-output
# fusion, itself a function of the pair. A node changes only by fusing (a new node) or by
# pruning (a new ``read_writes``). So during dpfx's lowering a plain or fused node pair refused
# for no shared data is refused again at once while both nodes and both ``read_writes`` objects
# are the ones it was refused with; every other question goes to Inductor. The same fusions,
# so the same generated code (tests/test_lowering_patches.py compares it, and checks each kept
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
# more than four buffers (``realize_reads_threshold``): every buffer it reads then lives until
# the last of those kernels. A ResNet's downsampling block sums the input gradients of its two
# convolutions (the 3x3 and the 1x1 shortcut read one activation), and the block before reads
# that sum, through the ReLU's mask, in its GroupNorm backward and again through its identity
# shortcut, kernels apart: both gradients were held through a whole block. In the GroupNorm
# ResNet's backward at B = 256 (9 convolutions, 32x32 images) three such 16.8 MB gradients were
# alive at dpfx's step peak (torch.compile's graph holds such a pair too, but its peak comes
# earlier). During dpfx's lowering a pointwise node with several readers is stored as a buffer
# where that lets at least two buffers of its size and dtype die at its kernel: buffers whose
# every reader is the node or a single-reader pointwise node inlined into it. It then holds one
# buffer where it held two or more, and its readers load it instead of computing it each from
# two or more loads, so neither the bytes held nor the loads grow (a buffer read only inside one
# fused kernel is not written at all: Inductor drops it); the values are the same (the same
# expression, computed once). The GroupNorm ResNet at B = 256 (the AMD EPYC, 2026-11-28,
# benchmarks/latest/step_ab_shared_sums.md): step memory 216.0 -> 205.2 MB (1.26 -> 1.19x
# torch.compile's 171.9), the step 3-6% faster (20 interleaved rounds, both orders); HF Llama's
# four residual sums are stored, its step and memory unchanged. Set for dpfx's lowering only,
# and restored after; dpfx's source digest keys Inductor's FX-graph cache.
# (tests/test_lowering_memory.py)
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


# Note [Inductor lowers the fake values dpfx proved]
# Inductor's ``codegen_and_compile`` opens by propagating fake values through the whole graph again
# (``additional_fake_tensor_prop``): 0.63 s of GPT-2 d=256's cold first step, each node on the
# unbacked batch's symbolic shapes. A graph dpfx hands over already
# carries every node's fake value: aot_autograd's, those dpfx's emitter computed for the nodes
# it added, and a warm start's rebuilt ones (Note [A warm start without the joint trace] in
# warm.py); the proof read exactly these. During dpfx's lowering, where every placeholder's value
# has the shape, strides and dtype of the compile's example input and every other node has a
# value (but an op without outputs, such as a runtime assert, which propagation gives none),
# Inductor lowers those values instead of recomputing them: what it lowers is then what was
# proved. Any other graph is propagated as Inductor does. The values are the ones the
# propagation gives: the test suite propagates again on the side in every lowering of a dpfx
# graph, compares every node's shape, strides and dtype, and lowers the kept values
# (tests/conftest.py), and
# tests/test_lowering_patches.py compares the generated code. Cold first steps (the AMD EPYC,
# 2026-11-28, one run each, benchmarks/latest/first_step_fake_values_kept.md): GPT-2 small 46.2 ->
# 44.8 s (its two lowerings 18.7 -> 16.7 s), GPT-2 d=256 16.1 -> 15.4 s. A warm start hits
# Inductor's FX-graph cache before the propagation. Set for dpfx's lowering only, and restored
# after.
_CHECK_KEPT_VALUES = False    # tests: propagate anyway and require the same values
_PROPAGATED = ("val", "unbacked_bindings")    # what Inductor's propagation writes on a node


@contextlib.contextmanager
def fake_values_kept():
    """Note [Inductor lowers the fake values dpfx proved]."""
    from torch._inductor import compile_fx as inductor

    propagate = getattr(inductor, "fake_tensor_prop", None)
    graphs: list[int] = []      # the node counts of the graphs lowered on their own values
    if propagate is None:
        yield graphs
        return

    def kept(gm, example_inputs, force_allow_non_fake_inputs=False):
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        if fake_mode is None or force_allow_non_fake_inputs or \
                not _values_complete(gm, example_inputs):
            return propagate(gm, example_inputs, force_allow_non_fake_inputs)
        if _CHECK_KEPT_VALUES:     # propagate on the side; lower on the kept values still
            kept_meta = {n: {k: n.meta[k] for k in _PROPAGATED if k in n.meta}
                         for n in gm.graph.nodes}
            propagate(gm, example_inputs, force_allow_non_fake_inputs)
            differ = [n.name for n, meta in kept_meta.items() if n.op != "output"
                      and _layout(meta.get("val")) != _layout(n.meta.get("val"))]
            for n, meta in kept_meta.items():
                for k in _PROPAGATED:
                    n.meta.pop(k, None)
                n.meta.update(meta)
            assert not differ, differ
        graphs.append(len(gm.graph.nodes))
        return fake_mode

    inductor.fake_tensor_prop = kept
    try:
        yield graphs
    finally:
        inductor.fake_tensor_prop = propagate


def _values_complete(gm: torch.fx.GraphModule, example_inputs) -> bool:
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        return False
    for node, value in zip(placeholders, example_inputs):
        val = node.meta.get("val")
        if isinstance(value, torch.Tensor) != isinstance(val, torch.Tensor) or \
                (isinstance(value, torch.Tensor) and _layout(val) != _layout(value)):
            return False
    return all("val" in n.meta or _returns_nothing(n) for n in gm.graph.nodes
               if n.op not in ("placeholder", "output"))


def _returns_nothing(node: torch.fx.Node) -> bool:
    """An op without outputs (``_assert_scalar``), which propagation gives no value either."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and not node.users and schema is not None \
        and len(schema.returns) == 0


def _layout(value):
    """A fake value's shape, strides, dtype and device as expressions (a structure of them)."""
    if isinstance(value, torch.Tensor):
        return (tuple(_expr(s) for s in value.shape), tuple(_expr(s) for s in value.stride()),
                value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return tuple(_layout(v) for v in value)
    if isinstance(value, torch.SymInt):
        return _expr(value)
    return value if isinstance(value, (int, float, bool, type(None))) else type(value)


def _expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else size


# Note [Optimization hints, computed once per expression]
# The partitioner and Inductor weigh their choices (the min-cut's node weights, a loop's
# parallel depth, memory planning) by an "optimization hint" of each size expression: a value
# for it, with the unbacked batch at Inductor's fallback (8192). For an expression that holds the
# unbacked batch, torch 2.13's ``_optimization_hint_base`` expands, factors and substitutes it
# with sympy on every call, though the expressions repeat: GPT-2 small's capture asked 17,246
# times for 96 distinct expressions, 1.2-1.4 s of its first step. During dpfx's capture each
# answer is kept, keyed by everything the function reads: the expression, the fallback (and
# Inductor's configured one, read when none is given), the shape environment and its version
# (the key torch keeps its own caches by: replacements, divisibility, runtime asserts), and each
# free symbol's replacement and value range. An expression with Inductor's precomputed sizes,
# or a shape environment without a version, is passed to torch's function each time. The same
# answers, so the same generated code (tests/test_lowering_patches.py compares it). Set for
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


def _assumption_error(expr) -> CaptureError:
    return CaptureError(
        f"Inductor could only compile this graph by assuming {expr} about the batch size, which "
        f"nothing would check at run time; dpfx refuses rather than run code that may mix "
        f"examples. Compile with backend='eager' (same private graph, not lowered by Inductor) "
        f"and report the expression above.")
