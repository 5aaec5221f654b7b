"""dpfx's benchmark suite: one DP-SGD training step, dpfx against its peers.

    python benchmarks/run.py                 # full run (~30 min on 2 cores)
    python benchmarks/run.py --quick         # smoke run: one batch size per model, few steps
    python benchmarks/run.py --models mlp gpt --out benchmarks/out

For every (model, batch size) a fresh worker process (this file with --worker) runs every method
one after the other; the driver collects their JSON lines and writes results.json, results.md
and ratio.png under --out.

Measurements, per (model, batch, method):
- first step: wall time of the first training step, compilation included. Every method compiles
  cold: dynamo is reset and Inductor gets a fresh, empty cache directory (no FX-graph or kernel
  cache hits from an earlier method or run). The worker warms Inductor's compile workers and C++
  toolchain probe once on a throwaway function before the first method.
- compiles: graphs compiled during the method (dpfx: ``compile_count``; torch.compile methods:
  the delta of ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``).
- median step: median wall time of N steps after warm-up steps.
- x compiled: median step / non-private torch.compile's median step for the same model and batch.
- step memory: peak bytes of tensor memory live during one steady-state step above what was
  live when the step began, from the CPU allocator's own accounting (torch.profiler with
  profile_memory=True records every allocation and free of the c10 CPU allocator, Inductor's
  buffers included); parameters, optimizer state and the model's input are excluded, gradients
  created during the step are included. RSS is not used: ru_maxrss is monotonic over a process
  and includes compile-time memory, and glibc keeps freed pages.
- dpfx variable batch: after the timed steps, 10 steps with Poisson-like batch sizes (0 and 1
  included); dpfx's compile count must stay 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

METHOD_ORDER = ["eager", "compile", "opacus_hooks", "opacus_ghost", "func_eager",
                "func_compile", "dpfx"]
THREADS = 2


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
    """Peak tensor bytes live during one step above the step's start (see the module doc)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(x, y)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    cur = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def warm_inductor():
    """Start Inductor's compile workers and probe the C++ toolchain once, outside any method."""
    import torch

    lin = torch.nn.Linear(4, 4)
    f = torch.compile(lambda x: torch.tanh(lin(x)).sum())
    f(torch.randn(3, 4)).backward()
    torch._dynamo.reset()


def poisson_sizes(B: int, n: int = 10, seed: int = 0) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    sizes = [int(s) for s in torch.poisson(torch.full((n - 2,), float(B)), generator=g)]
    return [sizes[0], 0, sizes[1], 1] + sizes[2:]


def run_method(model_name: str, B: int, method: str, steps: int, warmup: int) -> dict:
    import torch
    from torch._inductor.utils import fresh_cache

    import methods
    import models

    res = {"model": model_name, "batch": B, "method": method,
           "label": methods.METHODS[method][0]}
    torch._dynamo.reset()
    with fresh_cache():
        try:
            model, x, y = models.build(model_name, B)
            m = methods.make(method, model, B, x, y)
            t0 = time.perf_counter()
            m.step(x, y)
            res["first_step_s"] = time.perf_counter() - t0
            for _ in range(warmup):
                m.step(x, y)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                m.step(x, y)
                times.append(time.perf_counter() - t0)
            res["median_ms"] = 1e3 * statistics.median(times)
            res["min_ms"] = 1e3 * min(times)
            res["max_ms"] = 1e3 * max(times)
            res["steps"] = steps
            res["compiles"] = m.compiles() if m.compiles else None
            res["step_peak_mb"] = step_peak_bytes(m.step, x, y) / 2**20
            res["params_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
            if method == "dpfx":
                res["varbatch"] = dpfx_variable_batch(m, model_name, B)
            res["status"] = "ok"
        except Exception as e:  # a method that fails on a model is a result, not a crash
            res["status"] = "fails"
            res["error"] = short_error(e)
            res["traceback"] = traceback.format_exc(limit=-6)
    torch._dynamo.reset()
    return res


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
            x, y = models.make_data(model_name, s, seed=100 + i)
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


def worker(args) -> None:
    import torch

    torch.set_num_threads(THREADS)
    warm_inductor()
    for method in args.methods:
        res = run_method(args.models[0], args.batch, method, args.steps, args.warmup)
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(res) + "\n")
        status = res["status"] if res["status"] == "ok" else "FAILS " + res["error"]
        print(f"  {args.models[0]} B={args.batch} {method:13s} first {res.get('first_step_s', 0):7.2f}s"
              f"  median {res.get('median_ms', float('nan')):9.2f} ms  {status}", flush=True)


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------

