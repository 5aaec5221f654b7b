"""dpfx's lowering patches that only shorten the compile: Note [Vector strides of polynomial
indices] (dpfx's stride of a polynomial index is Inductor's: the same Integer where Inductor finds
a constant, an equal expression otherwise; other indices are Inductor's own answer), Note
[Inductor's dtype rules, set up once] (the table rebuilt when a rule changes), Note [Fusion
refusals kept across Inductor's fusion rounds] (each kept refusal Inductor's own), Note
[Optimization hints, computed once per expression] (torch's answer, asked again when what it
reads changes) and Note [Inductor lowers the fake values dpfx proved] (every node's value the one
Inductor's propagation gives) in dpfx/lower/inductor.py. The code dpfx's lowering generates is the same
with and without them."""
import contextlib

import sympy
import torch
from hypothesis import given, settings, strategies as st
from torch._inductor.codegen import cpp
from torch._inductor.utils import run_and_get_code
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

import dpfx
import dpfx.backend
from dpfx.lower import codegen_patches as lower_codegen, shape_patches as lower_shapes
from support.models import ResNetGN, SeqModel, mse, xent
from support.reference import assert_close, dp_sgd_grads, run_dpfx

INDUCTOR = cpp.stride_at_vec_range
# as Inductor makes them: loop variables nonnegative integers, the unbacked batch an integer
LOOP = [sympy.Symbol(n, integer=True, nonnegative=True) for n in ("x0", "x1", "d2")]
SIZES = [sympy.Symbol("u0", integer=True), sympy.Symbol("s1", integer=True, positive=True)]


@st.composite
def polynomials(draw):
    """A sum of terms c * (product of loop variables and sizes), degree at most 2 per symbol."""
    terms = []
    for _ in range(draw(st.integers(1, 5))):
        term = sympy.Integer(draw(st.integers(-4096, 4096)))
        for sym in LOOP + SIZES:
            term *= sym ** draw(st.sampled_from([0, 0, 1, 1, 2]))
        terms.append(term)
    return sympy.Add(*terms)


@settings(max_examples=150, deadline=None)
@given(index=polynomials(), var=st.sampled_from(LOOP), vec=st.sampled_from([None, 4, 8, 16]))
def test_polynomial_strides_match_inductor(index, var, vec):
    fast = lower_codegen._polynomial_strides(INDUCTOR)
    got, want = fast(index, var, vec), INDUCTOR(index, var, vec)
    if want.is_number:
        assert got == want and got.is_Integer == want.is_Integer
    else:
        assert not got.is_number and sympy.expand(got - want) == 0


def test_affine_indices_of_an_unbacked_batch():
    """Indices as the LSTM's, GPT-2's and the ResNet's kernels hold them."""
    x0, x1, d2 = LOOP
    u0 = SIZES[0]
    fast = lower_codegen._polynomial_strides(INDUCTOR)
    for index, var in [(512 * x0 + x1 + 8192 * u0 + 384, x0), (512 * x0 * u0 + x1, x0),
                       (64 * x0 + 64 * x1 * u0 + d2, x1), (x1 + 256 * d2, x1), (7 * u0 + 3, x0)]:
        assert fast(index, var, 16) == INDUCTOR(index, var, 16)


def test_other_indices_are_inductors():
    x0, x1, _ = LOOP
    u0 = SIZES[0]
    calls = []

    def inductors(index, var, vec_length=None):
        calls.append(index)
        return INDUCTOR(index, var, vec_length)

    fast = lower_codegen._polynomial_strides(inductors)
    for index in [32768 * x0 + 8192 * FloorDiv(x1, 64) + ModularIndexing(x1, 1, 64),
                  8 * x0 + FloorDiv(x1, 2) + u0]:
        assert fast(index, x1, 16) == INDUCTOR(index, x1, 16)
        assert calls[-1] is index
    assert fast(3 * x0 + x1, x1, 16) == 1 and len(calls) == 2


