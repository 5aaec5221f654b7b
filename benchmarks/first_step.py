"""Where the first step's time goes: dpfx against non-private torch.compile, cold and warm.

    python benchmarks/first_step.py                         # mlp gpt hf_gpt2, cold and warm
    python benchmarks/first_step.py --models mlp_d2 mlp_d4 mlp_d8 mlp_d16   # depth scaling
    python benchmarks/first_step.py --models gpt --repeats 3 --json out.json
    python benchmarks/first_step.py --dpfx before=/path/to/old/checkout   # before/after
    python benchmarks/first_step.py --models hf_gpt2_256 --cold-only  # a realistic size, cold
    python benchmarks/first_step.py --models mlp_mnist --loss-captured  # and the loss captured
    python benchmarks/first_step.py --models hf_llama_256 --cold-only --poisson  # batch varies
    python benchmarks/first_step.py --models hf_gpt2_d128_l2 hf_gpt2_d128_l12 --cold-only \
        --blocks     # deep models: regional torch.compile and dpfx's per-block graphs too
    python benchmarks/first_step.py --models hf_gpt2_d128_l12 --cold-only --blocks --warmup
                     # the warm-up: steps until the step time settles, for every method

For every model and repeat, fresh processes run one training step each (forward, loss,
backward, SGD step; B = the model's first quick batch size) in this order: torch.compile cold
(for the LSTM, its recurrence unrolled as dpfx captures it: run.py's baseline for that row),
dpfx cold (and each ``--dpfx`` variant), then the same warm (unless ``--cold-only``). "Cold" is
an empty Inductor cache directory; "warm" is a second process on the directory its cold run
filled (what a user's second run of the same script pays). Each process first compiles a
throwaway function in another cache directory, as run.py's workers do: Inductor's compile
workers and C++ toolchain probe are per-process costs that both methods pay alike, kept out of
the comparison.

The split comes from Inductor's own timers (``torch._dynamo.utils.compilation_time_metrics``)
and from timers this script wraps around dpfx's functions (each phase's own time, without the
timed calls nested in it):
- dynamo: dynamo's tracing and guards (``_compile.compile_inner`` less the backend call);
- aot_autograd: the backend call less what is listed below (joint trace, decompositions,
  partitioner); torch.compile compiles its backward at the first backward, dpfx at the forward
  (force_non_lazy_backward_lowering), so dpfx's figure also holds the backward's share;
- loss capture: with ``--loss-captured``, cutting, proving and tracing the loss (capture_loss);
- dpfx passes: batch analysis (``BatchAnalysis`` construction and reruns, sympy), the rewrite
  (stacking over time, per-sample rewrite, clip and noise), the proofs (``check_forward``,
  ``verify_backward``), the readable stage texts (``Stages.record``), and "passes other", the
  rest of ``compile_forward`` / ``compile_backward``;
- lowering fw / bw: Inductor's ``compile_fx_inner`` per graph; "C++ compile" is the summed time
  of its ``compile_file`` calls (these may overlap on the compile threads);
- self-check: copying the graphs for it (``Half.of``) and running it (``GraphCheck.run``),
  less "builds waited": the C++ builds that are still running when the check starts, waited
  for there (they would be waited for at the first call without it);
- other: the rest of the step (running the graphs, the loss check, the optimizer).
With ``--poisson``, each process then takes a second step at B - 1 examples, as Poisson
sampling's next batch would be, timed alone ("second step"), and the methods include
``compile_dynamic``: torch.compile with dim 0 of every input marked dynamic
(``torch._dynamo.mark_dynamic``), what a user who knows the batch varies writes. torch.compile
by default compiles the first batch size statically and recompiles with a dynamic batch at the
second (dynamo's automatic dynamic shapes); dpfx's one compile with the unbacked batch serves
both. The LSTM's baseline (its recurrence unrolled) has no dynamic variant.
With ``--blocks``, the methods include ``compile_regional`` (torch's recipe for deep models:
``block.compile()`` on each repeated block, the rest eager) and ``dpfx_blocks``
(``dpfx.compile(model, blocks="auto")``: each distinct block one private graph, compiled once).
With ``--warmup``, each process goes on stepping on the same batch until the step time settles
(Note [The warm-up, not the first step]) and reports the warm-up, the steady step and the step
at which it settled, for every method alike.
Each process also reports its peak RSS (``ru_maxrss``: the throwaway compile and the model's
build included, so compare methods, not absolute figures).
Timers are disturbed by other load on a shared machine: compare methods within one repeat.
"""
from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

