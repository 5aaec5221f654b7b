"""dpfx's benchmark suite: one DP-SGD training step, dpfx against its peers.

    python benchmarks/run.py                 # full run (30-40 min on 2 cores, estimated)
    python benchmarks/run.py --quick         # one batch size per model, few steps, 5 methods
    python benchmarks/run.py --models mlp gpt --out benchmarks/out
    python benchmarks/run.py --realistic --quick   # the sizes DP users train at (under 10 min)
    python benchmarks/run.py --realistic --quick --methods compile compile_loss dpfx dpfx_loss
    python benchmarks/run.py --realistic --quick --methods compile dpfx opake_eager opake_compile

For every (model, batch size) a fresh worker process (this file with --worker) sets up every
method side by side: first step and warm-up per method, then the timed steps round-robin over
the methods (a block of steps of each in turn), so that load from other processes on a shared machine
falls on every method alike. The driver collects the results and writes results.json,
results.md and ratio.png under --out (worker logs under --out/logs). A method that raises is
recorded as "fails: <error>"; a worker that dies is rerun without the method it died in.

Measurements, per (model, batch, method):
- first step: wall time of the first training step, compilation included. Every method compiles
  cold: dynamo is reset and Inductor gets a fresh, empty cache directory (no FX-graph or kernel
  cache hits from an earlier method or run). The worker warms Inductor's compile workers and C++
  toolchain probe once on a throwaway function before the first method. Dynamo is reset once
  per worker, not between methods (their compiled code must stay alive for the round-robin).
- first step, warm cache (full run, or --warm-cache): a second worker process runs the first
  step of every compiling method again with the cache directory the first worker filled: what a
  user's second run of the same script pays (dynamo traces again; Inductor's caches hit).
- compiles: graphs compiled during the method (dpfx: ``compile_count``; torch.compile methods:
  the delta of ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``).
- median step: median wall time of N timed steps after the warm-up steps. The methods take turns
  (round-robin): each turn runs one untimed step (the first step after another method ran meets
  caches that method evicted) and then up to --block timed steps. results.json also has min,
  quartiles and max, and the number of dynamo graphs compiled during the timed steps (0: no
  recompiles).
- x compiled: median step / the model's non-private baseline's median step for the same batch:
  torch.compile, except for the LSTM, whose baseline is the same recurrence unrolled as dpfx
  captures it, compiled without DP (Note [The LSTM's baseline] in models.py); for dpfx with the
  loss captured (``dpfx_loss``), torch.compile of the model and its loss (``compile_loss``) where
  that ran, since the loss's forward and gradient are then compiled code too. first x and mem x:
  first step and step memory over the same baseline's. The summary at the top of results.md
  sets dpfx's ratios beside its targets (BENCHMARKS.md).
- noise alone: dpfx's noise call (``dpfx::add_noise_`` over the model's trainable parameters,
  one N(0, 1) sample per coordinate) timed by itself between dpfx's timed blocks, as many times
  as dpfx's steps, over the baseline's median step. DP-SGD cannot skip it, so it bounds from
  below what any private step costs over the baseline on this machine: a row whose target minus
  1 is smaller than this figure cannot meet it with exact per-coordinate Gaussian noise.
- first-step RSS: the growth of the process's peak resident memory (VmHWM, reset through
  /proc/self/clear_refs before the method is built) over its resident memory then, during the
  method's setup and first step: what compiling and the first step ask of the machine. Methods
  share the worker process, so memory an earlier method freed but glibc kept can serve a later
  one: read it as the method's own peak within a few MB on the small models, and as a lower
  bound where earlier methods held much more. results.json also has the worker's peak RSS.
- step memory: peak bytes of tensor memory live during one steady-state step above what was
  live when the step began, from the CPU allocator's own accounting (torch.profiler with
  profile_memory=True records every allocation and free of the c10 CPU allocator, Inductor's
  buffers included); parameters, optimizer state and the model's input are excluded, gradients
  created during the step are included. RSS is not used: ru_maxrss is monotonic over a process
  and includes compile-time memory, and glibc keeps freed pages.
- dpfx variable batch: after the timed steps, 10 steps with Poisson-like batch sizes (0 and 1
  included); dpfx's compile count must stay 2 (on by default, off with --realistic).

--host-time runs the rows of ``models.HOST_TIME``: models whose kernels cost next to nothing
(an MLP 8-8-8-10 and the tiny HF GPT-2 at B = 1), 400 steps of compile, compile_loss, dpfx and
dpfx_loss; the min step is the host's time per step (dynamo's guards, aot_autograd's runtime,
dpfx's checks and hooks, the optimizer), and dpfx's min minus its baseline's is what dpfx's
Python adds, the floor of a GPU step. Each step is also split into the time inside the compiled
graphs (their kernels, dpfx's DP kernels among them, and Inductor's code around them) and the
time outside them: dpfx's Python beyond torch.compile's is the difference of the latter
(``GraphTimer``; results.md's "The host's time outside the compiled graphs"), and the Python
bytecodes a step executes are counted after the timed steps (``python_opcodes``): a figure of
the host's work that the machine's speed does not move.

Opake's methods on a row whose input has an attention mask run in one more worker of their own,
under Opake's process-wide model patches (Note [Opake in the harness] in methods.py), beside
the row's baseline timed in that worker: their x base, first x and mem x are over that
baseline, and their label says so.

--realistic runs the rows of ``models.REALISTIC`` (each model at the batch size DP users train
at) instead of every model's batch sizes. ``--realistic --quick`` is the short form: 3 timed
steps and no warm-up steps (the untimed step that opens each method's turn warms it), no
warm-cache process and no variable-batch check; most of its time is the compiling methods'
first steps (GPT-2 small's dpfx first step alone is over a minute on 2 idle cores).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from report import add_ratios, label, plot, write_markdown  # noqa: E402

METHOD_ORDER = ["eager", "compile", "compile_loss", "compile_unrolled", "opacus_hooks",
                "opacus_ghost", "func_eager", "func_compile", "opake_eager", "opake_compile",
                "dpfx", "dpfx_loss", "dpfx_materialize", "dpfx_blocks"]
# --quick keeps the baselines, the fastest peer (Opacus ghost clipping) and dpfx: compiling is
# most of a quick run, and torch.func compiled costs as much compile time as dpfx. The loss
# compiled with the model, dpfx's and its baseline's, is asked for by name (``--methods compile
# compile_loss dpfx dpfx_loss``): two more compiles a model.
QUICK_METHODS = ["eager", "compile", "compile_unrolled", "opacus_ghost", "dpfx"]
HOST_METHODS = ["compile", "compile_loss", "dpfx", "dpfx_loss"]
COMPILING = ("compile", "compile_loss", "compile_unrolled", "func_compile", "opake_compile",
             "dpfx", "dpfx_loss", "dpfx_materialize", "dpfx_blocks")


# ------------------------------------------------------------------------------------------------
# worker: one process per (model, batch)
# ------------------------------------------------------------------------------------------------

def short_error(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    msg = lines[0] if lines else ""
    if len(msg) > 160:
        msg = msg[:157] + "..."
    return f"{type(e).__name__}: {msg}"


def step_peak_bytes(step, x, y) -> int:
    """Peak tensor bytes live during one step above the step's start (see the module doc); on a
    GPU, the caching allocator's peak of allocated bytes above the step's start."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(x, y)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(x, y)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    cur = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


