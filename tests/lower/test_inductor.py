"""End to end through Inductor's C++ backend: correctness, one compile for every batch size, and
the caches that must not hand back non-private graphs. Kept small: each compile costs seconds."""
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import dpfx
from support.models import MLP, SeqModel, mse, xent
from support.reference import assert_close, dp_sgd_grads, run_dpfx


@pytest.mark.parametrize("model_cls,loss_fn,shape,target", [
    (MLP, mse, (8,), lambda b: torch.randn(b, 4)),
    (SeqModel, xent, (6, 8), lambda b: torch.randint(0, 4, (b,))),
])
def test_batch_sizes_compile_once(model_cls, loss_fn, shape, target):
    """Batch sizes 0, 1, 2, 7, 64 in a row: one forward and one backward graph, all exact."""
    model = model_cls()
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=8)
    misses = counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"]
    for batch in [0, 1, 2, 7, 64]:
        x, y = torch.randn(batch, *shape), target(batch)
        got = run_dpfx(dp, model, loss_fn, x, y)
        want = dp_sgd_grads(model, loss_fn, x, y, max_grad_norm=0.1, expected_batch_size=8)
        assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert dp.compile_count == 2
    lowered = counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"]
    assert lowered - misses == 2  # both graphs went through Inductor, not eager


def test_sum_reduction_and_actual_batch_denominator():
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, loss_reduction="sum")
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    got = run_dpfx(dp, model, mse, x, y, "sum")
    assert_close(got, dp_sgd_grads(model, mse, x, y, max_grad_norm=0.05, loss_reduction="sum"),
                 rtol=1e-4, atol=1e-6)


def test_plain_torch_compile_first_does_not_leak():
    """Note [No caches that skip the inner compiler]: a non-private torch.compile of the same
    model first must not make dpfx reuse its graphs."""
    model = MLP()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    plain = torch.compile(model)
    mse(plain(x), y).backward()
    model.zero_grad(set_to_none=True)
    dp = dpfx.compile(model, max_grad_norm=0.01, noise_multiplier=0.0)
    got = run_dpfx(dp, model, mse, x, y)
    assert_close(got, dp_sgd_grads(model, mse, x, y, max_grad_norm=0.01), rtol=1e-4, atol=1e-6)
    total = torch.sqrt(sum(g.pow(2).sum() for g in got.values()))
    assert total <= 0.01 + 1e-6  # the mean of clipped gradients is within C


def test_empty_batch_with_odd_strides_does_not_recompile():
    """seq[:, :-1].contiguous() of an empty batch keeps the parent's stride (65, not 64): dpfx
    passes dynamo a row-major empty tensor, so the stride guard holds and nothing recompiles."""
    model = MLP(d_in=64)
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=4)
    for batch in [3, 0, 2]:
        x = torch.randn(batch, 65)[:, :-1].contiguous()
        y = torch.randn(batch, 4)
        got = run_dpfx(dp, model, mse, x, y)
        want = dp_sgd_grads(model, mse, x, y, max_grad_norm=0.1, expected_batch_size=4)
        assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert dp.compile_count == 2


def test_cache_key_covers_every_dpfx_source(tmp_path):
    """Note [dpfx's own FX-graph cache entries] (lower/inductor.py): Inductor's cached code bakes in
    the strides dpfx's own ops' fake kernels gave, so a change to any of dpfx's sources, not
    only lower/inductor.py, must give other cache entries; the same sources give the same key
    wherever they lie."""
    import os
    import shutil

    from dpfx.lower import inductor as lowering

    package = os.path.dirname(os.path.abspath(dpfx.__file__))
    copy = tmp_path / "dpfx"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert lowering.source_digest(str(copy)) == lowering._source_digest()
    keys = {lowering.source_digest(str(copy))}
    for changed in ("rules/convolution.py", "ops/noise.py", "ops/csrc/im2col.c"):
        with open(copy / changed, "a") as f:
            f.write("\n")
        keys.add(lowering.source_digest(str(copy)))
    assert len(keys) == 4


