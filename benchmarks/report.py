"""The report of a benchmark run: results.md (a summary of dpfx against its targets, then
one table per model), the ratios every row carries, and ratio.png. Used by run.py's driver.

    add_ratios("lstm", rows)                     # x base, x compiled, x eager, first x, mem x
    write_markdown(results, meta, "out/results.md")
"""
from __future__ import annotations

# dpfx's targets (BENCHMARKS.md): steady step / the model's baseline, first step, step memory
# (the small rows; the sizes DP users train at have their own: 1.05x a step, 1.25x a first step)
STEP_TARGET = {"mlp": 1.10, "gpt": 1.10, "hf_gpt2": 1.10, "hf_llama": 1.10, "cnn": 1.25,
               "embedding": 1.25, "lstm": 1.5}
FIRST_STEP_TARGET, MEMORY_TARGET = 1.3, 1.2
REALISTIC_STEP_TARGET, REALISTIC_FIRST_STEP_TARGET = 1.05, 1.25


def label(method: str) -> str:
    import methods

    return methods.METHODS[method][0]


def fmt(v, spec):
    return "" if v is None else format(v, spec)


def write_markdown(results: list[dict], meta: dict, path: str) -> str:
    import models

    m = meta["machine"]
    lines = ["# dpfx benchmark results", "",
             f"Command: `{meta['command']}`  ",
             f"Machine: {m['cpu']}, {m['cores']} cores"
             + (f", GPU {m['gpu']} (the models train there)" if m.get("gpu") else "")
             + f", torch {m['torch']} "
             f"({m['torch_threads']} threads), opacus {m['opacus']}, Python {m['python']}  ",
             f"dpfx: commit {m.get('dpfx_commit', '?')}"
             + (f" with uncommitted changes to {', '.join(m['dpfx_uncommitted'])}"
                if m.get('dpfx_uncommitted') else "") + "  ",
             f"Steps: {meta['steps']} timed (round-robin over the methods in blocks of "
             f"{meta.get('block', '?')}) after {meta['warmup']} "
             f"warm-up steps; C = 1, sigma = 1, SGD lr 0.01. Total run time "
             f"{meta['total_s'] / 60:.1f} min; load average at start "
             f"{' '.join(m.get('loadavg_at_start', []))}"
             f"{', at end ' + meta['loadavg_at_end'] if 'loadavg_at_end' in meta else ''}.", "",
             "first step: compilation included (cold caches); warm: the same in a second "
             "process on the caches the first filled. compiles: graphs compiled (dpfx: forward + "
             "backward = 2; torch.compile: dynamo graphs, whose backward is compiled with them). "
             "x base, x eager: median step / the model's non-private baseline's (torch.compile; "
             "the LSTM's: its recurrence unrolled as dpfx captures it, compiled), eager's median "
             "step (min step: the fastest timed step, least disturbed by other load). step mem: "
             "peak tensor memory allocated during one step (CPU allocator, via torch.profiler; "
             "on a GPU, the CUDA caching allocator's peak). "
             "first RSS: growth of the process's peak resident memory during the method's "
             "setup and first step (compile included; a lower bound where an earlier method "
             "freed more; on a GPU, with the allocator's peak above the method's start). "
             "first x, mem x: first step and step memory over the baseline's.", ""]
    lines += summary(results, bool(meta.get("realistic")))
    if meta.get("host_time"):
        lines += host_time(results)
    by_model: dict[str, list[dict]] = {}
    for r in results:
        by_model.setdefault(r["model"], []).append(r)
    for name, rows in by_model.items():
        loads = ", ".join(f"B={b}: {l}" for b, l in dict((r["batch"], r.get("loadavg_before", "?"))
                                                          for r in rows).items())
        lines += [f"## {name}: {models.MODELS[name][3]}", "",
                  f"Load average (1, 5, 15 min) when each batch size started: {loads}.", "",
                  "| B | method | first step (s) | warm (s) | compiles | median step (ms) "
                  "| min step (ms) | x base | x eager | step mem (MB) | first RSS (MB) | first x "
                  "| mem x |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if r["status"] != "ok":
                err = r["error"].replace("|", "\\|")
                lines.append(f"| {r['batch']} | {r['label']} | fails: {err} |" + " |" * 10)
                continue
            lines.append(
                f"| {r['batch']} | {r['label']} | {r['first_step_s']:.2f} | "
                f"{fmt(r.get('first_step_warm_s'), '.2f')} | "
                f"{'' if r['compiles'] is None else r['compiles']} | {r['median_ms']:.2f} | "
                f"{r['min_ms']:.2f} | {fmt(r.get('ratio_to_baseline'), '.2f')} | "
                f"{fmt(r.get('ratio_to_eager'), '.2f')} | {r['step_peak_mb']:.1f} | "
                f"{fmt(r.get('first_step_rss_mb'), '.0f')}"
                + (f" (GPU peak {r['first_step_gpu_peak_mb']:.0f})"
                   if r.get("first_step_gpu_peak_mb") is not None else "") + " | "
                f"{fmt(r.get('first_step_ratio'), '.2f')} | {fmt(r.get('memory_ratio'), '.2f')} |")
        for r in rows:
            if r.get("varbatch"):
                v = r["varbatch"]
                verdict = "ok" if v.get("ok") else "FAILED"
                err = f", error: {v['error']}" if v.get("error") else ""
                lines += ["", f"dpfx variable batch (B={r['batch']}): sizes {v['sizes']}, compiles "
                              f"{v['compiles_before']} -> {v.get('compiles_after')}, "
                              f"{verdict}{err}."]
        lines.append("")
    text = "\n".join(lines)
    with open(path, "w") as f:
        f.write(text)
    return text


# dpfx's Python a step beyond torch.compile's, outside the compiled graphs (ms)
HOST_TARGET_MS = 0.5
# each dpfx method's non-private counterpart in the host-time rows
HOST_BASELINE = {"dpfx": "compile", "dpfx_loss": "compile_loss"}


def host_time(results: list[dict]) -> list[str]:
    """``run.py --host-time``: each step split into its compiled graphs and the Python outside
    them, dpfx's beside its torch.compile counterpart's (min over the timed steps: the host's own
    time, least disturbed by load; median in brackets)."""
    lines = ["## The host's time outside the compiled graphs", "",
             "Each timed step split into the time inside the compiled graphs (kernels, dpfx's DP "
             "kernels among them, and Inductor's code around them) and the time outside them "
             f"(dynamo's guards, aot_autograd's runtime, dpfx's checks and hooks, the loss, the "
             f"optimizer). Min (median) ms over the timed steps; target: dpfx's Python outside "
             f"the graphs at most {HOST_TARGET_MS} ms beyond torch.compile's. Python bytecodes: "
             f"those a steady step executes (sys.settrace, Inductor's generated wrapper code "
             f"included; the same in every counted step).", "",
             "| model | B | method | step | in the graphs | outside | outside, beyond "
             "torch.compile's (target) | Python bytecodes a step |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    key = lambda r: (r["model"], r["batch"], r["method"])
    by = {key(r): r for r in results if r["status"] == "ok" and "outside_min_ms" in r}
    for (model, B, method), r in by.items():
        base = by.get((model, B, HOST_BASELINE.get(method)))
        beyond = ""
        if base is not None:
            d = r["outside_min_ms"] - base["outside_min_ms"]
            beyond = (f"+{d:.2f} ({'met' if d <= HOST_TARGET_MS else 'NOT met'}; median "
                      f"+{r['outside_median_ms'] - base['outside_median_ms']:.2f})")
        lines.append(f"| {model} | {B} | {r['label']} | {r['min_ms']:.2f} ({r['median_ms']:.2f}) "
                     f"| {r['in_graphs_min_ms']:.2f} ({r['in_graphs_median_ms']:.2f}) | "
                     f"{r['outside_min_ms']:.2f} ({r['outside_median_ms']:.2f}) | {beyond} | "
                     f"{_opcodes(r.get('python_opcodes'))} |")
    return lines + [""]


def _opcodes(counts: list[int] | None) -> str:
    if not counts:
        return ""
    low, high = min(counts), max(counts)
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


def summary(results: list[dict], realistic: bool = False) -> list[str]:
    """dpfx's ratios to the baseline beside its targets (``realistic``: the targets of the sizes
    DP users train at), and the fastest private peer."""
    lines = ["## Summary: dpfx against its targets", "",
             "| model | B | step x base (target) | noise alone, x base | fastest peer, x base "
             f"| first step x (target {FIRST_STEP_TARGET}; {REALISTIC_FIRST_STEP_TARGET} at the "
             f"sizes DP users train at) | warm first step, dpfx / base (s) "
             f"| step mem x (target {MEMORY_TARGET}) | LSTM: x ATen's fused kernel |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    mark = lambda v, t: "" if v is None else f"{v:.2f} {'met' if v <= t else 'NOT met'}"
    for r in results:
        if r["method"] not in ("dpfx", "dpfx_loss"):
            continue
        same = [o for o in results if (o["model"], o["batch"]) == (r["model"], r["batch"])]
        model = r["model"] + (", loss captured" if r["method"] == "dpfx_loss" else "")
        if r["status"] != "ok":
            lines.append(f"| {model} | {r['batch']} | dpfx fails |" + " |" * 6)
            continue
        base = next((o for o in same if o["method"] == baseline_of(r["model"])), {})
        peers = [o for o in same if o["status"] == "ok" and o.get("ratio_to_baseline")
                 and not o["method"].startswith("dpfx")
                 and o["method"] not in ("eager", "compile", "compile_loss", "compile_unrolled")]
        peer = min(peers, key=lambda o: o["ratio_to_baseline"], default=None)
        at_size = realistic or r["model"] not in STEP_TARGET   # a realistic model run alone
        target = REALISTIC_STEP_TARGET if at_size else STEP_TARGET[r["model"]]
        first_target = REALISTIC_FIRST_STEP_TARGET if at_size else FIRST_STEP_TARGET
        lines.append(
            f"| {model} | {r['batch']} | "
            f"{mark(r.get('ratio_to_baseline'), target or float('inf'))} ({target}) | "
            f"{fmt(r.get('noise_ratio'), '.2f')} | "
            + (f"{peer['label']} {peer['ratio_to_baseline']:.2f}" if peer else "")
            + f" | {mark(r.get('first_step_ratio'), first_target)} | "
            f"{fmt(r.get('first_step_warm_s'), '.1f')} / {fmt(base.get('first_step_warm_s'), '.1f')}"
            f" | {mark(r.get('memory_ratio'), MEMORY_TARGET)} | "
            + (f"{r['ratio_to_compile']:.2f}" if baseline_of(r["model"]) != "compile"
               and r.get("ratio_to_compile") else "") + " |")
    return lines + [""]


def baseline_of(model: str) -> str:
    import models

    return models.BASELINE.get(model, "compile")


def plot(results: list[dict], path: str, method_order: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = []
    for r in results:
        key = (r["model"], r["batch"])
        if key not in groups:
            groups.append(key)
    methods = [m for m in method_order if m not in ("compile", "compile_unrolled")
               and any(r["method"] == m for r in results)]
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
            if r["status"] == "ok" and r.get("ratio_to_baseline"):
                xs.append(x)
                ys.append(r["ratio_to_baseline"])
            else:
                fails.append(x)
        bars = ax.bar(xs, ys, width, label=label(m))
        if fails:
            ax.plot(fails, [1.0] * len(fails), "x", color=bars.patches[0].get_facecolor()
                    if bars.patches else "k", markersize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\nB={b}" for m, b in groups])
    ax.set_ylabel("median step / non-private baseline (log)")
    ax.set_title("DP-SGD step time relative to non-private torch.compile (LSTM: unrolled); "
                 "x at 1 = method fails", fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_ratios(name: str, rows: list[dict]) -> None:
    """Each row's median over the baselines' (see the module doc); first step and step memory
    over the model's baseline's."""
    ok = {r["method"]: r for r in rows if r["status"] == "ok"}

    def baseline_for(r):
        if "own_baseline" in r:     # timed in the row's own process (run._own_process_rows)
            return r["own_baseline"]
        # dpfx with its loss captured against torch.compile of the model and its loss (the
        # loss's forward and gradient compiled in both), where that baseline ran
        if r["method"] == "dpfx_loss" and baseline_of(name) == "compile" and "compile_loss" in ok:
            return ok["compile_loss"]
        return ok.get(baseline_of(name))

    for r in ok.values():
        own = r.get("own_baseline")
        for key, ref in (("ratio_to_baseline", baseline_for(r)),
                         ("ratio_to_compile", own if own and own["method"] == "compile"
                          else None if own else ok.get("compile")),
                         ("ratio_to_eager", None if own else ok.get("eager"))):
            if ref:
                r[key] = r["median_ms"] / ref["median_ms"]
    for r in ok.values():
        baseline = baseline_for(r)
        if baseline:
            r["first_step_ratio"] = r["first_step_s"] / baseline["first_step_s"]
            r["memory_ratio"] = r["step_peak_mb"] / max(baseline["step_peak_mb"], 1e-9)
            if r.get("noise_ms") is not None:
                r["noise_ratio"] = r["noise_ms"] / baseline["median_ms"]
