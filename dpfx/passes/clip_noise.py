"""Insert the DP-SGD step as graph nodes: per-sample norms, clip factor, clipped sum, noise, divide.

For per-sample gradients ``ps[p]`` of shape (B, *p.shape) the pass emits, with C = max_grad_norm,
sigma = noise_multiplier, and ``scale`` = B for loss_reduction="mean" (the backward graph holds
g_i / B; multiplying by B undoes the mean) or 1 for "sum"::

    per_sample_norms = scale * sqrt(sum_p sum(ps[p]**2, dims 1..))       # f32[B]
    keep             = isfinite(per_sample_norms)                          # bool[B]
    clip_factor      = where(keep, min(1, C / (per_sample_norms + 1e-6)), 0)
                       where(keep, C / (per_sample_norms + gamma), 0)     # clipping="automatic"
                       (clipping="adaptive": C is the graph's last input, clip_bound, and the
                       noise std sigma_grad * clip_bound; the last output is the count
                       sum_i (float(keep_i & (norm_i <= C)) - 1/2) + sigma_b * N(0, 1):
                       Note [Adaptive clipping] in privacy/adaptive.py)
    clipped[p]       = sum_i where(keep_i, (clip_factor * scale)_i * ps[p]_i, 0)   # p.shape
    noise            = N(0, 1)[sum of numels] ; noise[p] = slice(noise) * (sigma * C)
    grad[p]          = (clipped[p] + noise[p]) / D

The last two lines are the GPU graphs' release (Inductor fuses the draw into the add). CPU
graphs release every clipped sum through one ``dpfx::add_noise_`` call, which adds the noise and
divides in place, drawing the normals in registers (Note [Noise added in place] in ops/noise.py);
there the materialized per-sample gradients of a group's 1-D parameters that dpfx sums itself
(biases, norm weights) are stacked into one [B, N], one norm and one clipped sum for all, each
parameter's gradient a slice of one noised base (Note [Vector parameters' per-sample gradients
stacked]).

For a parameter on the ghost strategy, ``sum(ps[p]**2, dims 1..)`` is the rule's ghost norm and
``clipped[p]`` its book-keeping product (see ``rules.Ghost``): the same values, never building ps;
there every operand of the product is selected by ``keep``, not only the clip-scaled one. An
example with a non-finite norm thus adds exactly zero, not 0 * NaN (Note [Non-finite examples
contribute zero] in rules/registry.py).

D is, for "mean", ``expected_batch_size`` when given, else B; for "sum", 1. Norms, clip factors
and clipped sums are float32 for float32, bf16 and fp16 parameters, float64 where a clipping
group has a float64 parameter (tests/rules/test_rule_convolution.py::test_float64_cnn_matches_reference).

Per-layer clipping (``max_grad_norm`` a dict) computes one norm, clip factor and coefficient per
group, and the noise std is sigma * sqrt(sum_g C_g^2). With ``noise="optimizer"`` the pass stops at
``clipped[p]`` (tagged "clipped_grad"): ``dpfx.DPOptimizer`` adds the noise and divides once per
logical step (virtual batches, secure noise, distributed). With ``track_norms`` the norms pass
through ``dpfx::observe_norms`` (ops/norms.py) before the clip factor: it records them and reports
non-finite examples once. All of it is ordinary ATen but the CPU noise, so Inductor fuses the
norms into the kernels that produce the per-sample gradients and, on GPU, the noise into the
final pointwise kernel. One draw (GPU: ``aten.randn``, sliced) or one call (CPU:
``dpfx::add_noise_``, one Philox key) serves all parameters, so there is one seed per step. Every node that the verifier relies
on carries ``meta["dpfx"]``: "per_sample_norms", "finite_examples", "clip_factor", "clip_coef",
"clip_apply", "finite_mask", "clipped_sum", "noise" (the draw, or the add_noise_ call),
"noise_scale" (GPU form), "private_grad" | "clipped_grad"; with ``batch_buckets``, "real_rows"
and the input "real_examples" (Note [Padded rows contribute zero]).
"""
from __future__ import annotations

import dataclasses
import itertools
import operator

import sympy
import torch

import dpfx.ops  # noqa: F401  (registers the dpfx:: ops the graphs hold)
from dpfx.config import DPConfig
from dpfx.rules import Clip, at_least_float32, at_nominal
from dpfx.graph.batch import BatchDim
from dpfx.graph.emit import Emitter
from dpfx.passes.per_sample import ParamGrad