@contextlib.contextmanager
def method_cache(root: str, method: str):
    """Inductor's caches in root/method: empty when the cold worker compiles, filled for the
    warm-cache worker. In-memory caches are cleared on the way in and out."""
    from torch._inductor.utils import clear_caches

    path = os.path.join(root, method)
    os.makedirs(path, exist_ok=True)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    clear_caches()
    try:
        yield
    finally:
        clear_caches()
        if before is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def _proc_status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> float:
    """Reset the process's peak resident memory to its current RSS; returns that RSS (MB)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _proc_status_mb("VmRSS")


def warm_inductor():
    """Start Inductor's compile workers and probe the toolchain (C++ or Triton) once, outside any
    method."""
    import torch

    lin = torch.nn.Linear(4, 4).to(DEVICE)
    f = torch.compile(lambda x: torch.tanh(lin(x)).sum())
    f(torch.randn(3, 4, device=DEVICE)).backward()
    sync()
    torch._dynamo.reset()


# The device the worker runs on (--device): the models and batches are built on the CPU with the
# same seeds and moved there. On a GPU every timer reads after torch.cuda.synchronize().
DEVICE = None


def sync() -> None:
    import torch

    if DEVICE is not None and DEVICE.type == "cuda":
        torch.cuda.synchronize()


def on_device(model, x, y):
    from torch.utils._pytree import tree_map

    move = lambda t: t.to(DEVICE) if hasattr(t, "to") else t
    return (model.to(DEVICE) if model is not None else None), tree_map(move, x), move(y)


def poisson_sizes(B: int, n: int = 10, seed: int = 0) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    sizes = [int(s) for s in torch.poisson(torch.full((n - 2,), float(B)), generator=g)]
    return [sizes[0], 0, sizes[1], 1] + sizes[2:]


class Progress:
    """The method and phase the worker is in, on disk, so that the driver can name the method
    a crashed worker died in (one small unbuffered write per step)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def mark(self, method: str, phase: str) -> None:
        os.write(self.fd, f"{method} {phase}\n".encode())