def test_kernel_groups_split_at_100_arguments(monkeypatch):
    """Note [CPU kernel groups of at most 100 arguments] (lower/codegen_patches.py): dpfx's backward
    tail of a many-parameter model is written as several C++ functions, the limit is dpfx's alone
    (plain torch.compile keeps Inductor's), and the split code is exact."""
    from torch._inductor.codegen.cpp import CppScheduling

    limits, flushes = [], []
    set_flush = CppScheduling._set_flush_status

    def recording(self, status):
        if status:
            flushes.append(CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM)
        return set_flush(self, status)

    monkeypatch.setattr(CppScheduling, "_set_flush_status", recording)
    from dpfx.lower import inductor as lowering
    from dpfx.lower import codegen_patches as lower_codegen
    inner = lowering.compile_fx_inner

    def seen(*args, **kwargs):
        limits.append(CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM)
        return inner(*args, **kwargs)

    monkeypatch.setattr(lowering, "compile_fx_inner", seen)
    before = CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM
    torch.manual_seed(0)
    layers = [m for _ in range(24) for m in (torch.nn.Linear(16, 16), torch.nn.Tanh())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(16, 2))
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=3)
    with torch._inductor.config.patch(fx_graph_cache=False):    # generate the code
        for batch in (3, 0):
            x, y = torch.randn(batch, 16), torch.randn(batch, 2)
            got = run_dpfx(dp, model, mse, x, y)
            want = dp_sgd_grads(model, mse, x, y, max_grad_norm=0.05, expected_batch_size=3)
            assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert limits == [lower_codegen.KERNEL_GROUP_ARGS] * 2       # forward and backward
    assert lower_codegen.KERNEL_GROUP_ARGS in flushes            # the backward's tail was split
    assert CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM == before == 500


def test_merged_cpu_builds(tmp_path, monkeypatch):
    """Note [One C++ build per compile worker] (lower/cpu_builds.py): the kernels of each dpfx graph
    are built as at most one unit per compile worker, waited for at their first call, exact at
    B = 3, 0, 1 and 16 (the width);
    a second compile on the same cache directory loads the units without g++; a plain
    torch.compile keeps one build per kernel. A unit g++ refuses is built kernel by kernel."""
    from torch._inductor import async_compile, codecache
    from torch._inductor.utils import fresh_cache

    from dpfx.lower import cpu_builds

    assert cpu_builds.deal([5, 1, 4, 1, 3], 2) == [[0, 1, 3], [2, 4]]
    assert cpu_builds.split('#include <a.h>\nextern "C" void kernel(int* p)\n{}\n')[0] == \
        ["#include <a.h>"]
    assert cpu_builds.split('#define N 4\nextern "C" void kernel(int* p)\n{}\n') is None
    assert cpu_builds.split('extern "C" void kernel(int* p) {}\nextern "C" void kernel(int q)'
                            ' {}\n') is None

    units, submits = [], []
    load_async = codecache.CppPythonBindingsCodeCache.load_async.__func__
    submit = async_compile.AsyncCompile.submit.__func__

    def recording_load(cls, code, *args, **kwargs):
        units.append(code.count("namespace dpfx_k") // 2)
        return load_async(cls, code, *args, **kwargs)

    monkeypatch.setattr(codecache.CppPythonBindingsCodeCache, "load_async",
                        classmethod(recording_load))
    monkeypatch.setattr(async_compile.AsyncCompile, "submit",
                        classmethod(lambda cls, task: submits.append(1) or submit(cls, task)))
    stand_ins = []      # Note [A graph's C++ builds run while the next graph lowers]
    on_first_call = cpu_builds._on_first_call
    monkeypatch.setattr(cpu_builds, "_on_first_call", lambda scope, name, member: stand_ins.append(
        (scope, name)) or on_first_call(scope, name, member))
    # enough kernels in each graph for units of several kernels (more than the workers)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(16, 16), torch.nn.Tanh())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(16, 4))
    x_all, y_all = torch.randn(16, 16), torch.randn(16, 4)
    # two compile workers, as on the 2-core machines the suite runs on: with more workers than a
    # graph has kernels, each kernel is its own unit
    with fresh_cache(dir=str(tmp_path)), warnings.catch_warnings(), \
            torch._inductor.config.patch(compile_threads=2):
        warnings.simplefilter("error", cpu_builds.MergedBuildFailed)
        for run in ("cold", "warm"):
            torch._dynamo.reset()
            codecache.CppPythonBindingsCodeCache.cache_clear()
            codecache.PyCodeCache.cache_clear()
            units.clear()
            submits.clear()
            dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0,
                              expected_batch_size=4)
            for batch in (3, 0, 1, 16):
                x, y = x_all[:batch], y_all[:batch]
                got = run_dpfx(dp, model, mse, x, y)
                want = dp_sgd_grads(model, mse, x, y, max_grad_norm=0.05, expected_batch_size=4)
                assert_close(got, want, rtol=1e-4, atol=1e-6)
            merged = [n for n in units if n]
            assert merged and max(merged) >= 2, (run, units)
            if run == "cold":
                assert len(merged) <= 2 * 2            # per graph, at most one per worker
                assert submits
                # the modules were loaded without waiting for their builds, and each kernel's
                # first call put the built kernel in its stand-in's place
                assert stand_ins and all(
                    not getattr(scope[name], "dpfx_stand_in", False) for scope, name in stand_ins)
            else:
                assert submits == [], "the warm start rebuilt a unit"
        # a unit g++ refuses: its kernels built one by one, with a warning, still exact
        warnings.simplefilter("always", cpu_builds.MergedBuildFailed)
        unit = cpu_builds.unit
        monkeypatch.setattr(cpu_builds, "unit", lambda kernels: unit(kernels) + "#error no\n")
        torch._dynamo.reset()
        codecache.CppPythonBindingsCodeCache.cache_clear()
        codecache.PyCodeCache.cache_clear()
        dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=4)
        with pytest.warns(cpu_builds.MergedBuildFailed):
            got = run_dpfx(dp, model, mse, x_all[:3], y_all[:3])
        want = dp_sgd_grads(model, mse, x_all[:3], y_all[:3], max_grad_norm=0.05,
                            expected_batch_size=4)
        assert_close(got, want, rtol=1e-4, atol=1e-6)
        units.clear()
        plain = torch.compile(torch.nn.Sequential(*layers, torch.nn.Linear(16, 4)))
        mse(plain(x_all), y_all).backward()
        assert units and not any(units)