def test_dtype_rules_built_once_until_a_rule_changes():
    from torch._inductor import utils
    from torch._inductor.dtype_propagation import DtypePropagationOpsHandler

    builds = []
    inductors = DtypePropagationOpsHandler.__init__

    def counted(self):
        builds.append(1)
        inductors(self)

    DtypePropagationOpsHandler.__init__ = counted
    try:
        with lower_codegen.dtype_rules_once():
            first = DtypePropagationOpsHandler()
            for _ in range(3):
                assert DtypePropagationOpsHandler() is first
            assert len(builds) <= 1
            seen = len(builds)
            rule = next(iter(utils.op_dtype_propagation_rules.values()))
            utils.op_dtype_propagation_rules["dpfx_test_op"] = rule
            try:
                DtypePropagationOpsHandler()
                assert len(builds) == seen + 1 and hasattr(first, "dpfx_test_op")
            finally:
                del utils.op_dtype_propagation_rules["dpfx_test_op"]
            DtypePropagationOpsHandler()
            assert len(builds) == seen + 2
        assert DtypePropagationOpsHandler.__init__ is counted
        DtypePropagationOpsHandler()
        assert len(builds) == seen + 3
    finally:
        DtypePropagationOpsHandler.__init__ = inductors


def test_optimization_hints_once_per_expression_and_state():
    from torch._inductor import sizevars
    from torch.fx.experimental import _size_hinting, symbolic_shapes
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._sympy.symbol import SymT, make_symbol
    from torch.utils._sympy.value_ranges import ValueRanges

    inductors = _size_hinting._optimization_hint_base
    env = ShapeEnv()
    u0 = env.create_unbacked_symint().node.expr
    u1 = env.create_unbacked_symint().node.expr
    ps0 = make_symbol(SymT.PRECOMPUTED_SIZE, 0, integer=True, positive=True)
    exprs = [98304 * u0, 128 * u0 + 7, u0 * u1 + 3, FloorDiv(u0, 4), ModularIndexing(1, 128, u0),
             sympy.Integer(5)]
    calls = []

    def counted(shape_env, expr, precomputed_replacements, fallback=None):
        calls.append(expr)
        return inductors(shape_env, expr, precomputed_replacements, fallback)

    modules = (_size_hinting, symbolic_shapes, sizevars)
    saved = [m._optimization_hint_base for m in modules]
    for m in modules:
        m._optimization_hint_base = counted
    try:
        want = {(e, f): inductors(env, e, {}, f) for e in exprs for f in (None, 0, 42)}
        with lower_codegen.optimization_hints_once():
            assert symbolic_shapes._optimization_hint_base is not counted
            assert sizevars._optimization_hint_base is not counted
            for _ in range(3):
                for e in exprs:
                    for f in (None, 0, 42):
                        assert env.optimization_hint(e, fallback=f) == want[e, f]
            assert len(calls) == len(want)     # each (expression, fallback) once
            # Inductor's configured fallback is part of the key where none is given
            with torch._inductor.config.patch(unbacked_symint_fallback=100):
                assert env.optimization_hint(128 * u0 + 7) == 128 * 100 + 7
            # a narrower range of a symbol is read again
            n = len(calls)
            env.var_to_range[u0] = ValueRanges(2, 16)
            assert env.optimization_hint(98304 * u0) == 98304 * 16
            assert env.optimization_hint(98304 * u0, fallback=42) == 98304 * 16
            assert len(calls) == n + 2
            n = len(calls)
            env.optimization_hint(ps0 * u0, fallback=42)     # precomputed sizes: not kept
            env.optimization_hint(ps0 * u0, fallback=42)
            assert len(calls) == n + 2
        assert [m._optimization_hint_base for m in modules] == [counted] * 3
    finally:
        for m, before in zip(modules, saved):
            m._optimization_hint_base = before