def machine_info() -> dict:
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
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": THREADS,
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}
    try:
        import opacus
        info["opacus"] = opacus.__version__
    except Exception:
        info["opacus"] = "not installed"
    try:
        with open("/proc/loadavg") as f:
            info["loadavg_at_start"] = f.read().split()[:3]
    except OSError:
        pass
    return info


def run_config(model: str, B: int, method_list: list[str], args, jsonl: str) -> list[dict]:
    """Run one worker for (model, B); if it dies, record the method it died in and go on."""
    done: list[dict] = []
    todo = list(method_list)
    while todo:
        if os.path.exists(jsonl):
            os.remove(jsonl)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--models", model,
               "--batch", str(B), "--methods", *todo, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--jsonl", jsonl]
        log = os.path.join(args.out, "logs", f"worker-{model}-{B}.log")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        try:
            with open(log, "a") as err:   # warnings and profiler chatter go to the log
                proc = subprocess.run(cmd, timeout=args.timeout, stderr=err)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        got = []
        if os.path.exists(jsonl):
            with open(jsonl) as f:
                got = [json.loads(ln) for ln in f if ln.strip()]
        done += got
        todo = todo[len(got):]
        if todo and rc != 0:
            why = f"worker timed out after {args.timeout}s" if rc == "timeout" \
                else f"worker process died (exit code {rc})"
            done.append({"model": model, "batch": B, "method": todo[0],
                         "label": METHOD_LABELS[todo[0]], "status": "fails", "error": why})
            todo = todo[1:]
        elif todo:
            break
    return done


def fmt(v, spec):
    return "" if v is None else format(v, spec)


