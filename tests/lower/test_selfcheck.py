"""The self-check of the compiled code (Note [Checking what Inductor generated] in
dpfx/lower/selfcheck/) against deliberately miscompiled graphs, and against the real torch bug that
motivated it with dpfx's own fix switched off."""
import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
import dpfx.backend
import dpfx.lower.inductor
from torch._dynamo.utils import counters
from support.models import MLP, MHAHead, mse
from support.reference import assert_close, dp_sgd_grads, run_dpfx


def _miscompile(monkeypatch, which: str, corrupt):
    """Wrap dpfx's lowering so that the compiled forward or backward returns corrupt(outputs)."""
    real_lower = dpfx.backend.lower

    def lower(gm, example_inputs, kwargs, backend):
        compiled = real_lower(gm, example_inputs, kwargs, backend)
        if bool(kwargs.get("is_backward")) != (which == "backward"):
            return compiled

        def wrong(args):
            return corrupt(list(compiled(args)))

        wrong._boxed_call = True
        return wrong

    monkeypatch.setattr(dpfx.backend, "lower", lower)


def _roll_first_output(outs):
    """Example i's output becomes example i-1's: the forward mixes examples."""
    outs[0] = outs[0].roll(1, 0)
    return outs


def _nudge_gradients(outs):
    return [o * 1.01 if isinstance(o, torch.Tensor) and o.is_floating_point() else o
            for o in outs]