DEFAULT_MODELS = ("mlp", "gpt", "hf_gpt2")
PHASES = ("blocks", "dynamo", "aot_autograd", "batch analysis", "rewrite", "verify", "stage texts",
          "loss capture",
          "passes other", "lowering fw", "lowering bw", "C++ compile", "self-check", "builds waited",
          "other")


# Note [The warm-up, not the first step]
# Work a method defers past its first step (a backward compiled at the first backward, lazy
# kernel builds, a recompile at the second call, a cache filled by the third) is invisible in
# the first step's time, in dpfx and in its baselines alike. So the figure for a compile is the
# warm-up: the wall time of every step until the step time settles, less as many steady steps.
# The steady step is the median of the last SETTLE_WINDOW steps; the run has settled once those
# steps lie within SETTLE_SPREAD of their median (at least MIN_STEPS steps, at most MAX_STEPS);
# "settled at" is the first step after which no step took more than SETTLE_SPREAD over the
# steady one.
MIN_STEPS, MAX_STEPS, SETTLE_WINDOW, SETTLE_SPREAD = 12, 40, 5, 0.15


def settled(times: list[float]) -> bool:
    """Whether the last SETTLE_WINDOW step times lie within SETTLE_SPREAD of their median."""
    if len(times) < max(MIN_STEPS, SETTLE_WINDOW):
        return False
    last = times[-SETTLE_WINDOW:]
    mid = statistics.median(last)
    return max(last) <= mid * (1 + SETTLE_SPREAD) and min(last) >= mid * (1 - SETTLE_SPREAD)


def warmup_figures(times: list[float]) -> dict:
    """The warm-up (all steps less as many steady ones), the steady step and where it settled
    (Note [The warm-up, not the first step])."""
    steady = statistics.median(times[-SETTLE_WINDOW:])
    late = [i for i, t in enumerate(times) if t > steady * (1 + SETTLE_SPREAD)]
    return {"warmup": sum(times) - len(times) * steady, "steady": steady,
            "settled at": (late[-1] + 2) if late else 1, "steps": len(times),
            "step times": times}


def build(name: str):
    """(model, x, y, B) for a benchmark model, a depth variant: mlp_d<n> (n hidden layers of
    512) or gpt_l<n> (n blocks), or mlp_mnist (784-1024-1024-10 at B = 1024, FACTS' MLP)."""
    import torch
    import models

    if name == "mlp_mnist":
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 10))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(1024, 784, generator=g), torch.randint(0, 10, (1024,), generator=g)
        return model, x, y, 1024

    if name.startswith("mlp_d"):
        depth = int(name[len("mlp_d"):])
        torch.manual_seed(0)
        layers = [torch.nn.Linear(64, 512), torch.nn.ReLU()]
        for _ in range(depth - 1):
            layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))
        x, y = models.make_data("mlp", 64, 1)
        return model, x, y, 64
    if name.startswith("gpt_l"):
        torch.manual_seed(0)
        model = models.GPT(layers=int(name[len("gpt_l"):]))
        x, y = models.make_data("gpt", 16, 1)
        return model, x, y, 16
    B = models.MODELS[name][2][0]
    model, x, y = models.build(name, B)
    return model, x, y, B


class Timers:
    """Exclusive wall time of wrapped functions by phase: a timed call inside another timed call
    counts for its own phase only (a re-entered phase counts once, at its outermost call)."""

    def __init__(self):
        self.spent: dict[str, float] = {}
        self._stack: list[list] = []   # [phase, start, time spent in nested timed calls]

    def wrap(self, owner, attr: str, phase: str, by_args=None) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            name = by_args(args) if by_args else phase
            if any(frame[0] == name for frame in self._stack):
                return original(*args, **kwargs)
            self._stack.append([name, time.perf_counter(), 0.0])
            try:
                return original(*args, **kwargs)
            finally:
                _, t0, nested = self._stack.pop()
                elapsed = time.perf_counter() - t0
                self.spent[name] = self.spent.get(name, 0.0) + elapsed - nested
                if self._stack:
                    self._stack[-1][2] += elapsed

        setattr(owner, attr, timed)

    def wrap_function(self, fn, phase: str):
        """``fn`` timed as ``phase`` (for a name another module imported)."""
        holder = type("Holder", (), {"fn": staticmethod(fn)})
        self.wrap(holder, "fn", phase)
        return holder.fn


