"""Whole training steps of one benchmark model under several variants of dpfx, interleaved in
one process: what a kernel or a code path is worth inside the step, where caches are colder
than in a loop over one call.

A variant is a name, the method that builds its step (``methods.METHODS``) and a context-manager
factory entered around building and around every one of its steps (the switch it measures:
a patched function, another kernel library). ``rounds`` rounds each run one step of every
variant in turn, so load drift falls on all of them alike. Used by ``im2col.py --step`` and
``conv_layout.py --step``, and run as a script for the noise at the optimizer:

    python benchmarks/step_ab.py optimizer_noise hf_gpt2_124m 4 --rounds 8

(``noise="optimizer"``, what distributed and sharded training run: each clipped sum noised where
it lies, against the flat buffer with the normals added in place, and against the flat buffer
with a buffer of normals as before 2026-11-27, beside the graph's noise), and for dpfx's GPU
graphs with and without Inductor's combo kernels, beside torch.compile with and without them,
interleaved on the device:

    python benchmarks/step_ab.py combo_kernels hf_gpt2_256 16 --rounds 30 --device cuda

and for the per-sample conv2d product's chunks of at least 8 examples against chunks of 1 MiB of
patches (Note [Per-sample conv2d gradients in chunks of examples]):

    python benchmarks/step_ab.py conv_chunks resnet_gn 256 --rounds 30

and for vector parameters' per-sample gradients stacked into one norm and one clipped sum
against each on its own (Note [Vector parameters' per-sample gradients stacked]):

    python benchmarks/step_ab.py vector_stacks hf_gpt2_256 16 --rounds 20

and for the compiled graphs called with the dispatcher's autograd keys excluded against through
them (Note [Compiled graphs run below autograd]), with blocks and in one graph:

    python benchmarks/step_ab.py below_autograd hf_gpt2_d128_l12 8 --rounds 20

and for a pointwise value read by several kernels stored once where its inputs then die, against
Inductor's choice of computing it inside each (Note [A shared sum stored so that its inputs die]):

    python benchmarks/step_ab.py shared_sums resnet_gn 256 --rounds 20

and for the correlated-noise state (``DPOptimizer(mechanism=)``: BandMF with 4 bands, BLT with 4
buffers) against Gaussian noise, all three with ``noise="optimizer"``; below the table, each
state's bytes per trainable parameter, measured from its buffers:

    python benchmarks/step_ab.py noise_mechanism hf_gpt2_256 16 --rounds 30

and for every per-sample gradient materialized against dpfx's default choice of forms
(docs/ARCHITECTURE.md, "Strategies"), at a realistic size:

    python benchmarks/step_ab.py strategy hf_gpt2_256 16 --rounds 8

and for per-block private graphs (``blocks="auto"``: each decoder layer one op calling its
compiled block) against the one graph of the whole model, at 12 layers:

    python benchmarks/step_ab.py blocks hf_gpt2_d128_l12 8 --rounds 20

A round's order is not neutral: the variant stepped right after the baseline can pay for what
the baseline's step left in memory (GPT-2 small, B = 4: about 5% of the step, whichever variant
came first; ``latest/step_ab_vector_stacks.md``), so a difference of that size is read with the
variants also in the other order (``--reverse``).

On CPU the table also counts each step's minor page faults (``getrusage``'s ``ru_minflt``: fresh
pages of buffers the allocator mapped for the step), the cost of glibc returning large freed
buffers to the system. ``dpfx`` runs dpfx beside torch.compile alone, for comparisons across
processes, such as the allocator's settings (README, "A setting for your CPU training process"):

    python benchmarks/step_ab.py dpfx resnet_gn 256 --rounds 12
    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184 \
        python benchmarks/step_ab.py dpfx resnet_gn 256 --rounds 12
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import time
from typing import Callable, ContextManager

import torch

import methods
import models

Variant = tuple[str, Callable[[], ContextManager]]   # (method name, switch)


def nothing() -> ContextManager:
    return contextlib.nullcontext()


def table(model: str, batch: int, variants: dict[str, Variant], rounds: int,
          baseline: str = "compile", device: str = "cpu") -> str:
    """Median and min step (ms) of every variant and of the baseline method, the peak tensor
    bytes of one step after warm-up (``run.step_peak_bytes``), and on CPU the median minor page
    faults of a step, as markdown. On a GPU each step is timed to the device's
    synchronization."""
    everything = {**variants, f"non-private {baseline}": (baseline, nothing)}
    import run

    load_before = os.getloadavg()
    made = {}
    run.DEVICE = torch.device(device)
    steps, peaks, x, y = {}, {}, None, None
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for name, (method, switch) in everything.items():
        net, x, y = models.build(model, batch)
        if device != "cpu":
            net, x, y = run.on_device(net, x, y)
        with switch():
            made[name] = methods.make(method, net, batch, x, y)
            steps[name] = made[name].step
            for _ in range(3):
                steps[name](x, y)
            peaks[name] = run.step_peak_bytes(steps[name], x, y)
    times = {name: [] for name in steps}
    faults = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            with everything[name][1]():
                sync()
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                step(x, y)
                sync()
                times[name].append(time.perf_counter() - start)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    load_after = os.getloadavg()
    base = statistics.median(times[f"non-private {baseline}"])
    on_cpu = device == "cpu"
    base_peak = peaks[f"non-private {baseline}"]
    rows = [f"| {name} | {statistics.median(t) * 1e3:.2f} | {min(t) * 1e3:.2f} | "
            f"{statistics.median(t) / base:.2f} | {peaks[name] / 1e6:.1f} | "
            f"{peaks[name] / base_peak:.2f} |"
            + (f" {statistics.median(faults[name]):.0f} |" if on_cpu else "")
            for name, t in times.items()]
    head = f"| variant | median step (ms) | min (ms) | x {baseline} | step memory (MB) | " \
        f"x {baseline} |" + (" minor page faults a step |" if on_cpu else "")
    load = " / ".join(f"{a:.2f}" for a in load_before) + " before, " + \
        " / ".join(f"{a:.2f}" for a in load_after) + " after (1 / 5 / 15 min)"
    return "\n".join([f"Whole steps of the benchmark {model} at B={batch}, {rounds} interleaved "
                      f"rounds; load average {load}:", "", head, "|---|---:|---:|---:|---:|---:|"
                      + ("---:|" if on_cpu else ""), *rows, "", *_state_lines(made), ""])


def _state_lines(made: dict) -> list[str]:
    """Each correlated-noise state's measured bytes per trainable parameter (its buffers)."""
    lines = []
    for name, m in made.items():
        state = getattr(getattr(m, "optimizer", None), "_correlated", None)
        if state is None or state.state_dict()["buffers"] is None:
            continue
        params = sum(p.numel() for g in m.optimizer.param_groups for p in g["params"])
        held = state.state_dict()["buffers"]
        lines.append(f"- {name}: correlation state {tuple(held.shape)} {held.dtype}, "
                     f"{held.numel() * held.element_size() / params:.2f} bytes per parameter "
                     f"({params} parameters)")
    return lines