@pytest.mark.parametrize("which,corrupt,match,expected", [
    ("forward", _roll_first_output, "adding an example|changing example 0|disagrees", None),
    ("backward", _nudge_gradients, "compiled backward graph disagrees", None),
    # DP gradients at a realistic scale: entries of order C/D, far below 1.
    ("backward", _nudge_gradients, "compiled backward graph disagrees", 256),
], ids=["forward", "backward", "backward-dp-scale"])
def test_miscompiled_graph_refused_before_training(monkeypatch, which, corrupt, match, expected):
    _miscompile(monkeypatch, which, corrupt)
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0,
                      expected_batch_size=expected)
    with pytest.raises(dpfx.PrivacyError, match=match):
        mse(dp(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _at_the_larger_size(corrupt):
    """``corrupt`` applied to the outputs of a call whose first input has 3 rows only: code
    wrong at one batch size, right at the other."""
    def at_three(outs, args):
        three = any(isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == 3 for a in args)
        return corrupt(outs) if three else outs
    return at_three


def _miscompile_with_args(monkeypatch, which: str, corrupt):
    real_lower = dpfx.backend.lower

    def lower(gm, example_inputs, kwargs, backend):
        compiled = real_lower(gm, example_inputs, kwargs, backend)
        if bool(kwargs.get("is_backward")) != (which == "backward"):
            return compiled

        def wrong(args):
            seen = list(args)
            return corrupt(list(compiled(args)), seen)

        wrong._boxed_call = True
        return wrong

    monkeypatch.setattr(dpfx.backend, "lower", lower)


def _scale_gradients(outs):
    return [o * 4.0 if isinstance(o, torch.Tensor) and o.is_floating_point() else o
            for o in outs]


@pytest.mark.parametrize("which,corrupt,match", [
    ("forward", _roll_first_output, "adding an example before the others changed"),
    ("backward", _scale_gradients, "one example added to a batch of 2 moved"),
], ids=["forward-mixes", "backward-scales"])
def test_code_wrong_at_the_larger_size_only_is_refused(monkeypatch, which, corrupt, match):
    """Note [The second size grows the first]: the larger size is compared with the smaller,
    not with the eager reference; code that mixes examples or moves the release by more than C
    there alone is still refused."""
    _miscompile_with_args(monkeypatch, which, _at_the_larger_size(corrupt))
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(dpfx.PrivacyError, match=match) as refused:
        mse(dp(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    assert all(p.grad is None for p in model.parameters())
    # Note [The self-check blames only what it has shown]: the verified graph passes on the
    # same batches, so the generated code is named
    assert "did not" in str(refused.value) or "run eagerly on the same batches, moved it by" \
        in str(refused.value)
    assert "not the graph dpfx proved" in str(refused.value)
    assert "fault is in dpfx" not in str(refused.value)


def test_a_grown_failure_blames_what_the_reference_shows(monkeypatch):
    """Note [The self-check blames only what it has shown]: with the grown comparison's own
    premise broken (the smaller size's output gradients not given the mean's 1/B, Note [A
    mean's output gradients carry 1/B]), the verified graph run eagerly moves the release as
    much as the compiled code does, so the error names dpfx, not the code torch generated.
    The same check with the premise intact passes at every one of these bounds
    (tests/lower/test_selfcheck_sweep.py)."""
    monkeypatch.setattr(dpfx.lower.selfcheck.grow, "_tangent_scale",
                        lambda check, large, small: 1.0)
    refused = []
    for clip in (0.3, 1.0, 3.0):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                              nn.Linear(32, 1))
        dp = dpfx.compile(model, max_grad_norm=clip, noise_multiplier=0.0, self_check="always")
        try:
            F.mse_loss(dp(torch.randn(7, 10)), torch.randn(7, 1)).backward()
        except dpfx.PrivacyError as e:
            refused.append(str(e))
            assert all(p.grad is None for p in model.parameters())
    assert refused, "the broken premise was refused at no bound: nothing was planted"
    for message in refused:
        assert "one example added to a batch of 2 moved" in message, message
        assert "the fault is in dpfx" in message and "torch bug" not in message, message


def _spy_on_comparisons(monkeypatch) -> list:
    """The graphs the self-check compares, in order ("forward", "backward"), as it compares them."""
    real_compare, compared = dpfx.lower.selfcheck.check.compare, []

    def compare(which, *args, **kwargs):
        compared.append(which)
        return real_compare(which, *args, **kwargs)

    monkeypatch.setattr(dpfx.lower.selfcheck.check, "compare", compare)
    return compared


def test_opt_out(monkeypatch):
    _miscompile(monkeypatch, "backward", _nudge_gradients)
    compared = _spy_on_comparisons(monkeypatch)
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, self_check=False)
    mse(dp(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    assert model.fc1.weight.grad is not None
    assert compared == []


def test_passes_a_correct_graph_with_noise(monkeypatch):
    """Graph noise on CPU: the self-check compares the backward with the noise silenced (Note
    [The self-check's backward runs without noise]) and accepts it; the step that follows is
    noised: its gradient is the noise-free DP-SGD gradient plus noise of std sigma C / D."""
    compared = _spy_on_comparisons(monkeypatch)
    model = MLP(d_in=8, hidden=64)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    want = dp_sgd_grads(model, mse, x, y, max_grad_norm=1.0, expected_batch_size=4)
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=2.0, expected_batch_size=4,
                      self_check="always")    # the check is under test, on code it may have passed
    got = run_dpfx(dp, model, mse, x, y)
    assert "forward" in compared and "backward" in compared, compared
    noise = torch.cat([(got[k] - want[k]).flatten() for k in want])
    assert abs(float(noise.std()) / (2.0 * 1.0 / 4) - 1) < 0.15     # 836 draws


def test_self_check_leaves_the_users_random_stream():
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0)
    torch.manual_seed(7)
    mse(dp(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    after = torch.rand(3)
    torch.manual_seed(7)
    torch.randn(4, 8), torch.randn(4, 4)
    torch.testing.assert_close(after, torch.rand(3))


def test_self_check_runs_outside_the_first_calls_dispatch_modes(monkeypatch):
    """Note [The self-check runs outside the first call's dispatch modes]: aot_autograd's
    custom-op aliasing mode wraps the compiled forward's first call, where the check runs; none
    of the check's graph runs may pay for it (it made GPT's self-check 3x slower)."""
    import dpfx.lower.selfcheck

    real_call, modes = dpfx.lower.selfcheck.batches.call_boxed, []

    def call(fn, args, device, consume=False):
        modes.append(len(torch.utils._python_dispatch._get_current_dispatch_mode_stack()))
        return real_call(fn, args, device, consume)

    monkeypatch.setattr(dpfx.lower.selfcheck.check, "call_boxed", call)
    monkeypatch.setattr(dpfx.lower.selfcheck.grow, "call_boxed", call)
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, self_check="always")
    mse(dp(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    assert modes and set(modes) == {0}


def test_catches_the_real_torch_miscompile(tmp_path, monkeypatch):
    """With dpfx's lowering fix switched off, torch 2.13 compiles the MHA head split assuming
    B == 1: a cold cache fails on a guard, and a warm cache runs code that mixes examples. The
    self-check must refuse the warm-cache code before it trains."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(dpfx.lower.shape_patches, "no_unchecked_assumptions",
                        lambda env: contextlib.nullcontext())
    monkeypatch.setattr(dpfx.lower.shape_patches, "bmm_operands_contiguous", contextlib.nullcontext)
    # AOTAutogradCache off (Note [A warm start without the joint trace] in lower/warm.py): with it,
    # the third attempt stops at the first attempts' guard instead, before any code runs
    with torch._functorch.config.patch(enable_autograd_cache=False):
        _miscompiled_only_on_a_warm_cache()


def _miscompiled_only_on_a_warm_cache():
    torch.manual_seed(0)
    model = MHAHead()
    x, y = torch.randn(5, 7, 16), torch.randint(0, 3, (5,))
    # Cold: the forward's lowering narrows B to [1, 2] and the guard fails; the next attempt
    # finds the forward cached and fails again lowering the backward; the third finds both
    # cached, no guard is made, and the miscompiled code would run.
    for attempt in range(2):
        torch._dynamo.reset()
        with pytest.raises(AssertionError, match="Guard failed on the same frame"):
            dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0)(x)
    torch._dynamo.reset()
    hits = counters["inductor"]["fxgraph_cache_hit"]
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(dpfx.PrivacyError, match="self-check"):
        F.cross_entropy(dp(x), y).backward()
    assert counters["inductor"]["fxgraph_cache_hit"] - hits == 2
    assert all(p.grad is None for p in model.parameters())


def test_fixed_lowering_passes_the_self_check(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    model = MHAHead()
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0)
    x, y = torch.randn(5, 7, 16), torch.randint(0, 3, (5,))
    assert_close(run_dpfx(dp, model, F.cross_entropy, x, y),
                 dp_sgd_grads(model, F.cross_entropy, x, y, max_grad_norm=0.05),
                 rtol=1e-4, atol=1e-6)
    assert all(c.done for c in dp._dpfx_backend._checks.values())
    assert dp._dpfx_backend._checks


@pytest.mark.parametrize("batch", [5, 8])
def test_non_contiguous_input_is_checked(batch):
    """The self-check's synthetic inputs have the strides the graph was compiled for (it asserts
    them): a transposed input (strides (1, B)) used to fail the check's own call. The grads equal
    the reference through Inductor, at a batch size equal to the feature count too."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    x = (torch.randn(8, batch) * 4).t()
    y = torch.randint(0, 3, (batch,))
    assert not x.is_contiguous()
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=0.0)
    assert_close(run_dpfx(dp, model, F.cross_entropy, x, y),
                 dp_sgd_grads(model, F.cross_entropy, x, y, max_grad_norm=0.1))


def test_comparison_lines_up_nans_and_infinities():
    """Note [The self-check's comparisons are few passes over the data]: finite outputs take the
    short path, an output holding a NaN or an infinity the one that lines them up."""
    from dpfx.lower.selfcheck.compare import close as _close

    want = torch.randn(64, 32) * 1e-3
    near = want + 1e-9 * torch.randn(64, 32)
    assert _close(near, want, 1e-3, 1e-3) and not _close(want * 1.01, want, 1e-3, 1e-3)
    for bad in (float("nan"), float("inf")):
        y, x = want.clone(), near.clone()
        y[3, 4] = x[3, 4] = bad
        assert _close(x, y, 1e-3, 1e-3) and not _close(x, want, 1e-3, 1e-3)
    elsewhere = y.clone()
    elsewhere[3, 4], elsewhere[5, 6] = 0.0, float("nan")
    y[3, 4] = float("nan")
    assert not _close(elsewhere, y, 1e-3, 1e-3)


@pytest.mark.parametrize("case", ["plain", "offset", "strided", "tail", "overflow", "tiny",
                                  "inf", "nan", "mixed"])
def test_norm_in_float32_rows_matches_float64(case):
    """Note [Norms in float32 rows, summed in float64]: as accurate as a float64 norm wherever
    float32 squares are exact enough, and the float64 norm where they are not."""
    from dpfx.lower.selfcheck.compare import _raw_norm

    g = torch.Generator().manual_seed(0)
    t = torch.randn(3001, 1024, generator=g)
    if case == "offset":        # one sign: no cancellation to hide an error
        t = t.abs() * 3 + 7
    elif case == "strided":     # a non-contiguous view is read as it is
        t = torch.randn(2048, 3000, generator=g)[::2, ::3]
    elif case == "tail":        # not a whole number of rows
        t = torch.randn(1024 * 37 + 555, generator=g)
    elif case == "overflow":    # finite entries whose float32 squares overflow
        t = t * 1e20
    elif case == "tiny":        # entries whose float32 squares underflow
        t = t * 1e-25
    elif case == "mixed":       # a few large entries among many tiny ones
        t = t * 1e-21
        t[7, :4] = torch.tensor([1e-16, -2e-16, 3e-16, 1e-16])
    elif case in ("inf", "nan"):
        t[1500, 17] = float(case)
    want = float(torch.linalg.vector_norm(t.double()))
    got = _raw_norm(t)
    if case == "nan":
        assert math.isnan(got)
    elif case == "inf":
        assert got == float("inf")
    else:
        assert got > 0 and abs(got - want) <= 1e-6 * want, (got, want)


@pytest.mark.parametrize("case", ["chunks", "permuted", "strides_differ", "gapped_view",
                                  "equal", "zero", "tiny_gap", "overflow", "nan", "inf_both",
                                  "float64", "small"])
def test_gap_and_norm_match_float64(case):
    """Note [The self-check's comparisons stream through the cache]: ||x - y|| and ||y||, taken
    in chunks over paired memory, are the float64 norms of y and of the float32 difference,
    exact where float32 squares lose; other layouts take x - y, with the same results."""
    from dpfx.lower.selfcheck.compare import _CHUNK, _gap_and_norm, _paired

    g = torch.Generator().manual_seed(0)
    y = torch.randn(3 * _CHUNK + 555, generator=g)
    x = y + 1e-4 * torch.randn(y.shape, generator=g)
    if case == "permuted":            # both transposed alike: paired by memory order
        y, x = (t[:1024 * 700].view(700, 1024).t() for t in (y, x))
    elif case == "strides_differ":    # one row-major, one transposed: x - y
        y, x = y[:1024 * 700].view(700, 1024), x[:1024 * 700].view(700, 1024)
        x = torch.empty(1024, 700).t().copy_(x)
    elif case == "gapped_view":       # every other column: not dense
        y, x = y[:2048 * 300].view(300, 2048)[:, ::2], x[:2048 * 300].view(300, 2048)[:, ::2]
    elif case == "equal":             # a gap of exactly 0
        x = y.clone()
    elif case == "zero":
        y = torch.zeros_like(y)
    elif case == "tiny_gap":          # a gap (and a y) whose float32 squares underflow
        y = y * 1e-30
        x = y.clone()
        x[::1000] *= 1 + 2 ** -10
    elif case == "overflow":          # finite entries whose float32 squares overflow
        y, x = y * 1e20, x * 1e20
    elif case == "nan":               # a NaN on the compiled side alone
        x[1234] = float("nan")
    elif case == "inf_both":
        x[99], y[99] = float("inf"), float("inf")
    elif case == "float64":
        y, x = y.double(), x.double()
    elif case == "small":             # under two rows
        y, x = y[:1500], x[:1500]
    assert (_paired(x, y) is not None) == (case not in ("strides_differ", "gapped_view"))
    gap, norm = _gap_and_norm(x, y)
    want_norm = float(torch.linalg.vector_norm(y.double()))
    diff = (x - y).double()
    want_gap = float(torch.linalg.vector_norm(diff))
    if case == "inf_both":
        assert norm == float("inf") and math.isnan(gap)
        return
    assert abs(norm - want_norm) <= 1e-6 * want_norm
    if case == "nan":
        assert math.isnan(gap)
    elif case == "equal":
        assert gap == 0.0
    else:
        assert gap > 0 and abs(gap - want_gap) <= 1e-6 * want_gap, (gap, want_gap)


def _shift_clipped_sums(norm):
    """Adds to the released gradients a vector of total norm ``norm``, spread evenly: what a
    wrong clipped sum of that size adds, the noise left as it was."""
    def corrupt(outs):
        floats = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
        n = sum(o.numel() for o in floats)
        return [o + norm / n ** 0.5 if isinstance(o, torch.Tensor) and o.is_floating_point()
                else o for o in outs]
    return corrupt


def test_noise_does_not_hide_a_wrong_clipped_sum(monkeypatch):
    """Note [The self-check's backward runs without noise]: the 2048 x 2048 weight's noise has a
    norm of about 2,000 C / D, so a tolerance relative to the noisy gradient would pass a clipped
    sum off by C / D (a whole example's contribution). The check compares the noise-free release."""
    C, D = 1.0, 4
    _miscompile(monkeypatch, "backward", _shift_clipped_sums(C / D))
    model = nn.Sequential(nn.Linear(8, 2048), nn.Tanh(), nn.Linear(2048, 2048), nn.Tanh(),
                          nn.Linear(2048, 4))
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=1.0, expected_batch_size=D)
    with pytest.raises(dpfx.PrivacyError, match="compiled backward graph disagrees"):
        mse(dp(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    assert all(p.grad is None for p in model.parameters())


def _checks_of(monkeypatch) -> list:
    """The GraphChecks that run, as they run."""
    real_run, seen = dpfx.lower.selfcheck.GraphCheck.run, []

    def run(self, args):
        seen.append(self)
        return real_run(self, args)

    monkeypatch.setattr(dpfx.lower.selfcheck.GraphCheck, "run", run)
    return seen


def test_reference_releases_each_gradient_as_it_is_computed(monkeypatch):
    """Note [The eager reference compares each gradient as it is released]: the eager backward
    hands every parameter's gradient to the comparison as soon as its clipped sum exists, so no
    two clipped sums are alive at once, and returns none of them; the check still refuses a
    gradient 1% off (test_miscompiled_graph_refused_before_training runs this same path)."""
    seen = _checks_of(monkeypatch)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0)
    mse(dp(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    half = seen[0].backward
    grads = {i for i, name in enumerate(half.outputs) if name is not None}
    assert len(grads) == 6 and set(half.streamed) == grads
    graph = half.reference.graph
    assert all(o is None for o in graph.find_nodes(op="output")[0].args[0])
    live, most = set(), 0
    for node in graph.nodes:
        if node.target is torch.ops.higher_order.auto_functionalized_v2:
            assert len(node.kwargs["_all_bases"]) == 1
            assert node.kwargs["_only_clone_these_bases"] == ()
            live |= set(node.kwargs["_all_bases"])
            most = max(most, len(live))
        elif node.target is dpfx.lower.selfcheck.stream.record:
            live.clear()
    assert most == 1


def test_record_refuses_outside_the_checks_noiseless_run():
    """One release call per sum is the whole release only without noise."""
    from dpfx.lower.selfcheck.stream import record as _record, recording as _recording

    with pytest.raises(RuntimeError, match="outside the check"):
        _record(0, torch.ones(3))
    _recording.got, _recording.measured = [torch.ones(3)], {}
    try:
        with pytest.raises(RuntimeError, match="outside the check"):
            _record(0, torch.ones(3))
        with dpfx.ops.noise.noiseless():
            _record(0, torch.ones(3))
        assert _recording.measured[0].within(1e-3, 1.0)
    finally:
        _recording.got = _recording.measured = None


def test_reference_clones_what_the_rest_of_the_graph_sees():
    """Note [The eager reference mutates in place where nothing else sees it]: a fresh sum that
    only the release reads is noised in place; a graph input keeps its clone (the caller's
    tensor is not touched), and a graph releasing an input is not streamed."""
    import operator
    from dpfx.lower.selfcheck import eager_copy
    from dpfx.lower.selfcheck.stream import stream_releases as _stream_releases

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    s = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    call = graph.call_function(
        torch.ops.higher_order.auto_functionalized_v2, (torch.ops.dpfx.add_noise_.default,),
        {"std": 0.0, "multiplier": 3.0, "divisor": 1, "_sums_length": 2,
         "_sums_0_base_index": 0, "_sums_1_base_index": 1, "_all_bases": [s, x]})
    graph.output((graph.call_function(operator.getitem, (call, 1)),
                  graph.call_function(operator.getitem, (call, 2)), x))
    ref = eager_copy(torch.fx.GraphModule(torch.nn.Module(), graph))
    af = ref.graph.find_nodes(op="call_function",
                             target=torch.ops.higher_order.auto_functionalized_v2)[0]
    assert af.kwargs["_only_clone_these_bases"] == (1,)
    assert _stream_releases(ref) == ()
    x = torch.randn(5)
    before = x.clone()
    with dpfx.ops.noise.noiseless():
        three_s, three_x, same_x = ref([x])
    assert torch.equal(x, before) and torch.equal(same_x, before)
    torch.testing.assert_close(three_s, 6 * before)
    torch.testing.assert_close(three_x, 3 * before)


def test_reference_frees_each_input_after_its_last_use():
    """Note [The self-check's runs free their inputs]: the eager reference takes its inputs
    boxed and empties the list, so an input the caller handed over is freed after its last use,
    not held to the end of the run."""
    import weakref
    from dpfx.lower.selfcheck import eager_copy

    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    early = graph.call_function(torch.ops.aten.mul.Tensor, (a, 2.0))
    seen = []
    probe = graph.call_function(lambda t: seen.append(alive()) or t, (early,))
    graph.output((graph.call_function(torch.ops.aten.add.Tensor, (probe, b)),))
    ref = eager_copy(torch.fx.GraphModule(torch.nn.Module(), graph))
    args = [torch.randn(4), torch.randn(4)]
    first = weakref.ref(args[0])
    alive = lambda: first() is not None   # noqa: E731
    want = args[0] * 2 + args[1]
    (got,) = ref(args)
    assert args == [] and seen == [False] and torch.equal(got, want)


def test_reference_creates_a_tensor_where_it_is_first_read():
    """Note [The eager reference creates a tensor where it is first read]: a tensor made from
    sizes alone moves to just before its first reader in the eager copy; a random op keeps its
    place (its draws depend on it); the values do not change."""
    from dpfx.lower.selfcheck import eager_copy

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4)
    zeros = graph.call_function(aten.full.default, ([4], 0.0), {"dtype": torch.float32})
    noise = graph.call_function(aten.randn.default, ([4],))
    y = graph.call_function(aten.mul.Tensor, (x, 2.0))
    z = graph.call_function(aten.add.Tensor, (zeros, y))
    graph.output((graph.call_function(aten.add.Tensor, (z, noise)),))
    for node, val in ((zeros, torch.zeros(4)), (noise, torch.randn(4)), (y, torch.empty(4)),
                      (z, torch.empty(4))):
        node.meta["val"] = val
    ref = eager_copy(torch.fx.GraphModule(torch.nn.Module(), graph))
    nodes = list(ref.graph.nodes)
    at = {n.target: i for i, n in enumerate(nodes) if n.op == "call_function"
          and n.target is not aten.add.Tensor}
    first_add = next(i for i, n in enumerate(nodes) if n.target is aten.add.Tensor)
    assert at[aten.full.default] == first_add - 1 and at[aten.randn.default] < at[aten.mul.Tensor]
    x = torch.randn(4)
    torch.manual_seed(0)
    (got,) = ref([x])
    torch.manual_seed(0)
    torch.testing.assert_close(got, 2 * x + torch.randn(4), rtol=0, atol=0)


def test_a_gradient_the_reference_never_released_is_refused(monkeypatch):
    """A streamed output the eager reference did not hand over would go unchecked: refused."""
    monkeypatch.setattr(dpfx.lower.selfcheck.stream, "record", lambda position, want: None)
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, self_check="always")
    with pytest.raises(dpfx.PrivacyError, match="released no gradient"):
        mse(dp(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    assert all(p.grad is None for p in model.parameters())


def test_an_infinite_output_does_not_loosen_the_others():
    """Note [The self-check's floor scales with the graph]: the scale is the largest RMS entry of
    the finite outputs; an output holding an infinity (on both sides alike) must not make every
    other output's floor infinite."""
    from dpfx.lower.selfcheck.compare import compare as _compare

    g = torch.Generator().manual_seed(0)
    big = torch.randn(100, generator=g)
    big[3] = float("inf")
    grad = torch.randn(64, 32, generator=g) * 1e-3
    _compare("backward", 2, ["big", "grad"], [big.clone(), grad.clone()], [big, grad])
    with pytest.raises(dpfx.PrivacyError, match="output grad"):
        _compare("backward", 2, ["big", "grad"], [big.clone(), grad * 1.01], [big, grad])


def _check_runs(monkeypatch) -> list:
    """The batch sizes the self-check runs the graphs at, as it runs them: the larger first
    (Note [The second size grows the first]), each size once."""
    check, grow = dpfx.lower.selfcheck.GraphCheck, dpfx.lower.selfcheck.grow
    real_check_at, real_grown, sizes = check._check_at, grow.run, []

    def check_at(self, b, *args):
        sizes.append(b)
        return real_check_at(self, b, *args)

    def run_grown(check, large, *args):
        sizes.append(large)
        return real_grown(check, large, *args)

    monkeypatch.setattr(check, "_check_at", check_at)
    monkeypatch.setattr(grow, "run", run_grown)
    return sizes


RUNS = sorted(dpfx.lower.selfcheck.SIZES, reverse=True)    # the sizes, as a check runs them


def _mlp_step(self_check=True):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, self_check=self_check)
    mse(dp(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    return model


def test_passed_check_not_repeated_on_the_same_code(tmp_path, monkeypatch):
    """Note [A self-check is not repeated on code it has passed]: a second compile that finds
    the same code in Inductor's cache skips the check its first compile passed; code never
    checked there (a first compile with self_check=False), self_check="always", and a callable
    that is not Inductor's cached code (a miscompiling wrapper) are checked every time."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    runs, checks = _check_runs(monkeypatch), _checks_of(monkeypatch)
    _mlp_step(self_check=False)                       # fills the cache, checks nothing
    assert runs == [] and checks == []
    _mlp_step()                                       # the cache's code, never checked: checked
    assert runs == RUNS
    assert not checks[-1].skipped
    assert isinstance(checks[-1].forward.eager, torch.fx.GraphModule)
    markers = list((tmp_path / "inductor" / "dpfx_selfcheck").iterdir())
    assert len(markers) == 1 and markers[0].stat().st_size == 0
    counters.clear()
    model = _mlp_step()                               # the same code again: not re-checked
    assert counters["inductor"]["fxgraph_cache_hit"] == 2
    assert runs == RUNS
    # Note [The eager reference is built when the check runs]: skipped, so never built
    assert checks[-1].skipped and isinstance(checks[-1].forward.eager, tuple) \
        and isinstance(checks[-1].backward.eager, tuple)
    assert model.fc1.weight.grad is not None
    _mlp_step(self_check="always")
    assert runs == 2 * RUNS
    # other code (a wider layer): checked, and marked apart
    torch._dynamo.reset()
    wide = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))
    dp = dpfx.compile(wide, max_grad_norm=1.0, noise_multiplier=1.0)
    mse(dp(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    assert runs == 3 * RUNS
    assert len(list((tmp_path / "inductor" / "dpfx_selfcheck").iterdir())) == 2
    # the checked code, miscompiled after Inductor: the wrapper is no cached code, so it is checked
    _miscompile(monkeypatch, "backward", _nudge_gradients)
    with pytest.raises(dpfx.PrivacyError, match="compiled backward graph disagrees"):
        _mlp_step()
    assert runs[-2:] == RUNS and len(runs) == 4 * len(RUNS)


def test_code_outside_the_fx_graph_cache_is_always_checked(tmp_path, monkeypatch):
    """With Inductor's FX-graph cache off the compiled code has no cache key to name a marker
    by: every compile is checked, and no marker is left."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    runs = _check_runs(monkeypatch)
    with torch._inductor.config.patch(fx_graph_cache=False):
        _mlp_step()
        _mlp_step()
    assert runs == 2 * RUNS
    assert not (tmp_path / "inductor" / "dpfx_selfcheck").exists()


def test_a_gpu_graph_is_never_marked():
    """On a GPU the check always runs (Triton's launch configurations are picked at run time)."""
    from types import SimpleNamespace

    check = SimpleNamespace(device=torch.device("cuda"))
    assert dpfx.lower.selfcheck.markers.passed_marker(check, {}) is None


def test_self_check_setting_is_validated():
    with pytest.raises(ValueError, match="self_check must be True, False or 'always'"):
        dpfx.compile(MLP(), max_grad_norm=1.0, noise_multiplier=1.0, self_check="sometimes")


class _DropoutMLP(nn.Module):
    """A random forward: its check runs the independence test, not the grown comparison."""

    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def _reference_rolls_too(monkeypatch):
    """The verified graph itself, run eagerly, mixes examples as the compiled one does: a fault
    of dpfx's, not of the generated code."""
    real = dpfx.lower.selfcheck.Half.reference

    def reference(self):
        graph = real.fget(self)
        if not _is_forward(self):
            return graph

        def rolled(args):
            return _roll_first_output(list(graph(args)))
        return rolled

    monkeypatch.setattr(dpfx.lower.selfcheck.Half, "reference", property(reference))


def _is_forward(half) -> bool:
    return not any(name.startswith("tangents") for name, _ in half.inputs)


@pytest.mark.parametrize("model,planted,blamed", [
    (MLP, "compiled", "not the graph dpfx proved"),
    (MLP, "both", "the fault is in dpfx"),
    (_DropoutMLP, "compiled", "mixes examples (a torch bug)"),
    (_DropoutMLP, "both", "the fault is in dpfx"),
], ids=["grown-generated", "grown-dpfx", "independence-generated", "independence-dpfx"])
def test_a_forward_that_mixes_examples_is_blamed_on_what_mixed(monkeypatch, model, planted,
                                                                 blamed):
    """Note [The self-check blames only what it has shown], for the forward: code that mixes
    examples is refused by the grown comparison (a deterministic forward) or by the change of
    example 0 (a random one), and the error names the generated code only where the verified
    graph, run eagerly on the same batches, keeps examples apart."""
    _miscompile(monkeypatch, "forward", _roll_first_output)
    if planted == "both":
        _reference_rolls_too(monkeypatch)
    net = model()
    dp = dpfx.compile(net, max_grad_norm=1.0, noise_multiplier=0.0, self_check="always")
    with pytest.raises(dpfx.PrivacyError, match="compiled forward") as refused:
        mse(dp(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    assert blamed in str(refused.value), str(refused.value)
    assert ("torch bug" in str(refused.value)) == (planted == "compiled")
    assert all(p.grad is None for p in net.parameters())


class _LastTokenHead(nn.Module):
    """GPT-2's sequence-classification pooling: each example's logits at its last non-pad token,
    picked with ``arange(B)`` (an iota over the batch the forward saves for the backward)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(7, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        logits = self.head(torch.tanh(self.emb(ids)))
        last = ((ids != 0).int() * torch.arange(ids.shape[1])).argmax(-1)
        return logits[torch.arange(ids.shape[0]), last]


def test_an_output_that_counts_the_rows_is_compared_as_row_numbers():
    """The grown check adds an example before the others: a saved arange over the batch then
    holds each row's number plus one, which is no mixing (Note [An arange over the rows] in
    graph/batch.py). It was refused as a fault of dpfx's."""
    model = _LastTokenHead()
    ids, y = torch.randint(1, 7, (5, 4)), torch.randint(0, 3, (5,))
    ids[1, 2:] = 0
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, self_check="always")
    got = run_dpfx(dp, model, F.cross_entropy, ids, y)
    assert_close(got, dp_sgd_grads(model, F.cross_entropy, ids, y, max_grad_norm=0.05),
                 rtol=1e-4, atol=1e-6)
