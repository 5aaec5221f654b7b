"""Where a training step's time goes, kernel by kernel, inside real steps: dpfx against its
non-private baseline, interleaved in one process.

    python benchmarks/kernels.py cnn                 # the model's quick batch size, 200 steps
    python benchmarks/kernels.py mlp --dpfx-method dpfx_loss   # the loss captured (both sides)
    python benchmarks/kernels.py hf_gpt2 --batch 8 --steps 300 --top 40
    python benchmarks/kernels.py all --out benchmarks/out/kernels.md     # every model, one file
    python benchmarks/kernels.py noise               # the noise kernel against the memory bound
    python benchmarks/kernels.py mlp_1024 --device cuda --steps 50   # a GPU step: host or GPU bound
    python benchmarks/kernels.py mlp_1024 --device cuda --no-loss --inductor combo_kernels=True
    python benchmarks/kernels.py hf_gpt2_256 --device cuda --no-loss --memory   # the peak's buffers

torch.profiler inflates short extern calls about 2x on the 2-core CPU machine (BENCHMARKS.md,
"Measured and not taken"), and a kernel timed alone in a loop runs on warm caches and awake
threads that a step does not give it. This script times each call where the step makes it, with
``time.perf_counter`` around:

- every C++ kernel of every Inductor output module loaded in the process (``cpp_fused_*``),
  labelled with the first characters of its module's name, which tell the graphs apart;
- Inductor's extern kernels (``extern_kernels.mm``, ``bmm``, ``addmm``, ``convolution``, ...);
- every ``OpOverload`` called from Python: dpfx's own ops (``dpfx::add_noise_``,
  ``dpfx::conv2d_input_grad``, ...), the ATen fallbacks Inductor calls, and the eager ops of the
  loss check;
- the Python layers of a step (``LAYERS``, rows marked ``py:``): the generated graph code
  between its kernels, the autograd engine's call (with the hooks not listed separately),
  dpfx's gradient hooks, its loss tracking and check (``TrackedTensor.__torch_function__``,
  whose ``backward`` call holds the check before the engine runs), dpfx's and torch.compile's
  forward calls (with dynamo's guard checks and aot_autograd's runtime wrappers), and the
  optimizer's step and zero_grad.

Every row is its calls' own time: a call's time less that of the timed calls inside it (an
op inside a timed op, kernels inside a graph's Python), so the rows add up, and "the rest" is
what no row covers (the loss's own computation, tensor methods called outside them). Each
wrapper adds about a microsecond per call; the Python rows carry most of that. Figures are per
step: the mean over the steps of the summed own time of a row's calls.

``--device cuda`` reads a GPU step instead, with torch.profiler, which times the GPU's kernels from
the device's own clock: for dpfx and for dpfx with its loss captured, each beside its baseline, the
step's wall time (synchronized), its host time (until ``step()`` returns, unsynchronized), the GPU's
busy time (the kernels' summed durations) and launches per step, the kernels by GPU time, and the
host's time by Python layer, Triton launch and op (the timers above, over steps of their own). A
step whose host time is near its wall time and above its busy time is bound by the host. With
``--memory``, what each method's step holds at its peak, by allocation site (``live_at_peak``).

``noise`` times the noise alone, in ns per sample on 1 and on 2 threads at n = 10M and 100M
floats (``--sizes``), the median of 5 calls after one untimed: dpfx's kernel as the step calls
it (``dpfx::add_noise_``, in place on a parameter-sized buffer: a read and a write per float)
and as ``dpfx::standard_normal`` (a fresh buffer), against ``torch.randn`` (fresh) and
``Tensor.normal_`` (in place), and the machine's memory bounds: ``fill_(1.0)`` and ``zero_()``
on a buffer already written (a write per float), ``add_(1.0)`` (a read and a write, the bound of
the in-place noise) and ``torch.empty(n).fill_(1.0)`` (a write to fresh pages, the page faults
included: the bound of a call that returns a new buffer).
"""
from __future__ import annotations

import argparse
import ast
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import methods  # noqa: E402
import models  # noqa: E402

EXTERNS = ("mm", "bmm", "addmm", "baddbmm", "convolution", "_mm_plus_mm")