def fail(res: dict, e: BaseException, phase: str) -> None:
    res["status"] = "fails"
    res["error"] = short_error(e)
    res["failed_in"] = phase
    res["traceback"] = _relative_paths(traceback.format_exc(limit=-6))


def _relative_paths(text: str) -> str:
    """Results files are committed: a traceback names files from site-packages or the
    repository, never the machine's own directories."""
    text = re.sub(r'File "[^"]*/site-packages/', 'File "site-packages/', text)
    return text.replace(os.path.dirname(HERE) + os.sep, "")


def python_opcodes(step, x, y, steps: int = 5) -> list[int]:
    """Python bytecodes executed by each of ``steps`` steps (``sys.settrace`` with opcode
    events, Inductor's generated wrapper code included): the host's Python as a count that the
    machine's speed does not move. Three traced steps run first, uncounted: a trace function
    makes dynamo look at the frame anew once."""
    counted = [0]

    def trace(frame, event, arg):
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            counted[0] += 1
        return trace

    per_step = []
    for i in range(3 + steps):
        counted[0] = 0
        sys.settrace(trace)
        try:
            step(x, y)
        finally:
            sys.settrace(None)
        if i >= 3:
            per_step.append(counted[0])
    return per_step


class GraphTimer:
    """The wall time spent inside compiled graphs (Inductor's ``CompiledFxGraph`` calls, the
    outermost of nested ones: a block op's graph runs inside the model's), so that a step splits
    into its compiled graphs (kernels and the generated code around them) and the Python outside
    them (dynamo's guards, aot_autograd's runtime, dpfx's checks and hooks, the loss, the
    optimizer). About a microsecond a graph call, alike for every method."""

    def __init__(self):
        from torch._inductor import output_code

        self.total, self._depth = 0.0, 0
        inner = output_code.CompiledFxGraph.__call__

        def timed(graph, inputs):
            if self._depth:
                return inner(graph, inputs)
            self._depth = 1
            t0 = time.perf_counter()
            try:
                return inner(graph, inputs)
            finally:
                self.total += time.perf_counter() - t0
                self._depth = 0
        output_code.CompiledFxGraph.__call__ = timed