@contextlib.contextmanager
def optimizer_flat() -> ContextManager:
    """DPOptimizer writes every gradient through the flat buffer (as for several ranks)."""
    import dpfx.loop.grads
    real = dpfx.loop.grads.GradWriter._write_in_place
    dpfx.loop.grads.GradWriter._write_in_place = lambda *args: False
    try:
        yield
    finally:
        dpfx.loop.grads.GradWriter._write_in_place = real


@contextlib.contextmanager
def optimizer_flat_buffered() -> ContextManager:
    """The flat buffer plus a buffer of normals scaled into a second one, then added: the
    optimizer's noise before 2026-11-27."""
    import dpfx.loop.step_noise
    from dpfx.loop.noise import gaussian
    real = dpfx.loop.step_noise.StepNoise.add

    def buffered(self, flat, std):
        if std:
            flat += gaussian(flat.numel(), std, self.generator, device=flat.device)

    dpfx.loop.step_noise.StepNoise.add = buffered
    try:
        with optimizer_flat():
            yield
    finally:
        dpfx.loop.step_noise.StepNoise.add = real


@contextlib.contextmanager
def no_combo_kernels() -> ContextManager:
    """dpfx's GPU graphs lowered without Inductor's combo kernels (its setting before
    2026-11-27; Note [Combo kernels on the GPU])."""
    import dpfx.lower.inductor
    real = dict(dpfx.lower.inductor.GPU_PATCHES)
    dpfx.lower.inductor.GPU_PATCHES.clear()
    try:
        yield
    finally:
        dpfx.lower.inductor.GPU_PATCHES.update(real)


def combo_kernels() -> ContextManager:
    """Inductor's combo kernels for every graph compiled inside (torch.compile's too)."""
    import torch._inductor.config
    return torch._inductor.config.patch(combo_kernels=True)


@contextlib.contextmanager
def conv_chunks_by_bytes() -> ContextManager:
    """The per-sample conv2d product's chunks bounded by 1 MiB of patches alone (dpfx before
    2026-11-27; Note [Per-sample conv2d gradients in chunks of examples])."""
    from dpfx.ops import conv as conv_kernels
    real = conv_kernels._CHUNK_MIN_EXAMPLES
    conv_kernels._CHUNK_MIN_EXAMPLES = 1
    try:
        yield
    finally:
        conv_kernels._CHUNK_MIN_EXAMPLES = real