def _lowered_code(model, loss_fn, x, y, patched: bool, monkeypatch, check: bool = True):
    """The gradients and generated modules of a dpfx step, Inductor's ``can_fuse`` calls and
    dpfx's kept refusals in its lowering, and the graphs lowered on their own fake values."""
    from torch._inductor.scheduler import Scheduler

    inductors = Scheduler.can_fuse
    asked, kept, lowered_on_own_values = [], [], []

    def counted(self, *args, **kwargs):
        asked.append(1)
        return inductors(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "can_fuse", counted)
    if patched:
        keeping, values_kept = lower_codegen.fusion_refusals_kept, lower_shapes.fake_values_kept

        @contextlib.contextmanager
        def recorded():
            with keeping() as refused:
                yield refused
                kept.append(len(refused))

        @contextlib.contextmanager
        def values_recorded():
            with values_kept() as graphs:
                yield graphs
                lowered_on_own_values.extend(graphs)

        monkeypatch.setattr(lower_codegen, "fusion_refusals_kept", recorded)
        monkeypatch.setattr(lower_codegen, "_CHECK_KEPT_REFUSALS", check)
        monkeypatch.setattr(lower_shapes, "fake_values_kept", values_recorded)
        monkeypatch.setattr(lower_shapes, "_CHECK_KEPT_VALUES", check)
    else:
        monkeypatch.setattr(lower_codegen, "polynomial_vector_strides", contextlib.nullcontext)
        monkeypatch.setattr(lower_codegen, "dtype_rules_once", contextlib.nullcontext)
        monkeypatch.setattr(lower_codegen, "fusion_refusals_kept", contextlib.nullcontext)
        monkeypatch.setattr(lower_shapes, "fake_values_kept", lambda: contextlib.nullcontext([]))
        monkeypatch.setattr(dpfx.backend, "optimization_hints_once", contextlib.nullcontext)
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=3)
    with torch._inductor.config.patch(force_disable_caches=True):
        grads, codes = run_and_get_code(run_dpfx, dp, model, loss_fn, x, y)
    monkeypatch.undo()
    assert Scheduler.can_fuse is inductors
    # every compile gets the next AOT id, named in the module's first line
    return grads, [c.split("\n", 1)[1] for c in codes], len(asked), sum(kept), \
        lowered_on_own_values


def test_same_code_and_gradients_through_inductor(monkeypatch):
    """dpfx's lowering generates the same C++ with its compile-time patches as without, gives
    the DP-SGD gradient of a batch-of-one loop (clipping biting), uses the fast strides, asks
    Inductor again about no pair it kept a refusal of (and Inductor, asked, refuses each again),
    and leaves Inductor's functions in place after."""
    from torch._inductor.dtype_propagation import DtypePropagationOpsHandler
    from torch._inductor.scheduler import WhyNoFuse

    dtype_init, why_call = DtypePropagationOpsHandler.__init__, WhyNoFuse.__call__
    propagate = torch._inductor.compile_fx.fake_tensor_prop
    not_asked = 0
    for model, loss_fn, x, y in [
            (SeqModel(), mse, torch.randn(3, 6, 8), torch.randn(3, 4)),
            (ResNetGN(), xent, torch.randn(3, 1, 8, 8), torch.randint(0, 3, (3,)))]:
        torch.manual_seed(0)
        want = dp_sgd_grads(model, loss_fn, x, y, max_grad_norm=0.05, expected_batch_size=3)
        lower_codegen._polynomial_strides.cache_clear()
        got, fast_code, asked_checked, kept, own_values = _lowered_code(model, loss_fn, x, y,
                                                                        True, monkeypatch)
        assert len(own_values) == 2       # the forward and the backward, values compared
        assert lower_codegen._polynomial_strides.cache_info().currsize == 1
        assert lower_codegen._polynomial_strides(INDUCTOR).cache_info().misses > 0
        assert cpp.stride_at_vec_range is INDUCTOR
        assert DtypePropagationOpsHandler.__init__ is dtype_init
        assert WhyNoFuse.__call__ is why_call
        assert torch._inductor.compile_fx.fake_tensor_prop is propagate
        assert_close(got, want)
        got_plain, plain_code, asked_plain, _, none = _lowered_code(model, loss_fn, x, y, False,
                                                                   monkeypatch)
        assert none == []
        assert_close(got_plain, want)
        assert len(fast_code) == len(plain_code) >= 2
        assert fast_code == plain_code
        # the same questions, each kept refusal asked again as well (and refused again)
        assert kept > 0 and asked_checked == asked_plain
        got_kept, kept_code, asked_kept, _, _ = _lowered_code(model, loss_fn, x, y, True,
                                                              monkeypatch, check=False)
        assert_close(got_kept, want)
        assert kept_code == plain_code and asked_kept <= asked_plain
        not_asked += asked_plain - asked_kept
    assert not_asked > 0     # some kept refusal was answered without Inductor