# Python layers of a step, timed by their own time (less the timed calls inside them):
# (label, module, attribute path). Wrapped before the models are built, since the gradient hooks
# are bound when dpfx registers them.
LAYERS = [
    ("py: Inductor graph wrapper (Python between kernels)", "torch._inductor.output_code",
     "CompiledFxGraph.__call__"),
    ("py: autograd engine (and untimed hooks)", "torch.autograd", "_engine_run_backward"),
    ("py: dpfx post-accumulate hooks", "dpfx.loss.gate", "ReleaseGate.accumulated"),
    ("py: dpfx loss tracking and check", "dpfx.loss.track", "TrackedTensor.__torch_function__"),
    ("py: dpfx forward call (with dynamo's guards, aot_autograd's runtime)", "dpfx.api",
     "DPModule.forward"),
    ("py: dpfx forward call, loss captured (the same)", "dpfx.api", "DPModule.loss"),
    ("py: torch.compile forward call (dynamo's guards, aot_autograd's runtime)",
     "torch._dynamo.eval_frame", "OptimizedModule.__call__"),
    ("py: torch.compile forward call, model and loss (the same)", "methods", "call_compiled"),
    ("py: optimizer step and zero_grad", "torch.optim.optimizer", "Optimizer.zero_grad"),
]


class Timers:
    """perf_counter wrappers that charge each call's own time (its time less that of the timed
    calls inside it) to (method, label)."""

    def __init__(self):
        self.method = None
        self.children: list[float] = []
        self.layers: list[str] = []    # the Python layers the current call runs inside
        self.ops_wrapped = self.layers_wrapped = False
        self.reset()

    def reset(self) -> None:
        self.spent = collections.defaultdict(float)   # (method, label) -> own seconds
        self.calls = collections.Counter()
        self.within = collections.defaultdict(float)  # (method, innermost layer) -> own seconds
        self.step_timed = 0.0

    def call(self, label, fn, args, kwargs):
        if self.method is None:
            return fn(*args, **kwargs)
        layer = label.startswith("py: ")
        if layer:
            self.layers.append(label)
        inside = self.layers[-1] if self.layers else None
        self.children.append(0.0)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            own = elapsed - self.children.pop()
            if layer:
                self.layers.pop()
            self.spent[self.method, label] += own
            self.calls[self.method, label] += 1
            self.within[self.method, inside] += own
            self.step_timed += own
            if self.children:
                self.children[-1] += elapsed

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            return self.call(label, fn, args, kwargs)
        timed.__wrapped__ = fn
        timed._kernels_timed = True
        return timed

    def install_layers(self) -> None:
        import importlib

        if self.layers_wrapped:
            return
        self.layers_wrapped = True
        for label, module_name, path in LAYERS:
            owner = importlib.import_module(module_name)
            *outer, name = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            if isinstance(fn, classmethod):
                inner = fn.__func__
                setattr(owner, name, classmethod(self.wrap(label, inner)))
            elif not getattr(fn, "_kernels_timed", False):   # (dynamo.disable wraps too)
                setattr(owner, name, self.wrap(label, fn))
        # zero_grad's partner: SGD's step (its updates are Tensor methods, otherwise untimed)
        import torch.optim as optim
        optim.SGD.step = self.wrap("py: optimizer step and zero_grad", optim.SGD.step)

    def install(self) -> None:
        """Wrap the kernels of every Inductor module loaded since the last call, and (once)
        every OpOverload."""
        from torch._inductor.codecache import PyCodeCache

        externs = set()
        for module in list(PyCodeCache.modules):
            tag = Path(module.__file__).name[:6]
            for name, value in list(vars(module).items()):
                if name.startswith("cpp_fused") and callable(value) and not hasattr(
                        value, "__wrapped__"):
                    setattr(module, name, self.wrap(f"{tag}:{name}", value))
                elif name.startswith("triton_") and callable(getattr(value, "run", None)) \
                        and not hasattr(value.run, "__wrapped__"):   # a launch's host time
                    value.run = self.wrap(f"{tag}:launch {name}", value.run)
            extern = getattr(module, "extern_kernels", None)
            if extern is not None and id(extern) not in externs:
                externs.add(id(extern))
                for name in EXTERNS:
                    fn = getattr(extern, name, None)
                    if fn is not None and not hasattr(fn, "__wrapped__"):
                        setattr(extern, name, self.wrap(f"extern {name}", fn))
        if self.ops_wrapped:
            return
        self.ops_wrapped = True
        call = torch._ops.OpOverload.__call__
        timers = self

        def op_call(op, *args, **kwargs):
            return timers.call(f"op {op}", call, (op, *args), kwargs)

        torch._ops.OpOverload.__call__ = op_call