def write_markdown(results: list[dict], meta: dict, path: str) -> str:
    import models

    lines = ["# dpfx benchmark results", "",
             f"Command: `{meta['command']}`  ",
             f"Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, "
             f"torch {meta['machine']['torch']} ({meta['machine']['torch_threads']} threads), "
             f"opacus {meta['machine']['opacus']}, Python {meta['machine']['python']}  ",
             f"Steps: {meta['steps']} timed after {meta['warmup']} warm-up steps; "
             f"C = 1, sigma = 1, SGD. Total run time {meta['total_s'] / 60:.1f} min; load average at "
             f"start {' '.join(meta['machine'].get('loadavg_at_start', []))}.", "",
             "first step: compilation included (cold caches). compiles: graphs compiled "
             "(dpfx: forward + backward = 2; torch.compile: dynamo graphs, whose backward is compiled "
             "with them). x compiled, x eager: median step / the non-private torch.compile, eager "
             "median step. "
             "step mem: peak tensor memory allocated during one step (CPU allocator, via "
             "torch.profiler).", ""]
    by_model: dict[str, list[dict]] = {}
    for r in results:
        by_model.setdefault(r["model"], []).append(r)
    for name, rows in by_model.items():
        lines += [f"## {name}: {models.MODELS[name][3]}", "",
                  "| B | method | first step (s) | compiles | median step (ms) | x compiled "
                  "| x eager | step mem (MB) |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if r["status"] != "ok":
                err = r["error"].replace("|", "\\|")
                lines.append(f"| {r['batch']} | {r['label']} | fails: {err} | | | | | |")
                continue
            lines.append(
                f"| {r['batch']} | {r['label']} | {r['first_step_s']:.2f} | "
                f"{'' if r['compiles'] is None else r['compiles']} | {r['median_ms']:.2f} | "
                f"{fmt(r.get('ratio_to_compile'), '.2f')} | {fmt(r.get('ratio_to_eager'), '.2f')} | "
                f"{r['step_peak_mb']:.1f} |")
        vb = [r for r in rows if r.get("varbatch")]
        for r in vb:
            v = r["varbatch"]
            verdict = "ok" if v.get("ok") else "FAILED"
            err = f", error: {v['error']}" if v.get("error") else ""
            lines.append("")
            lines.append(f"dpfx variable batch (B={r['batch']}): sizes {v['sizes']}, compiles "
                         f"{v['compiles_before']} -> {v.get('compiles_after')}, "
                         f"{verdict}{err}.")
        lines.append("")
    text = "\n".join(lines)
    with open(path, "w") as f:
        f.write(text)
    return text


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = []
    for r in results:
        key = (r["model"], r["batch"])
        if key not in groups:
            groups.append(key)
    methods = [m for m in METHOD_ORDER if m != "compile"]
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 5))
    for j, m in enumerate(methods):
        xs, ys, fails = [], [], []
        for i, key in enumerate(groups):
            r = next((r for r in results if (r["model"], r["batch"]) == key
                      and r["method"] == m), None)
            if r is None:
                continue
            x = i + (j - (len(methods) - 1) / 2) * width
            if r["status"] == "ok" and r.get("ratio_to_compile"):
                xs.append(x)
                ys.append(r["ratio_to_compile"])
            else:
                fails.append(x)
        bars = ax.bar(xs, ys, width, label=METHOD_LABELS[m])
        if fails:
            ax.plot(fails, [1.0] * len(fails), "x", color=bars.patches[0].get_facecolor()
                    if bars.patches else "k", markersize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\nB={b}" for m, b in groups])
    ax.set_ylabel("median step / non-private torch.compile (log)")
    ax.set_title("DP-SGD step time relative to non-private torch.compile (x at 1 = method fails)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


METHOD_LABELS = {
    "eager": "non-private eager",
    "compile": "non-private torch.compile",
    "opacus_hooks": "Opacus hooks",
    "opacus_ghost": "Opacus ghost clipping",
    "func_eager": "torch.func vmap(grad), eager",
    "func_compile": "torch.func vmap(grad), torch.compile",
    "dpfx": "dpfx (inductor)",
}


def driver(args) -> None:
    import models

    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    command = "python benchmarks/run.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    meta = {"command": command.strip(), "machine": machine_info(), "steps": args.steps,
            "warmup": args.warmup, "quick": args.quick}
    print(f"{meta['machine']['cpu']}, {meta['machine']['cores']} cores, torch "
          f"{meta['machine']['torch']}; {args.steps} steps after {args.warmup} warm-up", flush=True)
    results = []
    for name in args.models:
        batches = models.MODELS[name][2]
        if args.batches:
            batches = args.batches
        elif args.quick:
            batches = batches[:1]
        for B in batches:
            jsonl = os.path.join(args.out, f".worker-{name}-{B}.jsonl")
            rows = run_config(name, B, args.methods, args, jsonl)
            if os.path.exists(jsonl):
                os.remove(jsonl)
            for key, ref in (("ratio_to_compile", "compile"), ("ratio_to_eager", "eager")):
                base = next((r for r in rows if r["method"] == ref and r["status"] == "ok"), None)
                for r in rows:
                    if base and r["status"] == "ok":
                        r[key] = r["median_ms"] / base["median_ms"]
            results += rows
            meta["total_s"] = time.perf_counter() - t_start
            _write(results, meta, args.out)   # partial results survive an interrupted run
    meta["total_s"] = time.perf_counter() - t_start
    text = _write(results, meta, args.out)
    plot(results, os.path.join(args.out, "ratio.png"))
    print(text)
    print(f"total run time {meta['total_s'] / 60:.1f} min; wrote {args.out}/results.md, "
          f"results.json, ratio.png")


def _write(results, meta, out) -> str:
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    return write_markdown(results, meta, os.path.join(out, "results.md"))


def main() -> None:
    import models

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: first batch size per model, 5 steps after 1 warm-up")
    ap.add_argument("--models", nargs="+", default=list(models.MODELS), choices=list(models.MODELS))
    ap.add_argument("--methods", nargs="+", default=METHOD_ORDER, choices=METHOD_ORDER)
    ap.add_argument("--batches", nargs="+", type=int, default=None,
                    help="override the batch sizes (default: each model's two, one with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20, quick 5)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3, quick 1)")
    ap.add_argument("--out", default=os.path.join("benchmarks", "out"))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per worker process")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--jsonl", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 5 if args.quick else 20
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