def instrument_dpfx(timers: Timers) -> None:
    import dpfx.backend as backend
    import dpfx.passes as passes
    import dpfx.lower.selfcheck as selfcheck

    import dpfx.blocks as blocks
    import dpfx.blocks.selfcheck as block_check

    # dpfx_blocks: the probes and every distinct block's whole compile, before the model's
    timers.wrap(blocks, "prepare", "blocks")
    timers.wrap(passes.BatchAnalysis, "__init__", "batch analysis")
    timers.wrap(passes.BatchAnalysis, "rerun", "batch analysis")
    for fn in ("stack_over_time", "rewrite_per_sample", "insert_clip_and_noise"):
        timers.wrap(passes, fn, "rewrite")
    timers.wrap(passes, "check_forward", "verify")
    timers.wrap(passes, "verify_backward", "verify")
    timers.wrap(passes.Stages, "record", "stage texts")
    timers.wrap(backend, "compile_forward", "passes")
    timers.wrap(backend, "compile_backward", "passes")
    timers.wrap(backend, "lower", "lowering",
                by_args=lambda a: "lowering bw" if a[2].get("is_backward") else "lowering fw")
    backend.capture_loss = timers.wrap_function(backend.capture_loss, "loss capture")
    timers.wrap(selfcheck.Half, "of", "self-check copy")
    timers.wrap(selfcheck.GraphCheck, "run", "self-check run")
    # the C++ builds the first run waits for (Note [A graph's C++ builds run while the next
    # graph lowers]): the builds' time, which the self-check's start only happens to meet
    timers.wrap(selfcheck.check, "finish_builds", "builds waited")
    timers.wrap(block_check, "finish_builds", "builds waited")