aten = torch.ops.aten
prims = torch.ops.prims


# The name of the backward's input that holds adaptive clipping's bound C_t (Note [Adaptive
# clipping] in privacy/adaptive.py); the backend appends its value to the backward's arguments.
CLIP_BOUND = "clip_bound"
# The name of the backward's input that holds the count of real examples in a batch padded to a
# bucket (Note [Padded rows contribute zero]); the backend appends its value before C_t's.
REAL_EXAMPLES = "real_examples"


# Note [Padded rows contribute zero]
# With ``batch_buckets`` (config.py) dpfx pads every batch of B examples up to the smallest bucket
# P >= B, so that the compiled graphs (and, on a GPU, the CUDA graphs replaying them) see a few
# shapes rather than one per Poisson batch size. Rows B..P-1 are copies of row 0 (compiled_call.py:
# a copy keeps the forward's values in the range real rows have: valid token ids, an attention mask
# with a row to attend to), but nothing rests on those values. The backward reads B as its input
# ``real_examples`` (a 0-d float32 the backend appends) and builds
#     real_rows = arange(P) < real_examples                                  # bool[P]
#     keep      = isfinite(norm) & real_rows                                 # "finite_examples"
# so a padded row is handled as an example with a non-finite norm is (Note [Non-finite
# examples contribute zero] in rules/registry.py): clip factor 0, and every term of it selected
# away with where(keep, ., 0): a NaN or inf its forward produced adds exactly zero. The forward's
# outputs are sliced back to B rows before the user sees them, so a mean loss is the mean over
# the B real examples and the graph holds g_i / B: the mean's scale (in the norm and in the clip
# coefficient) and the divisor D (without expected_batch_size) are ``real_examples``, not P.
# Adaptive clipping's count sums over the real rows only (where(real_rows, b_i - 1/2, 0)), and
# ``dpfx::observe_norms`` records only the first B norms (ops/norms.py), so no padded row is
# ever counted as clipped, unclipped or non-finite. The verifier requires this form of keep
# whenever buckets are configured, with ``real_rows`` read from the one real_examples input
# (Note [Padded rows are proven out] in verify/clip.py). A mean loss without expected_batch_size
# is released with the sliced draw on CPU too (add_noise_ takes its divisor as a size, and D is
# the tensor real_examples); with a sum, or a given expected_batch_size, add_noise_ stays.
# (tests/test_buckets.py)