TIMERS = Timers()


def baseline_of(model_name: str, dpfx_method: str) -> str:
    """The model's baseline; for dpfx with the loss captured, torch.compile of the model and
    its loss (as run.py reads that row), but for the LSTM's unrolled baseline."""
    baseline = models.BASELINE.get(model_name, "compile")
    return "compile_loss" if dpfx_method == "dpfx_loss" and baseline == "compile" else baseline


def measure(model_name: str, batch: int, steps: int, dpfx_method: str = "dpfx"
            ) -> tuple[dict, dict, dict]:
    """{method: [step seconds]}, {method: [untimed seconds per step]}, {method: label}; dpfx's
    runs under the key "dpfx" whichever of its methods ``dpfx_method`` names."""
    baseline = baseline_of(model_name, dpfx_method)
    runs, labels = {}, {baseline: methods.METHODS[baseline][0],
                        "dpfx": methods.METHODS[dpfx_method][0]}
    timers = TIMERS
    timers.install_layers()
    data = None
    for method in (baseline, "dpfx"):
        net, x, y = models.build(model_name, batch)
        data = (x, y)
        made = dpfx_method if method == "dpfx" else method
        runs[method] = methods.make(made, net, batch, x, y).step
        for _ in range(3):
            runs[method](x, y)
    timers.install()
    timers.reset()
    totals = {method: [] for method in runs}
    untimed = {method: [] for method in runs}
    for _ in range(steps):
        for method, step in runs.items():
            timers.method, timers.step_timed = method, 0.0
            start = time.perf_counter()
            step(*data)
            totals[method].append(time.perf_counter() - start)
            untimed[method].append(totals[method][-1] - timers.step_timed)
            timers.method = None
    return totals, untimed, labels