def worker(args) -> None:
    """Phase 1, per method: build the model, first step (cold compile), warm-up. Phase 2: the
    timed steps, round-robin over the methods (a block of steps of each in turn), so that
    load from other processes on a shared machine falls on every method alike. Phase 3, per
    method: one profiled step for memory; dpfx's variable-batch check."""
    import torch

    import methods
    import models

    global DEVICE
    DEVICE = torch.device(args.device)
    methods.OPAKE_PATCHES = args.opake_patches     # Note [Opake in the harness] in methods.py
    torch.set_num_threads(args.threads)
    progress = Progress(args.progress)
    name, B = args.models[0], args.batch
    warm_inductor()
    torch._dynamo.reset()
    if args.warm_cache_worker:
        return first_steps_with_warm_cache(args, progress)
    live, results = {}, {}
    for method in args.methods:
        res = results[method] = {"model": name, "batch": B, "method": method,
                                 "label": methods.METHODS[method][0]}
        progress.mark(method, "setup")
        rss_before = reset_peak_rss()
        gpu_before = gpu_peak_reset()
        try:
            # a fresh, empty Inductor cache per method: no FX-graph or kernel cache hits
            with method_cache(args.cache_dir, method):
                model, x, y = on_device(*models.build(name, B))
                m = methods.make(method, model, B, x, y)
                t0 = time.perf_counter()
                m.step(x, y)
                sync()
                res["first_step_s"] = time.perf_counter() - t0
                res["first_step_rss_mb"] = _proc_status_mb("VmHWM") - rss_before
                if gpu_before is not None:
                    res["first_step_gpu_peak_mb"] = gpu_peak_mb() - gpu_before
                for _ in range(args.warmup):
                    m.step(x, y)
            res["compiles"] = m.compiles() if m.compiles else None
            live[method] = (m, model, x, y)
        except Exception as e:  # a method that fails on a model is a result, not a crash
            fail(res, e, "setup/first step")
        print(f"  {name} B={B} {method:13s} first step "
              f"{res.get('first_step_s', float('nan')):7.2f} s  "
              f"{'ok' if method in live else 'FAILS ' + res['error']}", flush=True)

    times = {method: [] for method in live}
    in_graphs = {method: [] for method in live}
    timer = GraphTimer() if args.graph_time else None
    noise = noise_draw(live["dpfx"][1]) if "dpfx" in live else None
    noise_times = []
    graphs_before = methods.unique_graphs()
    rounds = math.ceil(args.steps / args.block)
    for r in range(rounds):
        n = min(args.block, args.steps - r * args.block)
        for method in list(live):
            m, _, x, y = live[method]
            progress.mark(method, "timing")
            try:
                m.step(x, y)   # untimed: the first step after another method ran is cache-cold
                sync()
                for _ in range(n):
                    if timer is not None:
                        timer.total = 0.0
                    t0 = time.perf_counter()
                    m.step(x, y)
                    sync()
                    times[method].append(time.perf_counter() - t0)
                    if timer is not None:
                        in_graphs[method].append(timer.total)
            except Exception as e:
                fail(results[method], e, "timed steps")
                del live[method]
                continue
            if method == "dpfx":      # the same number of noise draws alone, under the same load
                for _ in range(n):
                    t0 = time.perf_counter()
                    noise()
                    sync()
                    noise_times.append(time.perf_counter() - t0)
    # dynamo's counter is process-wide: any graph compiled during the timed steps is a recompile
    graphs_during_timing = methods.unique_graphs() - graphs_before

    for method, (m, model, x, y) in live.items():
        res = results[method]
        t = sorted(times[method])
        res["steps"] = len(t)
        res["median_ms"] = 1e3 * statistics.median(t)
        res["min_ms"] = 1e3 * t[0]
        res["max_ms"] = 1e3 * t[-1]
        quartiles = statistics.quantiles(t, n=4) if len(t) > 1 else [t[0]] * 3
        res["q1_ms"], res["q3_ms"] = 1e3 * quartiles[0], 1e3 * quartiles[2]
        if in_graphs[method]:
            outside = sorted(a - g for a, g in zip(times[method], in_graphs[method]))
            graphs = sorted(in_graphs[method])
            res["in_graphs_median_ms"] = 1e3 * statistics.median(graphs)
            res["in_graphs_min_ms"] = 1e3 * graphs[0]
            res["outside_median_ms"] = 1e3 * statistics.median(outside)
            res["outside_min_ms"] = 1e3 * outside[0]
        if method == "dpfx" and noise_times:
            res["noise_ms"] = 1e3 * statistics.median(noise_times)
        progress.mark(method, "memory")
        try:
            if args.graph_time:
                res["python_opcodes"] = python_opcodes(m.step, x, y)
            res["step_peak_mb"] = step_peak_bytes(m.step, x, y) / 2**20
            res["params_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
            res["dynamo_graphs_compiled_during_timing"] = graphs_during_timing
            if hasattr(m, "dp_model"):
                res["compiles_after_timing"] = m.compiles()
            if method == "dpfx" and args.varbatch:
                progress.mark(method, "variable batch")
                res["varbatch"] = dpfx_variable_batch(m, name, B)
            res["status"] = "ok"
        except Exception as e:
            fail(res, e, "memory/variable batch")
        print(f"  {name} B={B} {method:13s} median {res['median_ms']:9.2f} ms  {res['status']}",
              flush=True)

    peak = max_rss_mb()
    with open(args.jsonl, "w") as f:
        for method in args.methods:
            results[method]["worker_peak_rss_mb"] = peak
            f.write(json.dumps(results[method]) + "\n")


def max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def noise_draw(model):
    """One release's noise alone: ``dpfx::add_noise_`` over buffers shaped like the model's
    trainable parameters, the call dpfx's backward graph makes once a step. Its time is the
    part of a DP step no schedule can remove: one Gaussian sample per parameter."""
    import torch

    sums = [torch.zeros_like(p, memory_format=torch.contiguous_format)
            for p in model.parameters() if p.requires_grad]
    if DEVICE.type != "cpu":   # the GPU graph's form: one draw of the total size, sliced
        total = sum(s.numel() for s in sums)
        return lambda: torch._foreach_add_(
            sums, [z.view_as(s) for z, s in zip(
                torch.randn(total, device=DEVICE).split([s.numel() for s in sums]), sums)])
    return lambda: torch.ops.dpfx.add_noise_(sums, 1.0, 1.0, 1)


def gpu_peak_reset():
    """On a GPU: reset the allocator's peak, return the bytes allocated now (MB); else None."""
    import torch

    if DEVICE.type != "cuda":
        return None
    sync()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated() / 2**20


def gpu_peak_mb() -> float:
    import torch

    sync()
    return torch.cuda.max_memory_allocated() / 2**20


def first_steps_with_warm_cache(args, progress) -> None:
    """The second process: each method's first step again, on the caches the first filled."""
    import methods
    import models

    with open(args.jsonl, "w") as f:
        for method in args.methods:
            progress.mark(method, "warm-cache first step")
            res = {"method": method}
            try:
                with method_cache(args.cache_dir, method):
                    model, x, y = on_device(*models.build(args.models[0], args.batch))
                    m = methods.make(method, model, args.batch, x, y)
                    t0 = time.perf_counter()
                    m.step(x, y)
                    sync()
                    res["first_step_warm_s"] = time.perf_counter() - t0
            except Exception as e:
                fail(res, e, "warm-cache first step")
            f.write(json.dumps(res) + "\n")


def dpfx_variable_batch(m, model_name: str, B: int) -> dict:
    import torch

    import models

    before = m.compiles()
    sizes = poisson_sizes(B)
    out = {"sizes": sizes, "compiles_before": before}
    try:
        finite = True
        out["compiles_per_step"] = []
        for i, s in enumerate(sizes):
            _, x, y = on_device(None, *models.make_data(model_name, s, seed=100 + i))
            m.step(x, y)
            out["compiles_per_step"].append(m.compiles())
            finite &= all(bool(torch.isfinite(p).all()) for p in m.dp_model.parameters())
        out["compiles_after"] = m.compiles()
        out["params_finite"] = finite
        out["ok"] = out["compiles_after"] == 2 and finite
    except Exception as e:
        out["ok"] = False
        out["error"] = short_error(e)
        out["compiles_after"] = m.compiles()
    return out


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------

def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def machine_info(threads: int, device: str = "cpu") -> dict:
    import torch

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": threads,
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    try:
        import opacus
        info["opacus"] = opacus.__version__
    except Exception:
        info["opacus"] = "not installed"
    try:  # read-only git queries: which dpfx was measured
        root = os.path.dirname(HERE)
        git = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True, text=True,
                                        timeout=30).stdout.strip()
        info["dpfx_commit"] = git("rev-parse", "--short", "HEAD")
        info["dpfx_uncommitted"] = [ln[3:] for ln in git("status", "--porcelain").splitlines()
                                    if ln[3:].startswith("dpfx/")]
    except Exception:
        pass
    try:
        with open("/proc/loadavg") as f:
            info["loadavg_at_start"] = f.read().split()[:3]
    except OSError:
        pass
    return info