def insert_clip_and_noise(emit: Emitter, grads: list[ParamGrad], config: DPConfig,
                          device: torch.device, norm_sink: int | None = None,
                          bound: torch.fx.Node | None = None,
                          real: torch.fx.Node | None = None) -> dict[str, torch.fx.Node]:
    """Returns parameter name -> its released gradient; under adaptive clipping (``bound`` the
    placeholder of C_t) also CLIP_BOUND -> the step's count of unclipped examples (noised, or
    raw for noise="optimizer"), which the backend takes off the graph's outputs. ``real``: the
    placeholder of the count of real examples in a padded batch (Note [Padded rows contribute
    zero])."""
    # a mean loss's B: the real examples of a padded batch, else the batch size symbol
    batch = emit.batch_size() if real is None else real
    real_rows = None
    if real is not None:    # Note [Padded rows contribute zero]
        rows = emit(aten.arange.start_step, 0, emit.batch_size(), 1, dtype=torch.int64,
                    device=real.meta["val"].device, pin_memory=False)
        real_rows = emit(aten.lt.Tensor, rows, real, tag="real_rows")
    mean = config.loss_reduction == "mean"

    # One clipping group for flat clipping; one per per-layer key otherwise.
    groups: dict[str, list[ParamGrad]] = {key: [] for key in config.clip_bounds}
    for pg in grads:
        groups[config.group_of(pg.name)].append(pg)
    groups = {key: members for key, members in groups.items() if members}

    # See Note [Vector parameters' per-sample gradients stacked]
    # (adaptive clipping: the noise std is a node, sigma_grad * C_t; the sliced draw takes it)
    # (a padded batch's mean without expected_batch_size divides by a tensor, real_examples:
    # add_noise_ takes its divisor as a size)
    in_place = config.noise != "optimizer" and device.type in NOISE_IN_PLACE \
        and bound is None and not (real is not None and mean
                                   and config.expected_batch_size is None)
    stacks = _stack_vectors(grads, config, emit) if in_place and STACK_VECTORS else []
    stacked = {pg.name for s in stacks for pg in s.members}

    norms = {}
    for key, members in groups.items():
        squares, shared = [], set()
        for pg in members:
            if pg.name in stacked:
                continue
            if pg.strategy == "ghost" and pg.ghost.norm_shared:
                # Note [One norm row per clipping group] (passes/block.py): once per row
                if pg.ghost.norm_sq in shared:
                    continue
                shared.add(pg.ghost.norm_sq)
            squares.append(squared_norm(pg, emit))
        squares += [emit.squared_norm(s.per_sample, BatchDim(0)) for s in stacks
                    if s.group == key]
        norm_sq = squares[0]
        for sq in squares[1:]:
            norm_sq = emit(aten.add.Tensor, norm_sq, sq)
        norm = emit(aten.sqrt.default, norm_sq)
        norms[key] = emit(aten.mul.Tensor, norm, batch) if mean else norm
    if norm_sink is not None:
        # Stacked so that one opaque call sees every group of one backward pass (ops/norms.py): it
        # records them for norm_stats and reports non-finite examples once.
        rows = [emit(aten.unsqueeze.default, n, 0) for n in norms.values()]
        seen = emit(torch.ops.dpfx.observe_norms.default, emit(aten.cat.default, rows),
                    norm_sink)
        norms = {key: emit(aten.select.int, seen, 0, i) for i, key in enumerate(norms)}

    clips = {}
    for key, norm in norms.items():
        norm.meta["dpfx"] = "per_sample_norms"
        denom = emit(aten.add.Tensor, norm, config.clip_eps)
        ratio = emit(aten.mul.Tensor, emit(aten.reciprocal.default, denom),
                     config.clip_bounds[key] if bound is None else bound)
        # Note [Non-finite examples contribute zero] (rules/registry.py): factor 0, and every
        # term of the example selected away from the clipped sums.
        # isfinite(norm), written as Inductor's decomposition writes it (abs(x) < inf; the C++
        # backend compiles with -fno-finite-math-only, so the comparison survives).
        finite = emit(aten.lt.Scalar, emit(aten.abs.default, norm), float("inf"),
                      tag=None if real_rows is not None else "finite_examples")
        keep = finite if real_rows is None else emit(aten.logical_and.default, finite,
                                                     real_rows, tag="finite_examples")
        zero = emit(aten.scalar_tensor.default, 0, dtype=norm.meta["val"].dtype,
                    device=norm.meta["val"].device)
        # Note [Clip functions] (config.py): automatic clipping scales every example by
        # C / (norm + gamma), the others by min(1, C / (norm + eps)).
        scale = (ratio if config.clipping == "automatic"
                 else emit(aten.clamp_max.default, ratio, 1.0))
        clip_factor = emit(aten.where.self, keep, scale, zero, tag="clip_factor")
        # The coefficient that multiplies the per-sample gradients the graph holds: for "mean"
        # they are g_i / B, so the coefficient is clip_factor * B.
        coef = (emit(aten.mul.Tensor, clip_factor, batch, tag="clip_coef") if mean
                else clip_factor)
        clips[key] = Clip(coef, keep)

    # The clipped sums first, the noise after them: emitted in this order, the draw's buffer is
    # not yet live while per-sample gradients are (a tied weight's (B, V, d)). A clipped sum
    # that accumulates into its noise is emitted with the noise.
    into = {pg.name for pg in grads if config.noise != "optimizer" and not in_place
            and pg.strategy == "ghost" and pg.ghost.clipped_into is not None}
    # Smallest parameter first: each clipped sum allocates its parameter-sized output and
    # frees the per-example operands it read last, so the largest outputs (an embedding's
    # table) are allocated once the others' operands are gone. The noise keeps the parameters'
    # order (stream k is parameter k's).
    stack_sums = [emit(aten.sum.dim_IntList,
                       clips[s.group].scale(emit, s.per_sample, BatchDim(0)), [0],
                       tag="clipped_sum") for s in stacks]
    order = sorted((pg for pg in grads if pg.name not in into and pg.name not in stacked),
                   key=lambda pg: at_nominal(sympy.Mul(*emit.analysis.shape(pg.grad.meta["val"]))))
    emitted = {pg.name: clipped_sum(pg, clips[config.group_of(pg.name)], emit,
                                     moved=not in_place) for pg in order}
    clipped = {pg.name: emitted[pg.name] for pg in grads if pg.name in emitted}
    count = _unclipped_count(norms[""], clips[""].keep, bound, emit, real_rows) \
        if bound is not None else None
    if config.noise == "optimizer":
        out = {pg.name: _as_output(pg, clipped[pg.name], "clipped_grad", emit) for pg in grads}
        if count is not None:
            count.meta["dpfx_output"] = "unclipped_count"
            out[CLIP_BOUND] = count
        return out
    std = config.noise_std if bound is None else \
        emit(aten.mul.Tensor, bound, config.grad_noise_multiplier, tag="noise_std")
    if not mean:
        multiplier, divisor = 1.0, 1
    elif config.expected_batch_size is not None:
        multiplier, divisor = 1.0 / config.expected_batch_size, 1
    else:
        multiplier, divisor = 1.0, batch
    if in_place:
        return _noised_in_place(grads, clipped, list(zip(stacks, stack_sums)), std, multiplier,
                                divisor, emit)

    # Sizes go through emit.size: a parameter's dims can be symbols too (automatic dynamic).
    shapes = {pg.name: emit.analysis.shape(pg.grad.meta["val"]) for pg in grads}
    numels = {name: sympy.Mul(*shape) for name, shape in shapes.items()}
    total = emit.size(sympy.Add(*numels.values(), 1 if count is not None else 0))
    if device.type == "cpu":    # Philox + Box-Muller on every core (ops/noise.py)
        noise = emit(torch.ops.dpfx.standard_normal.default, total, device, tag="noise")
    else:                       # Inductor lowers randn to its fused Philox
        noise = emit(aten.randn.default, [total], dtype=torch.float32, device=device,
                     pin_memory=False, tag="noise")

    private = {}
    offset = sympy.Integer(0)
    for pg in grads:
        chunk = emit(aten.slice.Tensor, noise, 0, emit.size(offset),
                     emit.size(offset + numels[pg.name]))
        offset += numels[pg.name]
        if pg.name in into:     # Note [The clipped sum accumulates into the noise]
            frontier = pg.chain[0].args[0] if pg.chain else pg.grad
            view = emit(aten.view.default, chunk,
                        [emit.size(s) for s in emit.analysis.shape(frontier.meta["val"])])
            scaled = emit(aten.mul.Tensor, view, std, tag="noise_scale")
            clip = clips[config.group_of(pg.name)]
            noisy = _moved(pg, pg.ghost.clipped_into(clip, scaled), emit)
        else:
            view = emit(aten.view.default, chunk, [emit.size(s) for s in shapes[pg.name]])
            scaled = emit(aten.mul.Tensor, view, std, tag="noise_scale")
            noisy = emit(aten.add.Tensor, clipped[pg.name], scaled)
        if not mean:
            out = noisy
        elif config.expected_batch_size is not None:
            out = emit(aten.mul.Tensor, noisy, multiplier)
        else:
            out = emit(aten.div.Tensor, noisy, divisor)
        private[pg.name] = _as_output(pg, out, "private_grad", emit)
    if count is not None:   # the draw's last entry
        chunk = emit(aten.slice.Tensor, noise, 0, emit.size(offset), emit.size(offset + 1))
        scaled = emit(aten.mul.Tensor, emit(aten.view.default, chunk, []),
                      config.count_noise_multiplier, tag="count_noise_scale")
        private[CLIP_BOUND] = emit(aten.add.Tensor, count, scaled, tag="noisy_count")
    return private