LOSS = "py: dpfx loss tracking and check"
NOISE = "op dpfx.add_noise_.default"
FORWARD = ("py: dpfx forward call", "py: torch.compile forward call")
GRAPHS = ("py: Inductor graph wrapper", "py: autograd engine")
HOOKS = ("py: dpfx gradient guard hooks", "py: dpfx post-accumulate hooks")
SUMMARY_HEAD = (
    "| model | B | base step | dpfx step | x | noise | loss check | DP kernels, net | forward "
    "call, over base | graph Python and autograd engine, over base | gradient hooks |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def decompose(model_name: str, batch: int, steps: int, totals: dict, baseline: str) -> str:
    """One summary row: what dpfx's step adds over the baseline's, in ms per step (own times).
    The loss check is its Python layer with the calls made inside it (the scale's eager ops,
    the loss's own computation); the DP kernels are all kernels and ops outside the Python
    layers' own time, less the noise and the loss check's ops, over the baseline's."""
    timers = TIMERS

    def own(method, pred):
        return sum(v for (m, label), v in timers.spent.items() if m == method and pred(label))

    def kernels(method):
        return own(method, lambda label: not label.startswith("py: "))

    loss = sum(v for (m, layer), v in timers.within.items() if m == "dpfx" and layer == LOSS)
    loss_ops = loss - own("dpfx", lambda label: label == LOSS)
    noise = own("dpfx", lambda label: label == NOISE)
    dp_kernels = kernels("dpfx") - noise - loss_ops - kernels(baseline)
    forward = own("dpfx", lambda label: label.startswith(FORWARD)) - own(
        baseline, lambda label: label.startswith(FORWARD))
    graphs = own("dpfx", lambda label: label.startswith(GRAPHS)) - own(
        baseline, lambda label: label.startswith(GRAPHS))
    hooks = own("dpfx", lambda label: label in HOOKS)
    base, dp = (statistics.median(totals[m]) for m in (baseline, "dpfx"))
    cells = [noise, loss, dp_kernels, forward, graphs, hooks]
    return (f"| {model_name} | {batch} | {base * 1e3:.2f} | {dp * 1e3:.2f} | {dp / base:.2f} | "
            + " | ".join(f"{c / steps * 1e3:.2f}" for c in cells) + " |")


def report(model_name: str, batch: int, steps: int, top: int, dpfx_method: str = "dpfx"
           ) -> tuple[str, str]:
    """The model's per-kernel tables, and its summary row."""
    totals, untimed, labels = measure(model_name, batch, steps, dpfx_method)
    timers = TIMERS
    lines = [f"## {model_name}, B={batch}: {steps} interleaved steps per method", ""]
    for method, times in totals.items():
        rows = sorted(((spent / steps, timers.calls[m, label] / steps, label)
                       for (m, label), spent in timers.spent.items() if m == method),
                      reverse=True)
        kinds = collections.defaultdict(float)
        for ms, _, label in rows:
            kinds["Python layers" if label.startswith("py: ") else "kernels and ops"] += ms
        lines += [f"**{labels[method]}**: median step {statistics.median(times) * 1e3:.3f} ms "
                  f"(mean {sum(times) / len(times) * 1e3:.3f}); per step (means): kernels and "
                  f"ops {kinds['kernels and ops'] * 1e3:.3f} ms, the Python layers listed "
                  f"{kinds['Python layers'] * 1e3:.3f} ms; the rest (median) "
                  f"{statistics.median(untimed[method]) * 1e3:.3f} ms", "",
                  "| ms / step | calls / step | kernel, op or Python layer (own time) |",
                  "|---:|---:|---|"]
        lines += [f"| {ms * 1e3:.3f} | {n:g} | `{label}` |" for ms, n, label in rows[:top]]
        if len(rows) > top:
            rest = sum(r[0] for r in rows[top:])
            lines.append(f"| {rest * 1e3:.3f} | | {len(rows) - top} more |")
        lines.append("")
    return "\n".join(lines), decompose(model_name, batch, steps, totals,
                                       baseline_of(model_name, dpfx_method))


def gpu_report(model_name: str, batch: int, steps: int, top: int, loss: bool = True,
               memory: bool = False) -> tuple[str, list[str]]:
    """The GPU step of the baseline, dpfx and (``loss``) dpfx with the loss captured (see the
    module doc): the model's per-kernel tables, (``memory``) what each holds at its peak
    (``live_at_peak``), and its summary rows."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    import run
    run.DEVICE = torch.device("cuda")
    timers = TIMERS
    timers.install_layers()     # before the models are built (module doc of Timers' LAYERS)
    lines, rows = [f"## {model_name}, B={batch} on the GPU: {steps} steps per method", ""], []
    methods_run = (baseline_of(model_name, "dpfx"), "dpfx") + (
        (baseline_of(model_name, "dpfx_loss"), "dpfx_loss") if loss else ())
    for method in dict.fromkeys(methods_run):
        net, x, y = run.on_device(*models.build(model_name, batch))
        step = methods.make(method, net, batch, x, y).step
        try:
            for _ in range(5):
                step(x, y)
        except Exception as e:   # one method's failure leaves the others' figures
            rows.append(f"| {model_name} | {batch} | {methods.METHODS[method][0]} | fails: "
                        f"{type(e).__name__}: {str(e).splitlines()[0][:120]} | | | |")
            continue
        torch.cuda.synchronize()
        walls, hosts = [], []
        for _ in range(steps):
            start = time.perf_counter()
            step(x, y)
            hosts.append(time.perf_counter() - start)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step(x, y)
            torch.cuda.synchronize()
        # The host's own time by Python layer, launch and op, as the CPU mode reads it: the
        # kernels run asynchronously, so each row is the host's time in that call.
        timers.install()
        timers.reset()
        for _ in range(steps):
            timers.method = method
            step(x, y)
            timers.method = None
            torch.cuda.synchronize()
        host_rows = sorted(((spent / steps, timers.calls[m, label] / steps, label)
                            for (m, label), spent in timers.spent.items() if m == method),
                           reverse=True)
        busy, launches = collections.defaultdict(float), collections.Counter()
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                busy[e.name] += e.time_range.elapsed_us() / steps
                launches[e.name] += 1
        total = sum(busy.values())
        wall, host = statistics.median(walls) * 1e3, statistics.median(hosts) * 1e3
        rows.append(f"| {model_name} | {batch} | {methods.METHODS[method][0]} | {wall:.2f} | "
                    f"{host:.2f} | {total / 1e3:.2f} | {sum(launches.values()) / steps:g} |")
        lines += [f"**{methods.METHODS[method][0]}**: wall {wall:.3f} ms, host {host:.3f} ms, "
                  f"GPU busy {total / 1e3:.3f} ms, {sum(launches.values()) / steps:g} kernels "
                  f"and copies per step (medians of {steps} steps; busy and launches: means over "
                  f"{steps} profiled steps)", "", "| GPU ms / step | calls / step | kernel |",
                  "|---:|---:|---|"]
        ranked = sorted(busy.items(), key=lambda kv: -kv[1])
        lines += [f"| {us / 1e3:.3f} | {launches[name] / steps:g} | `{name[:90]}` |"
                  for name, us in ranked[:top]]
        if len(ranked) > top:
            lines.append(f"| {sum(us for _, us in ranked[top:]) / 1e3:.3f} | | "
                         f"{len(ranked) - top} more |")
        lines += ["", f"Host time by call (own time, means over {steps} steps; the rest of the "
                  f"host time is the step's own Python and the ops no row names):", "",
                  "| host ms / step | calls / step | Python layer, launch or op |",
                  "|---:|---:|---|"]
        lines += [f"| {sec * 1e3:.3f} | {n:g} | `{label[:90]}` |"
                  for sec, n, label in host_rows[:top]]
        if len(host_rows) > top:
            lines.append(f"| {sum(r[0] for r in host_rows[top:]) * 1e3:.3f} | | "
                         f"{len(host_rows) - top} more |")
        lines.append("")
        if memory:
            lines += live_at_peak(step, x, y, top)
        del step, net
        torch.cuda.empty_cache()
    return "\n".join(lines), rows


def live_at_peak(step, x, y, top: int) -> list[str]:
    """What one GPU step holds at its peak: the CUDA caching allocator's history of the step
    (``torch.cuda.memory._record_memory_history``) replayed to the instant the step's allocated
    bytes are highest, and the blocks it allocated that are live there, grouped by where they
    were allocated: the line of Inductor's generated code (``buf12 = empty_strided_cuda(...)``,
    its module's first characters telling the graphs apart) or the first frame outside torch."""
    import linecache
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step(x, y)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for trace in snapshot["device_traces"] for e in trace
              if e["action"] in ("alloc", "free_completed")]
    now = peak = peak_at = 0
    for i, e in enumerate(events):
        now += e["size"] if e["action"] == "alloc" else -e["size"]
        if now > peak:
            peak, peak_at = now, i
    live = {}
    for e in events[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        else:
            live.pop(e["addr"], None)

    def site(frames) -> str:
        for f in frames:
            if "torchinductor" in f["filename"] or "inductor_cache" in f["filename"]:
                code = linecache.getline(f["filename"], f["line"]).strip()
                return f"{Path(f['filename']).stem[:6]}: {code[:100]}"
        for f in frames:
            if "/torch/" not in f["filename"]:
                return f"{Path(f['filename']).name}:{f['line']} {f['name']}"
        return f"{frames[0]['filename'].split('/torch/')[-1]}:{frames[0]['line']}" if frames \
            else "?"

    sites = collections.defaultdict(lambda: [0, 0])
    for e in live.values():
        entry = sites[site(e.get("frames", []))]
        entry[0] += e["size"]
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])
    lines = [f"Live at the step's peak: {peak / 2**20:.1f} MB above the step's start, "
             f"{sum(e['size'] for e in live.values()) / 2**20:.1f} MB of it in {len(live)} "
             f"blocks the step allocated (by site; event {peak_at} of {len(events)}):", "",
             "| MB | blocks | allocated at |", "|---:|---:|---|"]
    lines += [f"| {size / 2**20:.2f} | {n} | `{label}` |" for label, (size, n) in ranked[:top]]
    if len(ranked) > top:
        lines.append(f"| {sum(v[0] for _, v in ranked[top:]) / 2**20:.2f} | | "
                     f"{len(ranked) - top} more sites |")
    return lines + [""]


