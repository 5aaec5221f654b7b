"""Adaptive clipping's proof: C_t is the graph's one clip_bound input, and the count is released.

    bound = adaptive_bound(graph)                       # the C_t input every factor reads
    slice_ = check_count(graph, bound, config, an, real)     # the count's noise, or None

Under clipping="adaptive" the flat proof runs with this input in place of the constant C
(clip.py's factor, noise.py's std), and the graph's last output must be the noised count of
unclipped examples (Note [The adaptive bound is proven as an input]).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpfx.config import DPConfig
from dpfx.errors import PrivacyError
from dpfx.graph.batch import BatchAnalysis
from dpfx.passes.verify.clip import norm_of_keep, real_rows
from dpfx.passes.verify.noise import noise_slice
from dpfx.passes.verify.patterns import is_zero, tagged

aten = torch.ops.aten
prims = torch.ops.prims


# Note [The adaptive bound is proven as an input]
# Under clipping="adaptive" (Note [Adaptive clipping] in privacy/adaptive.py) C_t is no constant
# of the graph: it is the graph's last input, tagged "clip_bound", which the backend fills with
# the step's bound. The proof is the flat one with that input in place of the constant: every
# clip factor is where(isfinite(norm), min(1, C_t / (norm + eps)), 0) of that very input, so an
# example's contribution has norm at most C_t whatever the norms and whatever C_t is; every
# noise_scale multiplies its standard normals by mul(C_t, sigma_grad), the same input times the
# configured sigma_grad; and the graph's last output releases the count of unclipped examples
# as sum_i (float(b_i) - 1/2) for a per-example bool b_i (each term +-1/2: sensitivity 1/2), plus
# sigma_b times one more entry of the step's draw, shared with no parameter (noise="optimizer":
# the raw count, noised by DPOptimizer). A factor or a noise that reads any other tensor, a
# second bound input, or a bound that is not the last input (the backend appends C_t last) is
# refused. (tests/passes/test_adaptive_clipping.py)
def adaptive_bound(graph: fx.Graph) -> fx.Node:
    placeholders = list(graph.find_nodes(op="placeholder"))
    bounds = [p for p in placeholders if p.meta.get("dpfx") == "clip_bound"]
    val = bounds[0].meta.get("val") if len(bounds) == 1 else None
    if len(bounds) != 1 or bounds[0] is not placeholders[-1] or \
            not isinstance(val, torch.Tensor) or val.dim() != 0 or val.dtype != torch.float32:
        raise PrivacyError("clipping='adaptive': the backward graph must read C_t from one 0-d "
                           "float32 input, its last, tagged clip_bound")
    return bounds[0]


def check_count(graph: fx.Graph, bound: fx.Node, config: DPConfig, an: BatchAnalysis,
                real: fx.Node | None = None):
    """The graph's last output is the count of unclipped examples as Note [The adaptive bound
    is proven as an input] says; returns its noise slice (None for noise="optimizer")."""
    def refuse(why: str):
        raise PrivacyError(f"clipping='adaptive': the count of unclipped examples {why}")

    outs = graph.find_nodes(op="output")[0].args[0]
    out = outs[-1] if isinstance(outs, (tuple, list)) and outs else None
    counts = tagged(graph, "unclipped_count")
    if not isinstance(out, fx.Node) or len(counts) != 1:
        refuse("is not the graph's last output, one tagged sum")
    count = counts[0]
    x = count.args[0] if count.target is aten.sum.dim_IntList and list(count.args[1:]) == [[0]] \
        and not count.kwargs else None
    if real is not None:    # a padded row's term is where(real_rows, ., 0): 0
        x = x.args[1] if isinstance(x, fx.Node) and x.target is aten.where.self and \
            real_rows(x.args[0], an, real) and is_zero(x.args[2]) else None
    ok = isinstance(x, fx.Node) and x.target is aten.sub.Tensor and x.args[1] == 0.5 \
        and not x.kwargs
    ones = x.args[0] if ok else None
    ok = ok and isinstance(ones, fx.Node) and \
        ones.target is prims.convert_element_type.default and ones.args[1] == torch.float32
    flags = ones.args[0] if ok else None
    val = flags.meta.get("val") if isinstance(flags, fx.Node) else None
    if not (ok and isinstance(val, torch.Tensor) and val.dtype == torch.bool and val.dim() == 1
            and an.size(val.shape[0]) == an.batch):
        refuse(f"{count.name} is not sum_i (float(b_i) - 1/2) of one bool b_i per example")
    if flags.target is not aten.logical_and.default or \
            flags.args[0].meta.get("dpfx") != "finite_examples" or \
            flags.args[1].target is not aten.le.Tensor or flags.args[1].args[1] is not bound \
            or flags.args[1].args[0] is not norm_of_keep(flags.args[0], an, real):
        refuse(f"{flags.name} is not isfinite(norm) & (norm <= C_t) of the clip_bound input")
    if config.noise == "optimizer":
        if out is not count:
            refuse("is not the graph's last output, for dpfx.DPOptimizer to noise")
        return None
    scaled = out.args[1] if out.target is aten.add.Tensor and len(out.args) == 2 \
        and out.args[0] is count and not out.kwargs else None
    if not (isinstance(scaled, fx.Node) and scaled.meta.get("dpfx") == "count_noise_scale"
            and scaled.target is aten.mul.Tensor and len(scaled.args) == 2
            and scaled.args[1] == config.count_noise_multiplier):
        refuse(f"released as {out.name} is not count + N(0, sigma_b^2), sigma_b = "
               f"{config.count_noise_multiplier}")
    return noise_slice("<the count of unclipped examples>", scaled.args[0])