def worker(args) -> None:
    import torch

    from run import warm_inductor
    import methods
    import models
    from models import forward, loss_fn

    warmup_dir = tempfile.mkdtemp(prefix="dpfx-first-warmup-")
    atexit.register(shutil.rmtree, warmup_dir, True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = warmup_dir
    warm_inductor()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir
    from torch._dynamo.utils import compilation_time_metrics, counters
    from torch._inductor.utils import clear_caches

    clear_caches()
    compilation_time_metrics.clear()
    counters.clear()
    timers = Timers()
    inside = []     # the lowering time within dynamo's backend call (torch.compile's methods)
    if args.method not in ("dpfx", "dpfx_loss", "dpfx_blocks"):
        from torch._dynamo.output_graph import OutputGraph
        call_user_compiler = OutputGraph.call_user_compiler

        def lowered_inside(self, *a, **kw):
            before = sum(compilation_time_metrics.get("compile_fx_inner", []))
            try:
                return call_user_compiler(self, *a, **kw)
            finally:
                inside.append(sum(compilation_time_metrics.get("compile_fx_inner", [])) - before)

        OutputGraph.call_user_compiler = lowered_inside
    model, x, y, B = build(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=methods.LR)
    if args.method in ("dpfx", "dpfx_loss", "dpfx_blocks"):
        import dpfx
        instrument_dpfx(timers)
        captured = {"loss": models.captured_loss} if args.method == "dpfx_loss" else {}
        if args.method == "dpfx_blocks":
            captured = {"blocks": "auto"}
        run = dpfx.compile(model, max_grad_norm=methods.C, noise_multiplier=methods.SIGMA,
                           expected_batch_size=B, **captured)
    elif args.method == "compile_regional":
        from dpfx.blocks import select
        for _, block in select(model, "auto"):
            block.compile()
        run = model
    else:
        run = torch.compile(model)
    if args.method == "compile_dynamic":
        for t in (x.values() if isinstance(x, dict) else [x]):
            torch._dynamo.mark_dynamic(t, 0)
    # the LSTM's baseline is its recurrence written out as dpfx captures it, compiled without DP
    # (Note [The LSTM's baseline] in models.py); torch.compile alone would run ATen's fused kernel
    unrolled = args.method == "compile" and models.BASELINE.get(args.model) == "compile_unrolled"
    if unrolled:
        from dpfx.capture.swaps import traceable_torch
    def step(x, y):
        if args.method == "dpfx_loss":
            run.loss(x, y).backward()
        elif unrolled:
            with traceable_torch():
                out = forward(run, x)
            loss_fn(out, y).backward()
        else:
            out = forward(run, x)
            loss_fn(out, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step(x, y)
    total = time.perf_counter() - t0

    metric = {k: sum(v) for k, v in compilation_time_metrics.items()}
    spent = timers.spent
    import resource
    result = {"model": args.model, "method": args.method, "warm": args.warm, "total": total,
              # the process's peak, the throwaway compile and the model's build included
              "peak rss GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
              "dynamo graphs": len(compilation_time_metrics.get("_compile.compile_inner", [])),
              "fxgraph hits": counters["inductor"]["fxgraph_cache_hit"],
              "fxgraph misses": counters["inductor"]["fxgraph_cache_miss"],
              "fxgraph bypasses": counters["inductor"]["fxgraph_cache_bypass"]}
    backend_call = metric.get("OutputGraph.call_user_compiler", 0.0)
    phases = {"dynamo": metric.get("_compile.compile_inner", 0.0) - backend_call,
              "C++ compile": metric.get("compile_file", 0.0)}
    if args.method in ("dpfx", "dpfx_loss", "dpfx_blocks"):
        phases["blocks"] = spent.get("blocks", 0.0)
        passes = ("batch analysis", "rewrite", "verify", "stage texts", "loss capture")
        phases.update({p: spent.get(p, 0.0) for p in passes})
        phases["lowering fw"] = spent.get("lowering fw", 0.0)
        phases["lowering bw"] = spent.get("lowering bw", 0.0)
        phases["self-check"] = spent.get("self-check copy", 0.0) + spent.get("self-check run", 0.0)
        phases["passes other"] = spent.get("passes", 0.0)
        phases["aot_autograd"] = backend_call - sum(phases[p] for p in passes) \
            - phases["passes other"] - phases["lowering fw"] - phases["lowering bw"] \
            - spent.get("self-check copy", 0.0)
        result["self-check run"] = spent.get("self-check run", 0.0)
        phases["builds waited"] = spent.get("builds waited", 0.0)
    else:
        lowerings = compilation_time_metrics.get("compile_fx_inner", [])  # forward, backward
        phases["lowering fw"] = sum(lowerings[:1])
        phases["lowering bw"] = sum(lowerings[1:])
        # the backward lowers at the first backward, or inside the backend call (dynamic shapes)
        phases["aot_autograd"] = backend_call - sum(inside)
    counted = ("dynamo", "aot_autograd", "lowering fw", "lowering bw", "self-check", "blocks",
               "builds waited",
               "batch analysis", "rewrite", "verify", "stage texts", "loss capture",
               "passes other")
    phases["other"] = total - sum(phases.get(p, 0.0) for p in counted)
    result["phases"] = phases
    if args.warmup:
        times = [total]
        while len(times) < MAX_STEPS and not settled(times):
            t1 = time.perf_counter()
            step(x, y)
            times.append(time.perf_counter() - t1)
        result.update(warmup_figures(times))
        result["settled"] = settled(times)
    if args.poisson:
        # the next Poisson batch: B - 1 examples (fresh tensors, as a loader yields)
        x2 = ({k: v[:B - 1].clone() for k, v in x.items()} if isinstance(x, dict)
              else x[:B - 1].clone())
        graphs = len(compilation_time_metrics.get("_compile.compile_inner", []))
        t1 = time.perf_counter()
        step(x2, y[:B - 1].clone())
        result["second"] = time.perf_counter() - t1
        result["second compiles"] = len(
            compilation_time_metrics.get("_compile.compile_inner", [])) - graphs
    print("RESULT " + json.dumps(result), flush=True)


def run_one(model: str, method: str, cache_dir: str, warm: bool, source: str | None,
            poisson: bool = False, warmup: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", model,
           "--method", method if method in ("compile", "compile_dynamic", "dpfx_loss",
                                            "compile_regional", "dpfx_blocks")
           else "dpfx", "--cache-dir", cache_dir] + (["--warm"] if warm else []) + (
               ["--poisson"] if poisson else []) + (["--warmup"] if warmup else [])
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = os.pathsep.join([source, env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"model": model, "method": method, "warm": warm,
            "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}


def driver(args) -> None:
    """Per model and repeat: every method cold, then every method warm, each in its own
    process; ``--dpfx NAME=PATH`` adds dpfx imported from another source tree (before/after)."""
    import models

    sources = {"compile": None, "dpfx": None}
    if args.loss_captured:
        sources["dpfx_loss"] = None
    if args.poisson:
        sources = {"compile": None, "compile_dynamic": None, **sources}
    if args.blocks:
        sources.update(compile_regional=None, dpfx_blocks=None)
    sources.update(dict(v.split("=", 1) for v in args.dpfx))
    rows = []
    for model in args.models:
        for rep in range(args.repeats):
            dirs = {m: tempfile.mkdtemp(prefix="dpfx-first-") for m in sources}
            for warm in (False,) if args.cold_only else (False, True):
                for method, source in sources.items():
                    if method == "compile_dynamic" and model in models.BASELINE:
                        continue    # the LSTM's unrolled baseline has no dynamic variant
                    r = run_one(model, method, dirs[method], warm, source, args.poisson,
                                args.warmup)
                    r.update(method=method, repeat=rep)
                    rows.append(r)
                    print(_line(r), flush=True)
            for d in dirs.values():
                shutil.rmtree(d, ignore_errors=True)
    print()
    print(table(rows, [m for m in sources if m != "compile"]))
    if args.poisson:
        print()
        print(poisson_table(rows))
    if args.warmup:
        print()
        print(warmup_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def _median(rows: list[dict], model: str, warm: bool, method: str, key: str) -> float:
    """The median over repeats of ``key`` for one model, caches and method (nan: not run)."""
    vals = [r[key] for r in rows if r["model"] == model and r["method"] == method
            and r["warm"] == warm and key in r]
    return statistics.median(vals) if vals else float("nan")


def poisson_table(rows: list[dict]) -> str:
    """Medians over repeats of the first step (B), the second (B - 1) and both, cold and (where
    run) warm, and the second step's dynamo compiles; x: both steps over torch.compile's."""
    out = ["| model | caches | method | first step (s) | second step, B - 1 (s) | its compiles "
           "| both (s) | x compile |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        for warm in (False, True):
            med = functools.partial(_median, rows, model, warm)
            base = med("compile", "total") + med("compile", "second")
            if base != base:        # not run (--cold-only)
                continue
            for method in dict.fromkeys(r["method"] for r in rows if r["model"] == model):
                first, second = med(method, "total"), med(method, "second")
                out.append(f"| {model} | {'warm' if warm else 'cold'} | {method} | {first:.2f} | "
                           f"{second:.2f} | {med(method, 'second compiles'):.0f} | "
                           f"{first + second:.2f} | {(first + second) / base:.2f} |")
    return "\n".join(out)


def warmup_table(rows: list[dict]) -> str:
    """Medians over repeats of the first step, the warm-up, the steady step and the step it
    settled at, per model, caches and method; x: the warm-up over regional torch.compile's where
    it ran, else over torch.compile's, and the steady step over torch.compile's."""
    out = ["| model | caches | method | first step (s) | warm-up (s) | x | steady (ms) | x compile "
           "| settled at step |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        for warm in (False, True):
            med = functools.partial(_median, rows, model, warm)
            base = med("compile_regional", "warmup")
            if base != base:
                base = med("compile", "warmup")
            steady = med("compile", "steady")
            if steady != steady:
                continue
            for method in dict.fromkeys(r["method"] for r in rows if r["model"] == model):
                w, s = med(method, "warmup"), med(method, "steady")
                if w != w:      # failed or not run
                    continue
                out.append(f"| {model} | {'warm' if warm else 'cold'} | {method} | "
                           f"{med(method, 'total'):.2f} | {w:.2f} | {w / base:.2f} | "
                           f"{s * 1e3:.1f} | {s / steady:.2f} | {med(method, 'settled at'):.0f} |")
    return "\n".join(out)


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['model']} {r['method']} {'warm' if r['warm'] else 'cold'}: {r['error']}"
    ph = " ".join(f"{k}={v:.2f}" for k, v in r["phases"].items() if abs(v) >= 0.005)
    return (f"{r['model']} {r['method']} {'warm' if r['warm'] else 'cold'}: {r['total']:.2f} s "
            f"(graphs {r['dynamo graphs']}, fxgraph hit/miss/bypass {r['fxgraph hits']}/"
            f"{r['fxgraph misses']}/{r['fxgraph bypasses']}, peak RSS "
            f"{r['peak rss GB']:.2f} GB) {ph}" + (
                f"; second step (B - 1) {r['second']:.2f} s, {r['second compiles']} compiles"
                if "second" in r else "") + (
                f"; warm-up {r['warmup']:.2f} s, steady {r['steady'] * 1e3:.1f} ms, settled at "
                f"step {r['settled at']} of {r['steps']}" + ("" if r["settled"] else " (NOT settled)")
                if "warmup" in r else ""))


def table(rows: list[dict], variants: list[str]) -> str:
    """Medians over repeats: first step cold and warm per method, x torch.compile's, the split
    of torch.compile's and each dpfx variant's first step, in seconds and as shares of it."""
    head = "| model | compile cold (s) | compile warm (s) |"
    rule = "|---|---:|---:|"
    for v in variants:
        head += f" {v} cold (s) | x | {v} warm (s) | x |"
        rule += "---:|---:|---:|---:|"
    out = [head, rule]
    splits = []
    for model in dict.fromkeys(r["model"] for r in rows):
        def med(method, warm, key=None):
            vals = [r["total"] if key is None else r["phases"].get(key, 0.0) for r in rows
                    if r["model"] == model and r["method"] == method and r["warm"] == warm
                    and "error" not in r]
            return statistics.median(vals) if vals else float("nan")
        cc, cw = med("compile", False), med("compile", True)
        line = f"| {model} | {cc:.2f} | {cw:.2f} |"
        for v in variants:
            dc, dw = med(v, False), med(v, True)
            line += f" {dc:.2f} | {dc / cc:.2f} | {dw:.2f} | {dw / cw:.2f} |"
        for v in ["compile", *variants]:
            for warm in (False, True):
                total = med(v, warm)
                if total != total:   # not run (--cold-only) or failed
                    continue
                split = ", ".join(f"{p} {med(v, warm, p):.2f} ({med(v, warm, p) / total:.0%})"
                                  for p in PHASES if med(v, warm, p) >= 0.005)
                rss = statistics.median(r["peak rss GB"] for r in rows if r["model"] == model
                                        and r["method"] == v and r["warm"] == warm
                                        and "error" not in r)
                splits.append(f"- {model}, {v} {'warm' if warm else 'cold'} ({total:.2f} s, "
                              f"peak RSS {rss:.2f} GB): {split}")
        out.append(line)
    return "\n".join(out + [""] + splits)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--cold-only", action="store_true",
                    help="skip the warm runs (the second process on the filled cache)")
    ap.add_argument("--json", default=None, help="write every run's figures here")
    ap.add_argument("--loss-captured", action="store_true",
                    help="also dpfx with the loss captured (dpfx.compile(model, loss=fn))")
    ap.add_argument("--dpfx", action="append", default=[], metavar="NAME=PATH",
                    help="also run dpfx imported from the source tree PATH, as method NAME")
    ap.add_argument("--poisson", action="store_true",
                    help="also a second step at B - 1 (Poisson sampling's next batch), and "
                         "torch.compile with a dynamic batch (compile_dynamic)")
    ap.add_argument("--blocks", action="store_true",
                    help="also regional torch.compile and dpfx with blocks='auto'")
    ap.add_argument("--warmup", action="store_true",
                    help="step until the step time settles: the warm-up and the steady step")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