GPU_HEAD = ("| model | B | method | wall ms | host ms | GPU busy ms | kernels / step |\n"
            "|---|---:|---|---:|---:|---:|---:|")


def noise_table(sizes: list[int], threads=(1, 2), repeats: int = 5) -> str:
    """ns per sample of the noise kernels and the memory bounds (see the module doc)."""
    import dpfx.ops.noise  # noqa: F401  (registers the dpfx ops)

    buf = torch.zeros(max(sizes))
    cases = [
        ("dpfx::add_noise_ (in place)", lambda v: torch.ops.dpfx.add_noise_([v], 1.0, 1.0, 1)),
        ("dpfx::standard_normal (fresh buffer)",
         lambda v: torch.ops.dpfx.standard_normal(v.numel(), "cpu")),
        ("torch.randn (fresh buffer)", lambda v: torch.randn(v.numel())),
        ("Tensor.normal_ (in place)", lambda v: v.normal_()),
        ("bound: fill_(1.0), written buffer", lambda v: v.fill_(1.0)),
        ("bound: zero_(), written buffer", lambda v: v.zero_()),
        ("bound: add_(1.0), read and write", lambda v: v.add_(1.0)),
        ("bound: torch.empty(n).fill_(1.0), fresh pages",
         lambda v: torch.empty(v.numel()).fill_(1.0)),
    ]
    cols = [(n, t) for n in sizes for t in threads]
    ns = {}
    before = torch.get_num_threads()
    for n, t in cols:
        torch.set_num_threads(t)
        view = buf[:n]
        for label, fn in cases:
            fn(view)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn(view)
                times.append(time.perf_counter() - start)
            ns[label, n, t] = statistics.median(times) / n * 1e9
    torch.set_num_threads(before)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    head = " | ".join(f"n={n / 1e6:g}M, {t} thr" for n, t in cols)
    lines = [f"## The noise kernel against the memory bound (ns per sample; median of {repeats}; "
             f"load average {load} at the end)", "",
             f"| kernel | {head} |", "|---|" + "---:|" * len(cols)]
    lines += [f"| {label} | " + " | ".join(f"{ns[label, n, t]:.2f}" for n, t in cols) + " |"
              for label, _ in cases]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", choices=sorted(models.MODELS) + ["all", "noise"])
    ap.add_argument("--batch", type=int, help="batch size (default: each model's first)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", help="write the markdown here too")
    ap.add_argument("--dpfx-method", default="dpfx", choices=["dpfx", "dpfx_loss"],
                    help="dpfx_loss: the loss captured with the model (no loss check a step)")
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e7, 1e8],
                    help="noise: the buffer sizes in floats (default 1e7 1e8)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the GPU step through torch.profiler (see the module doc)")
    ap.add_argument("--no-loss", action="store_true",
                    help="cuda: leave out dpfx with the loss captured and its baseline")
    ap.add_argument("--memory", action="store_true",
                    help="cuda: what each method's step holds at its peak, by allocation site")
    ap.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                    help="an Inductor setting for every method of the run (a lever measured on "
                         "both sides), e.g. combo_kernels=True; repeatable")
    args = ap.parse_args()
    import torch._inductor.config
    for setting in args.inductor:     # the whole process: every method compiles under it
        key, value = setting.split("=", 1)
        torch._inductor.config.patch({key: ast.literal_eval(value)}).__enter__()
    if args.models == ["noise"]:
        text = noise_table([int(n) for n in args.sizes])
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        return
    names = list(models.DEFAULT_MODELS) if "all" in args.models else args.models
    parts, rows = [], []
    if args.device == "cuda":
        for name in names:
            text, model_rows = gpu_report(name, args.batch or models.MODELS[name][2][0],
                                          args.steps, args.top, not args.no_loss,
                                          args.memory)
            parts.append(text)
            rows += model_rows
            print(text, flush=True)
        summary = "## GPU steps (ms per step)\n\n" + GPU_HEAD + "\n" + "\n".join(rows) + "\n"
        print(summary)
        if args.out:
            with open(args.out, "w") as f:
                f.write(f"# GPU steps\n\nCommand: `python benchmarks/kernels.py "
                        f"{' '.join(sys.argv[1:])}`  \nGPU: {torch.cuda.get_device_name()}, "
                        f"torch {torch.__version__}\n\n" + summary + "\n" + "\n".join(parts))
        return
    for name in names:
        text, row = report(name, args.batch or models.MODELS[name][2][0], args.steps, args.top,
                           args.dpfx_method)
        parts.append(text)
        rows.append(row)
        print(text, flush=True)
    summary = ("## What dpfx adds to each step (ms per step; means of own times, the steps "
               "medians)\n\n" + SUMMARY_HEAD + "\n" + "\n".join(rows) + "\n")
    print(summary)
    text = summary + "\n" + "\n".join(parts)
    if args.out:
        from run import machine_info
        info = machine_info(torch.get_num_threads())
        head = (f"# Kernel times inside steps\n\nCommand: `python benchmarks/kernels.py "
                f"{' '.join(sys.argv[1:])}`  \nMachine: {info['cpu']}, {info['cores']} cores, "
                f"torch {info['torch']} ({info['torch_threads']} threads)  \n"
                f"dpfx: commit {info.get('dpfx_commit', '?')}\n\n")
        with open(args.out, "w") as f:
            f.write(head + text + "\n")


if __name__ == "__main__":
    main()