def run_config(model: str, B: int, method_list: list[str], args) -> list[dict]:
    """Run one worker for (model, B). If it dies, the method it was in (from its progress file)
    is recorded as failing and the worker is run again without it (with fresh caches). Then,
    with --warm-cache, a second worker takes the compiling methods' first steps again on the
    caches the first one filled. Methods that need a process of their own on this row
    (``methods.own_process``) run in one more worker, beside the row's baseline."""
    import methods

    own = [m for m in method_list if methods.own_process(m, model)]
    rows = _shared_rows(model, B, [m for m in method_list if m not in own], args)
    if own:
        rows += _own_process_rows(model, B, own, args)
    return sorted(rows, key=lambda r: method_list.index(r["method"]))


def _own_process_rows(model: str, B: int, own: list[str], args) -> list[dict]:
    """Opake's methods on a row with an attention mask (Note [Opake in the harness] in
    methods.py): one worker under Opake's model patches, with the row's non-private baseline
    timed in the same process, which each row's ratios are then taken against."""
    import models

    baseline = models.BASELINE.get(model, "compile")
    base = os.path.join(args.out, "logs", f"worker-{model}-{B}-opake-patches")
    cache_dir = tempfile.mkdtemp(prefix="dpfx-bench-")
    try:
        rc, got = _run_worker(model, B, [baseline, *own], args, base, cache_dir,
                              "--opake-patches")
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    ref = got.get(baseline, {})
    rows = []
    for method in own:
        r = got.get(method) or {"model": model, "batch": B, "method": method,
                                "label": label(method), "status": "fails",
                                "error": f"Opake-patches worker: {rc}"}
        r["label"] += ", under Opake's model patches (own process"
        if ref.get("status") == "ok":
            r["own_baseline"] = {k: ref[k] for k in ("method", "label", "median_ms",
                                                     "first_step_s", "step_peak_mb")}
            r["label"] += f"; its {ref['label']} there: {ref['median_ms']:.1f} ms"
        r["label"] += ")"
        rows.append(r)
    return rows


