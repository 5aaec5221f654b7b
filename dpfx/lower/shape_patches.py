"""Patches to how Inductor treats the shapes of dpfx's graphs (torch 2.13): no unchecked
assumption about the unbacked batch, bmm operands made contiguous where a stride test would guard
it, and the fake values dpfx proved lowered as they are. Without them Inductor's code could differ
from the proven graph.

    with no_unchecked_assumptions(shape_env), bmm_operands_contiguous(), fake_values_kept():
        compiled = compile_fx_inner(gm, example_inputs)        # (lower/inductor.py)

Each patch closes a way the code torch 2.13 generates for an unbacked batch could differ from the
proven graph, and says so in its Note; each is set for dpfx's lowering only and restored after.
When torch is upgraded, a patch may go once the behaviour its Note describes is gone from that
torch: the tests its Note names reproduce the behaviour without the patch.

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
that prints the expression. Reproduction: tests/lower/test_inductor_exact.py.

Closing that hole uncovered one more site that had only worked because of the wrong range:
Inductor's bmm lowering asks whether an operand's layout suits the CPU kernel with a plain Python
comparison of its strides (``48*u0 >= 48``), a hard guard on the batch. The answer only decides
whether to copy the operand to contiguous first, so ``bmm_operands_contiguous`` makes that copy
for operands whose matrix dims' sizes or strides hold an unbacked symbol, and the question is never
asked; an operand whose batch appears only in dim 0 is left to Inductor's test, which then compares
plain integers.
"""
from __future__ import annotations

import contextlib

import sympy
import torch
from torch._inductor.virtualized import V
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from dpfx.errors import CaptureError

# The patches of this module, in the order lower() enters them; lower/inductor.py stacks them.
TORCH_VERSIONS = {"no_unchecked_assumptions": "2.13", "bmm_operands_contiguous": "2.13",
                  "fake_values_kept": "2.13"}


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


def unchecked(e: BaseException) -> UncheckedAssumption | None:
    cause = e
    while cause is not None and not isinstance(cause, UncheckedAssumption):
        cause = cause.__cause__ or cause.__context__
    return cause


# Note [Inductor lowers the fake values dpfx proved]
# Inductor's ``codegen_and_compile`` opens by propagating fake values through the whole graph again
# (``additional_fake_tensor_prop``), each node on the unbacked batch's symbolic shapes, a noticeable
# part of a cold first step. A graph dpfx hands over already carries every node's fake value:
# aot_autograd's, those dpfx's emitter computed for the nodes it added, and a warm start's rebuilt
# ones (Note [A warm start without the joint trace] in lower/warm.py); the proof read exactly these.
# During dpfx's lowering, where every placeholder's value has the shape, strides and dtype of the
# compile's example input and every other node has a value (but an op without outputs, such as a
# runtime assert, which propagation gives none), Inductor lowers those values instead of recomputing
# them: what it lowers is then what was proved. Any other graph is propagated as Inductor does. The
# values are the ones the propagation gives: the test suite propagates again on the side in every
# lowering of a dpfx graph, compares every node's shape, strides and dtype, and lowers the kept
# values (tests/conftest.py), and tests/lower/test_lowering_patches.py compares the generated code
# (figures: BENCHMARKS.md, "First step, cold"). A warm start hits Inductor's FX-graph cache before
# the propagation. Set for dpfx's lowering only, and restored after.
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
               if n.op not in ("placeholder", "output")) and not _stale_after_fusion(gm)


# Note [Values made stale by a fused attention]
# Inductor's joint-graph pattern passes replace an attention written out by hand (softmax(q k^T)
# v, nanoGPT's) with one fused attention kernel (and its backward), whose outputs have the
# kernel's strides; the
# nodes reading it keep the values aot_autograd traced on the old output (a permute of the
# kernel's (B, H, T, D) output kept strides (40, 4, 20, 1) where they are now (40, 8, 4, 1)),
# and the staleness reaches further down (a view two nodes on). Lowering those kept values
# would lower strides that are not the ones computed. A graph holding an attention kernel that
# the pattern matcher wrote (its provenance says so), or one whose direct readers computed
# again from its value differ from their kept values, is propagated as Inductor does. The
# self-check ran the same code against the FX graph and agreed (2e-9 on the model of the
# test); the strides were only ever a risk to an extern kernel's layout.
# (tests/lower/test_inductor_exact.py::test_hand_written_attention_fused_by_inductor)
_ATTENTION_KERNELS = tuple(
    getattr(torch.ops.aten, name + suffix).default for name in (
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    for suffix in ("", "_backward") if hasattr(torch.ops.aten, name + suffix))


# the provenance (node.meta["from_node"]) the pattern matcher's replacement gives its nodes
_PATTERN_REPLACEMENT = "Interpreter_CopyGraph"


def _stale_after_fusion(gm: torch.fx.GraphModule) -> bool:
    import operator

    for attention in gm.graph.nodes:
        if attention.op != "call_function" or attention.target not in _ATTENTION_KERNELS:
            continue
        if any(getattr(f, "pass_name", None) == _PATTERN_REPLACEMENT
               for f in attention.meta.get("from_node", ())[:1]):
            return True     # written by a pattern: what reads it was traced on other values
        for item in attention.users:
            if item.target is not operator.getitem:
                continue
            for user in item.users:
                if user.op != "call_function" or not isinstance(
                        user.target, torch._ops.OpOverload):
                    continue
                try:
                    val = torch.fx.node.map_arg((user.args, user.kwargs),
                                                lambda n: n.meta.get("val"))
                    fresh = user.target(*val[0], **val[1])
                except Exception:
                    return True
                if _layout(fresh) != _layout(user.meta.get("val")):
                    return True
    return False


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


def assumption_error(expr) -> CaptureError:
    return CaptureError(
        f"Inductor could only compile this graph by assuming {expr} about the batch size, which "
        f"nothing would check at run time; dpfx refuses rather than run code that may mix "
        f"examples. Compile with backend='eager' (same private graph, not lowered by Inductor) "
        f"and report the expression above.")