def _unclipped_count(norm: torch.fx.Node, keep: torch.fx.Node, bound: torch.fx.Node,
                     emit: Emitter, real_rows: torch.fx.Node | None = None) -> torch.fx.Node:
    """sum_i (1[||g_i|| <= C_t] - 1/2) over the examples (a non-finite norm counts as clipped):
    each term is +-1/2, so the count's sensitivity is 1/2 (Note [Adaptive clipping] in
    privacy/adaptive.py); a padded row's term is 0 (Note [Padded rows contribute zero])."""
    unclipped = emit(aten.logical_and.default, keep, emit(aten.le.Tensor, norm, bound))
    ones = emit(prims.convert_element_type.default, unclipped, torch.float32)
    centered = emit(aten.sub.Tensor, ones, 0.5)
    if real_rows is not None:
        zero = emit(aten.scalar_tensor.default, 0, dtype=torch.float32,
                    device=norm.meta["val"].device)
        centered = emit(aten.where.self, real_rows, centered, zero)
    return emit(aten.sum.dim_IntList, centered, [0], tag="unclipped_count")


# The device types whose graphs add the noise with dpfx::add_noise_ (Note [Noise added in
# place], ops/noise.py). On GPU, Inductor fuses aten.randn's Philox into the pointwise kernel
# that adds it, which is the same single pass. Tests empty it to check that form on CPU.
NOISE_IN_PLACE = {"cpu"}