def _shared_rows(model: str, B: int, method_list: list[str], args) -> list[dict]:
    """The methods that share one worker process, interleaved."""
    todo = list(method_list)
    crashed: list[dict] = []
    base = os.path.join(args.out, "logs", f"worker-{model}-{B}")
    os.makedirs(os.path.dirname(base), exist_ok=True)
    while todo:
        cache_dir = tempfile.mkdtemp(prefix="dpfx-bench-")
        rc, got = _run_worker(model, B, todo, args, base, cache_dir)
        if rc == 0:
            got.update({c["method"]: c for c in crashed})
            rows = [got[m] for m in method_list if m in got]
            if args.warm_cache:
                _add_warm_cache_first_steps(model, B, rows, args, base, cache_dir)
            shutil.rmtree(cache_dir, ignore_errors=True)
            return rows
        shutil.rmtree(cache_dir, ignore_errors=True)
        last = None
        if os.path.exists(base + ".progress"):
            with open(base + ".progress") as f:
                lines = f.read().split()
            last = (lines[-2], lines[-1]) if len(lines) >= 2 else None
        why = f"worker timed out after {args.timeout}s" if rc == "timeout" \
            else f"worker process died (exit code {rc})"
        victim = last[0] if last and last[0] in todo else todo[0]
        phase = last[1] if last else "start"
        print(f"  {model} B={B} {victim}: {why} during {phase}; rerunning without it "
              f"(see {base}.log)", flush=True)
        crashed.append({"model": model, "batch": B, "method": victim,
                        "label": label(victim), "status": "fails",
                        "error": f"{why} during {phase}"})
        todo.remove(victim)
    return crashed