def test_combo_kernels_only_for_graphs_on_the_gpu(monkeypatch):
    """Note [Combo kernels on the GPU] in lower/inductor.py: a graph whose inputs live on a CUDA device
    is lowered with combo kernels; a CPU graph (the C++ backend, which has none) is not, and the
    setting reaches the compile a CPU step actually runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dpfx import backend
    from dpfx.lower import inductor as lowering
    with FakeTensorMode():
        on_gpu = [torch.empty(4, 3, device="cuda"), 4]
        on_cpu = [torch.empty(4, 3), 4]
    assert lowering.inductor_patches(on_gpu)["combo_kernels"] is True
    assert "combo_kernels" not in lowering.inductor_patches(on_cpu)
    assert lowering.inductor_patches(on_cpu)["layout_optimization"] is False
    seen = []
    real = backend.compile_fx
    monkeypatch.setattr(backend, "compile_fx", lambda *a, **k: seen.append(
        k["config_patches"]) or real(*a, **k))
    torch.manual_seed(0)
    model = MLP(4, 8, 2)
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4,
                      backend="eager")      # the same compile_fx call, without Inductor's C++
    mse(dp(torch.randn(4, 4)), torch.randn(4, 2)).backward()
    assert seen and all("combo_kernels" not in p for p in seen)


def test_a_graph_combo_kernels_fail_on_is_lowered_without_them(monkeypatch):
    """Should Inductor fail to lower a graph with combo kernels (dpfx's GPU setting), the same
    verified graph is lowered without them, with a warning, and trains exactly; a failure
    without them is raised as it was."""
    from dpfx.lower import inductor as lowering
    real, tried = lowering.compile_fx_inner, []

    def flaky(*args, **kwargs):
        tried.append(torch._inductor.config.combo_kernels)
        if torch._inductor.config.combo_kernels:
            raise RuntimeError("a combo kernel Inductor cannot generate")
        return real(*args, **kwargs)

    monkeypatch.setattr(lowering, "compile_fx_inner", flaky)
    torch.manual_seed(0)
    model = MLP(4, 8, 2)
    x, y = torch.randn(6, 4) * 3, torch.randn(6, 2)
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=6)
    with torch._inductor.config.patch(combo_kernels=True), \
            pytest.warns(dpfx.ComboKernelsWarning, match="combo kernel Inductor cannot"):
        got = run_dpfx(dp, model, mse, x, y)
    assert tried == [True, False, True, False], tried      # the forward, then the backward
    assert_close(got, dp_sgd_grads(model, mse, x, y, max_grad_norm=0.05, expected_batch_size=6),
                 rtol=1e-4, atol=1e-6)
    monkeypatch.setattr(lowering, "compile_fx_inner", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("Inductor cannot lower this")))
    torch._dynamo.reset()
    dp = dpfx.compile(MLP(4, 8, 2), max_grad_norm=0.05, noise_multiplier=0.0,
                      expected_batch_size=6)
    with pytest.raises(Exception, match="Inductor cannot lower this"):
        dp(x)