@contextlib.contextmanager
def vectors_unstacked() -> ContextManager:
    """Each vector parameter's per-sample gradient, norm and clipped sum on its own (dpfx before
    2026-11-27; Note [Vector parameters' per-sample gradients stacked])."""
    from dpfx.passes import clip_noise
    real = clip_noise.STACK_VECTORS
    clip_noise.STACK_VECTORS = False
    try:
        yield
    finally:
        clip_noise.STACK_VECTORS = real


def shared_sums_inlined() -> ContextManager:
    """Inductor's own choice for a pointwise value read by several kernels (dpfx before
    2026-11-28): computed inside each (Note [A shared sum stored so that its inputs die]).
    Inductor's FX-graph cache is off for it: its key does not see the switch, so the other
    variant's code would come back from the cache."""
    from dpfx.lower import codegen_patches as lower_codegen

    @contextlib.contextmanager
    def switch():
        real = lower_codegen.shared_sums_stored
        lower_codegen.shared_sums_stored = lambda: contextlib.nullcontext([])
        try:
            with torch._inductor.config.patch(fx_graph_cache=False):
                yield
        finally:
            lower_codegen.shared_sums_stored = real
    return switch()


@contextlib.contextmanager
def through_autograd() -> ContextManager:
    """The compiled graphs' ops entering the dispatcher's autograd key (dpfx before 2026-12-02;
    Note [Compiled graphs run below autograd] in dpfx/backend/runtime.py)."""
    from dpfx.backend import runtime
    real = runtime.below_autograd
    runtime.below_autograd = contextlib.nullcontext
    try:
        yield
    finally:
        runtime.below_autograd = real


EXPERIMENTS = {
    "dpfx": {"dpfx": ("dpfx", nothing)},
    "combo_kernels": {
    "dpfx, combo kernels (the GPU default)": ("dpfx", nothing),
    "dpfx, no combo kernels (before)": ("dpfx", no_combo_kernels),
    "non-private torch.compile, combo kernels": ("compile", combo_kernels)},
    "optimizer_noise": {
    "noise at the optimizer, each sum noised where it lies": ("dpfx_optimizer_noise", nothing),
    "noise at the optimizer, flat buffer, normals added in place": ("dpfx_optimizer_noise",
                                                                    optimizer_flat),
    "noise at the optimizer, flat buffer, a buffer of normals (before)": (
        "dpfx_optimizer_noise", optimizer_flat_buffered),
    "noise in the graph": ("dpfx", nothing)},
    "noise_mechanism": {
    "Gaussian noise (noise at the optimizer)": ("dpfx_optimizer_noise", nothing),
    "BandMF, 4 bands": ("dpfx_bandmf4", nothing),
    "BLT, 4 buffers": ("dpfx_blt4", nothing)},
    "conv_chunks": {
    "dpfx, conv products in chunks of 8 examples up to 4 MiB (the default)": ("dpfx", nothing),
    "dpfx, conv products in chunks of 1 MiB (before)": ("dpfx", conv_chunks_by_bytes)},
    "vector_stacks": {
    "dpfx, vector parameters stacked (the default)": ("dpfx", nothing),
    "dpfx, each on its own (before)": ("dpfx", vectors_unstacked)},
    "strategy": {
    "dpfx, strategy auto (the default)": ("dpfx", nothing),
    "dpfx, strategy materialize": ("dpfx_materialize", nothing)},
    "blocks": {
    "dpfx, one graph (the default)": ("dpfx", nothing),
    "dpfx, blocks='auto'": ("dpfx_blocks", nothing)},
    "below_autograd": {
    "dpfx, blocks='auto', below autograd (the default)": ("dpfx_blocks", nothing),
    "dpfx, blocks='auto', through the autograd key (before)": ("dpfx_blocks", through_autograd),
    "dpfx, one graph, below autograd (the default)": ("dpfx", nothing),
    "dpfx, one graph, through the autograd key (before)": ("dpfx", through_autograd)},
    "shared_sums": {
    "dpfx, shared sums stored (the default)": ("dpfx", nothing),
    "dpfx, Inductor's choice (before)": ("dpfx", shared_sums_inlined)}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", choices=sorted(EXPERIMENTS))
    ap.add_argument("model", choices=sorted(models.MODELS))
    ap.add_argument("batch", type=int)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reverse", action="store_true",
                    help="the variants in the other order (a round's position is not neutral)")
    args = ap.parse_args()
    variants = EXPERIMENTS[args.experiment]
    if args.reverse:
        variants = dict(reversed(list(variants.items())))
    print(table(args.model, args.batch, variants, args.rounds, device=args.device))