def _run_worker(model, B, todo, args, base, cache_dir, *extra) -> tuple:
    """One worker process; returns its exit code (or "timeout") and its rows by method."""
    jsonl, progress = base + ".jsonl", base + ".progress"
    for path in (jsonl, progress):
        if os.path.exists(path):
            os.remove(path)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--models", model,
           "--batch", str(B), "--methods", *todo, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--block", str(args.block),
           "--threads", str(args.threads), "--device", args.device, "--jsonl", jsonl,
           "--progress", progress,
           "--cache-dir", cache_dir, *(["--no-varbatch"] if not args.varbatch else []),
           *(["--graph-time"] if args.host_time else []), *extra]
    try:
        with open(base + ".log", "a") as err:   # warnings and profiler chatter
            rc = subprocess.run(cmd, timeout=args.timeout, stderr=err).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    got = {}
    if rc == 0 and os.path.exists(jsonl):
        with open(jsonl) as f:
            got = {r["method"]: r for r in map(json.loads, f) if r}
        os.remove(jsonl)
    elif rc == 0:
        rc = "no results"
    return rc, got


def _add_warm_cache_first_steps(model, B, rows, args, base, cache_dir) -> None:
    compiled = [r["method"] for r in rows if r["method"] in COMPILING and r["status"] == "ok"]
    if not compiled:
        return
    rc, got = _run_worker(model, B, compiled, args, base + "-warm", cache_dir,
                          "--warm-cache-worker")
    for r in rows:
        warm = got.get(r["method"], {})
        if "first_step_warm_s" in warm:
            r["first_step_warm_s"] = warm["first_step_warm_s"]
        elif r["method"] in compiled:
            r["first_step_warm_error"] = warm.get("error", f"warm-cache worker: {rc}")


def driver(args) -> None:
    import methods

    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    command = "python benchmarks/run.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    meta = {"command": command.strip(), "machine": machine_info(args.threads, args.device),
            "steps": args.steps, "warmup": args.warmup, "block": args.block, "quick": args.quick,
            "warm_cache": args.warm_cache, "realistic": args.realistic,
            "host_time": args.host_time}
    print(f"{meta['machine']['cpu']}, {meta['machine']['cores']} cores, torch "
          f"{meta['machine']['torch']}; {args.steps} steps after {args.warmup} warm-up", flush=True)
    results = []
    for name, B in configs(args):
        load = _loadavg()
        rows = run_config(name, B, [m for m in args.methods if methods.applies(m, name)], args)
        for r in rows:
            r["loadavg_before"] = load
        add_ratios(name, rows)
        results += rows
        meta["total_s"] = time.perf_counter() - t_start
        _write(results, meta, args.out)   # partial results survive an interrupted run
    meta["total_s"] = time.perf_counter() - t_start
    meta["loadavg_at_end"] = _loadavg()
    text = _write(results, meta, args.out)
    plot(results, os.path.join(args.out, "ratio.png"), METHOD_ORDER)
    print(text)
    print(f"total run time {meta['total_s'] / 60:.1f} min; wrote {args.out}/results.md, "
          f"results.json, ratio.png")