def _noised_in_place(grads: list[ParamGrad], clipped: dict[str, torch.fx.Node], stacks: list,
                     std: float, multiplier: float, divisor,
                     emit: Emitter) -> dict[str, torch.fx.Node]:
    """One dpfx::add_noise_ over every clipped sum, as aot_autograd writes a mutating op
    (auto_functionalized_v2: the bases in, their new values out as getitems 1..n); then each
    parameter's moves from its frontier's shape to its own, and its cast. A stack's clipped sum
    is one base, placed where its first member stands; each member's gradient is its slice."""
    bases, slot = [], {}    # parameter -> (base index, its slice of the base or None)
    stack_of = {pg.name: (i, s, total) for s, total in stacks for i, pg in enumerate(s.members)}
    placed = {}
    for pg in grads:
        if pg.name in stack_of:
            i, s, total = stack_of[pg.name]
            if id(s) not in placed:
                placed[id(s)] = len(bases)
                bases.append(total)     # float32 or float64: the coefficient promotes it
            slot[pg.name] = (placed[id(s)], (s.offsets[i], s.offsets[i + 1]))
            continue
        base = clipped[pg.name]
        if base.meta["val"].dtype not in (torch.float32, torch.float64):
            base = emit(prims.convert_element_type.default, base, torch.float32)
        if base in bases:   # two parameters with one clipped sum (x + b1 + b2; shared nodes):
            base = emit(aten.clone.default, base, fresh=True)   # each is noised on its own
        slot[pg.name] = (len(bases), None)
        bases.append(base)
    slots = {f"_sums_{k}_base_index": k for k in range(len(bases))}
    call = emit(torch.ops.higher_order.auto_functionalized_v2, torch.ops.dpfx.add_noise_.default,
                std=std, multiplier=multiplier, divisor=divisor, _sums_length=len(bases),
                **slots, _all_bases=bases, tag="noise")
    private = {}
    for pg in grads:
        k, span = slot[pg.name]
        noisy = emit(operator.getitem, call, k + 1)
        if span is not None:
            noisy = emit(aten.slice.Tensor, noisy, 0, *span)
        if pg.strategy == "ghost":
            noisy = _moved(pg, noisy, emit)
        private[pg.name] = _as_output(pg, noisy, "private_grad", emit)
    return private


# Note [Vector parameters' per-sample gradients stacked]
# A transformer's biases and norm weights are most of its parameters by count (GPT-2 small: 98 of
# 148) and few of its entries. Each cost three reductions of its own: its per-sample gradient
# (over the tokens), its squared norm (over its entries) and its clipped sum (over the examples),
# and Inductor fuses no two reductions over different axes, so each was its own loop nest, its
# own C++ code generation and its own reader of the clip factor. On CPU graphs (one
# dpfx::add_noise_ releases every sum) the per-sample gradients [B, n_k] of a clipping group's
# materialized 1-D parameters of one dtype, two or more, are concatenated along dim 1 into one
# [B, N]: one squared norm and one clipped sum for all of them, released as one noised base whose
# slices [offset_k, offset_k + n_k) are the parameters' gradients (Inductor writes each per-sample
# gradient into its place in the concatenation). The values are the same: the norm is the same
# sum of squares, each entry's clipped sum is the same sum over examples, and each entry of the
# base gets its own normal draw (the streams of the call's tensors are numbered anew, so a seed
# draws other values than before). The verifier reads the stacked sum as one clipped tensor
# covered by the norm, and each output as a slice of the released base, no two overlapping
# (verify/release.py).
STACK_VECTORS = True    # benchmarks/step_ab.py switches it off to measure what it is worth


@dataclasses.dataclass
class _Stack:
    group: str                  # the clipping group
    members: list               # ParamGrad, in the parameters' order
    offsets: list[int]          # member k's entries of the stacked row: offsets[k]:offsets[k + 1]
    per_sample: torch.fx.Node   # [B, N]: the members' per-sample gradients side by side