def configs(args) -> list[tuple[str, int]]:
    """The (model, batch size) rows to run: --realistic's (of the --models named, if any), or
    each model's batch sizes (--batches, or the first with --quick)."""
    import models

    if args.host_time:
        return [(name, B) for name, B in models.HOST_TIME
                if args.models is None or name in args.models]
    if args.realistic:
        return [(name, B) for name, B in models.REALISTIC
                if args.models is None or name in args.models]
    out = []
    for name in args.models or models.DEFAULT_MODELS:
        batches = args.batches or models.MODELS[name][2][:1 if args.quick else None]
        out += [(name, B) for B in batches]
    return out


def _write(results, meta, out) -> str:
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    return write_markdown(results, meta, os.path.join(out, "results.md"))


def main() -> None:
    import models

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: first batch size per model, 5 steps after 1 warm-up")
    ap.add_argument("--models", nargs="+", default=None, choices=list(models.MODELS),
                    help="default: models.DEFAULT_MODELS (--realistic: models.REALISTIC's)")
    ap.add_argument("--realistic", action="store_true",
                    help="the rows of models.REALISTIC: each model at the batch size DP users "
                         "train at (no variable-batch check; with --quick: 3 steps, no warm-up)")
    ap.add_argument("--host-time", action="store_true",
                    help="the rows of models.HOST_TIME (kernels that cost next to nothing, so "
                         "the min step is the host's time): 400 steps in blocks of 20, methods "
                         "compile, compile_loss, dpfx, dpfx_loss; no warm-cache process, no "
                         "variable-batch check")
    ap.add_argument("--methods", nargs="+", default=None, choices=METHOD_ORDER,
                    help="default: all (--quick: eager, compile, compile_unrolled, opacus_ghost, "
                         "dpfx)")
    ap.add_argument("--batches", nargs="+", type=int, default=None,
                    help="override the batch sizes (default: each model's two, one with --quick; "
                         "not with --realistic)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20, quick 5)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up steps (default 3, quick 1, realistic quick 0)")
    ap.add_argument("--block", type=int, default=5,
                    help="timed steps per method per round-robin turn (default 5)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--device", default="cpu",
                    help="where the models train: cpu (default) or cuda (Inductor's Triton "
                         "backend; timers read after torch.cuda.synchronize())")
    ap.add_argument("--out", default=os.path.join("benchmarks", "out"))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per worker process")
    ap.add_argument("--warm-cache", action=argparse.BooleanOptionalAction, default=None,
                    help="time the compiling methods' first step again in a second process on "
                         "the caches the first filled (default: on, off with --quick)")
    ap.add_argument("--varbatch", action=argparse.BooleanOptionalAction, default=None,
                    help="dpfx's variable-batch check after the timed steps (default: on, off "
                         "with --realistic)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--jsonl", help=argparse.SUPPRESS)
    ap.add_argument("--progress", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    ap.add_argument("--warm-cache-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--graph-time", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--opake-patches", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.host_time:
        args.warm_cache = bool(args.warm_cache)
        args.varbatch = bool(args.varbatch)
        args.steps = args.steps or 400
        args.block = 20 if args.block == 5 else args.block
        args.methods = args.methods or HOST_METHODS
    if args.warm_cache is None:
        args.warm_cache = not args.quick
    if args.varbatch is None:
        args.varbatch = not args.realistic
    if args.steps is None:
        args.steps = (3 if args.realistic else 5) if args.quick else 20
    if args.warmup is None:
        args.warmup = (0 if args.realistic else 1) if args.quick else 3
    if args.methods is None:
        args.methods = QUICK_METHODS if args.quick else METHOD_ORDER
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