def _stack_vectors(grads: list[ParamGrad], config: DPConfig, emit: Emitter) -> list[_Stack]:
    batch = emit.analysis.batch
    by_key: dict[tuple, list[ParamGrad]] = {}
    for pg in grads:
        if pg.strategy == "ghost" or pg.per_sample is None or pg.grad.meta["val"].dim() != 1 \
                or not _own_reduction(pg.per_sample):
            continue
        val = pg.per_sample.meta["val"]
        shape = emit.analysis.shape(val)
        if len(shape) != 2 or shape[0] != batch or not shape[1].is_Integer:
            continue
        by_key.setdefault((config.group_of(pg.name), val.dtype), []).append(pg)
    stacks = []
    for (group, _), members in by_key.items():
        if len(members) < 2:
            continue
        sizes = [int(emit.analysis.shape(pg.per_sample.meta["val"])[1]) for pg in members]
        cat = emit(aten.cat.default, [pg.per_sample for pg in members], 1)
        stacks.append(_Stack(group, members, list(itertools.accumulate(sizes, initial=0)), cat))
        for pg in members:
            pg.stacked = True   # dpfx.explain shows it
    return stacks


def _own_reduction(node: torch.fx.Node) -> bool:
    """Whether ``node`` is (a view of) a sum dpfx emitted: a per-sample gradient that exists for
    the clipping alone. One the graph already holds (an MLP bias's: the output gradient itself)
    keeps its own squared norm, which a ghost norm of the same tensor shares (Note [Emitted
    nodes are shared] in emit.py); stacked, it would be copied and its norm taken again."""
    while node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default) \
            and node.meta.get("dpfx_emitted") and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node.target is aten.sum.dim_IntList and bool(node.meta.get("dpfx_emitted"))


def _as_output(pg: ParamGrad, out: torch.fx.Node, tag: str, emit: Emitter) -> torch.fx.Node:
    dtype = pg.grad.meta["val"].dtype
    if out.meta["val"].dtype != dtype:
        out = emit(prims.convert_element_type.default, out, dtype)
    if tag == "private_grad" and out.meta.get("dpfx") is None:
        out.meta["dpfx"] = tag
    else:   # the clipped sum itself may be the output (noise="optimizer", or a "sum" loss's
        out.meta["dpfx_output"] = tag   # sum accumulated into the noise): it keeps its tag
    return out


def squared_norm(pg: ParamGrad, emit: Emitter) -> torch.fx.Node:
    """[B]: the squared norm of each example's gradient of this parameter, in float32 or wider."""
    if pg.strategy == "ghost":
        # norms of bf16/fp16 gradients in float32; a float64 parameter's stay float64, so its
        # clip factor is exact to float64 (the coefficient then promotes the clipped sums too)
        return at_least_float32(emit, pg.ghost.norm_sq)[0]
    return emit.squared_norm(pg.per_sample, BatchDim(0))


def clipped_sum(pg: ParamGrad, clip: Clip, emit: Emitter, moved: bool = True) -> torch.fx.Node:
    """sum_i coef_i * grad_i over the examples with a finite norm, in the parameter's shape (a
    ghost parameter's in its frontier's shape where ``moved`` is false)."""
    if pg.strategy == "ghost":
        # Book-keeping: one weight-gradient product with clip-scaled rows, then the same data
        # movement the original graph applied between the frontier and the output.
        out = pg.ghost.clipped_sum(clip)
        return _moved(pg, out, emit) if moved else out
    weighted = clip.scale(emit, pg.per_sample, BatchDim(0))
    return emit(aten.sum.dim_IntList, weighted, [0], tag="clipped_sum")


def _moved(pg: ParamGrad, out: torch.fx.Node, emit: Emitter) -> torch.fx.Node:
    """``out`` (in the frontier's shape) moved as the captured graph moved the frontier's output
    to the gradient, casts left out (wide until the output)."""
    for node in pg.chain:
        if node.target is not prims.convert_element_type.default:
            out = emit(node.target, out, *node.args[1:], **node.kwargs)
    return out


# Note [The clipped sum accumulates into the noise]
# Where the book-keeping product is itself an accumulation into a base (an embedding's gradient:
# index_put of the token rows into a zero table), the scaled noise is that base, so one (V, d)
# buffer becomes the gradient: before, the zero table, the clipped sum, the noise and the output
# were separate and three (V, d) buffers were live in the last kernel (the embedding benchmark's
# 3x step memory). The noise entries are i.i.d., so the draw's slice is viewed in the product's
# own shape and the captured moves then take the sum to the parameter's. The verifier reads the
# noise as the product's base (verify/release.py).
