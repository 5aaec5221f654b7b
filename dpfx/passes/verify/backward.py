"""Invariant 2, the backward proof: every trainable parameter's gradient is clipped and noised.

    verify_backward(gm, an, {"fc.weight": out, ...}, config)   # PrivacyError naming the parameter

With the backward graph as a networkx DiGraph, removing the ``clipped_sum`` nodes must disconnect
every data source (the tangents and every saved activation that carries the batch) from every
gradient output; each output must descend from a ``noise_scale`` node whose factor is sigma * C
and whose input is a slice of a standard normal draw that no other parameter's slice overlaps,
or (CPU) from the graph's one ``dpfx::add_noise_`` call, with std sigma * C, one noised sum per
parameter or disjoint constant slices of one (stacked vector parameters) (with
``noise="optimizer"``: be the tagged clipped sum, with no noise in the graph); every clipped
tensor must be one of the tensors its clip factor's per-sample norm is taken over; each clip
factor must be ``where(isfinite(norm), min(1, C / (norm + eps)), 0)`` (automatic clipping:
``where(isfinite(norm), C / (norm + gamma), 0)``), eps or gamma exactly the configured one, with
the C of the parameter's clipping group, and the coefficient that scales the per-sample
gradients that factor itself ("sum") or the factor times B (a "mean" loss's 1/B undone); every
floating-point operand of a clipped sum that depends on the data must be
``where(isfinite(norm), ., 0)`` of its factor's norm (an example with a non-finite gradient adds
exactly zero, not 0 * NaN); each output is exactly (moves of its clipped sums + its noise_scale
node) / D, or the add_noise_ call's noised clipped side with (multiplier, divisor) exactly 1/D,
nothing reweighting one against the other (Note [The release is checked as a whole]); and,
re-running the batch analysis on the rewritten graph, no op other than the clipped sums (and
adaptive clipping's count) may combine examples. Under clipping="adaptive" C and the noise std
read the graph's one bound input, and the count of unclipped examples has sensitivity 1/2 and
its own noise (Note [The adaptive bound is proven as an input]). With ``batch_buckets`` every
isfinite(norm) above is isfinite(norm) & (arange(B) < real_examples), and D and a mean's B are
the one real_examples input (Note [Padded rows are proven out]). A violation is a
``PrivacyError`` naming the parameter.

``verify_backward`` runs the checks in that order, each a function of this package: the clip
factors and their clipped sums (clip.py, block.py), then per parameter the clip, the noise
(noise.py) and the release (release.py), then the noise slots, adaptive clipping's count
(adaptive.py) and the batch analysis rerun.
"""
from __future__ import annotations

import dataclasses

import networkx as nx
import torch.fx as fx

from dpfx.config import DPConfig
from dpfx.errors import PrivacyError
from dpfx.graph.batch import BatchAnalysis
from dpfx.passes.verify.adaptive import adaptive_bound, check_count
from dpfx.passes.verify.block import check_block_clip, is_block_clip
from dpfx.passes.verify.clip import (check_clip_factor, check_clipped_sum, real_examples,
                                     scaling_factor)
from dpfx.passes.verify.forward import mixing_ops
from dpfx.passes.verify.noise import check_disjoint, check_noise, check_noise_slots
from dpfx.passes.verify.patterns import (as_nx, clip_apply_of, data_sources, is_add_noise,
                                         leak_path, norm_sources, reached, release_ancestors,
                                         tagged)
from dpfx.passes.verify.release import check_release


def verify_backward(gm: fx.GraphModule, an: BatchAnalysis, grads: dict[str, fx.Node],
                    config: DPConfig) -> None:
    """Prove that each node in ``grads`` (parameter name -> gradient output) is private."""
    proof = Backward.of(gm, an, config)
    check_clip_factors(proof)
    calls = check_noise_source(proof)
    slices, slots = [], {}
    for name, out in grads.items():
        ancestors = check_clipped(proof, name, out)
        if config.noise == "optimizer":
            check_deferred(name, out)
            continue
        slices += check_noise(name, ancestors, proof.noise_scales, calls, proof.adaptive, config)
        slot = check_release(name, out, an, config, proof.real)
        if slot is not None:
            call, index, start, end = slot
            slots.setdefault((call, index), []).append((start, end, name))
    check_noise_slots(slots)
    if proof.adaptive is not None:
        slice_ = check_count(gm.graph, proof.adaptive, config, an, proof.real)
        if slice_ is not None:
            slices.append(("<the count of unclipped examples>", slice_))
    check_disjoint(slices)
    check_no_other_batch_mixing(gm, an)


@dataclasses.dataclass
class Backward:
    """What every check reads of one backward graph."""
    gm: fx.GraphModule
    an: BatchAnalysis
    config: DPConfig
    g: nx.DiGraph
    sources: list[fx.Node]          # the tangents and the saved tensors that carry the batch
    clipped: list[fx.Node]          # the clipped_sum nodes
    leaked: set[fx.Node]            # what the data reaches unclipped
    factors: list[fx.Node]          # the clip_factor nodes
    adaptive: fx.Node | None        # the clip_bound input (clipping="adaptive")
    real: fx.Node | None            # the real_examples input (batch_buckets)
    noise_scales: list[fx.Node]
    bound_of: dict = dataclasses.field(default_factory=dict)    # clip factor -> its C
    factor_of: dict = dataclasses.field(default_factory=dict)   # clipped sum -> its factor
    memo: dict = dataclasses.field(default_factory=dict)        # release_ancestors' walks

    @staticmethod
    def of(gm: fx.GraphModule, an: BatchAnalysis, config: DPConfig) -> "Backward":
        graph = gm.graph
        g = as_nx(graph)
        sources = data_sources(graph, an)
        clipped = tagged(graph, "clipped_sum")
        factors = tagged(graph, "clip_factor")
        if not factors:
            raise PrivacyError("the backward graph has no clip factor node")
        return Backward(gm, an, config, g, sources, clipped,
                        reached(g, sources, blocked=set(clipped)), factors,
                        adaptive_bound(graph) if config.adaptive else None,
                        real_examples(graph) if config.batch_buckets is not None else None,
                        tagged(graph, "noise_scale"))


def check_clip_factors(proof: Backward) -> None:
    """Each clip factor has the configured form (clip.py); each clipped sum is scaled by one of
    them and sums only what its norm is taken over, a block's clipped sums by Note [A block's
    clipped sums]. Fills ``proof.bound_of`` (adaptive clipping: each factor's C is the input
    holding C_t) and ``proof.factor_of``."""
    an, config, real = proof.an, proof.config, proof.real
    bound_of, factor_of = proof.bound_of, proof.factor_of
    for factor in proof.factors:
        bound_of[factor] = check_clip_factor(factor, config, proof.adaptive, an, real)
    covered = {f: norm_sources(f) for f in proof.factors}   # what each factor's norm is taken over
    dependent = reached(proof.g, proof.sources)
    block_rows = {}     # (dpfx::block_bwd call, parameter index) -> the clipped sum releasing it
    for c in proof.clipped:
        if is_block_clip(c):   # Note [A block's clipped sums] (block.py)
            factor_of[c], row = check_block_clip(c, covered, bound_of, an, config, real)
            if row in block_rows:
                raise PrivacyError(f"{c.name} and {block_rows[row].name} both release parameter "
                                   f"{row[1]} of block call {row[0].name}")
            block_rows[row] = c
            continue
        apply = clip_apply_of(c)
        _, coef = apply.args
        base = scaling_factor(coef, an, config, real)
        if base not in bound_of:
            raise PrivacyError(f"{c.name} is not scaled by the clip factor")
        factor_of[c] = base
        check_clipped_sum(c, apply, base.args[0], covered[base], dependent,
                          "the per-sample norm it is clipped by")


def check_noise_source(proof: Backward) -> list[fx.Node]:
    """The graph's noise comes from where the configuration says: none with noise="optimizer",
    at most one dpfx::add_noise_ call otherwise (one key a step; Note [Noise added in place] in
    ops/noise.py). Returns the calls."""
    graph = proof.gm.graph
    if proof.config.noise == "optimizer" and tagged(graph, "noise"):
        raise PrivacyError("noise='optimizer' graphs must leave the noise to dpfx.DPOptimizer")
    calls = [n for n in graph.nodes if is_add_noise(n)]
    if len(calls) > 1:
        raise PrivacyError(f"the backward graph calls dpfx::add_noise_ {len(calls)} times, not "
                           f"once: two calls could draw the same noise")
    return calls


def check_clipped(proof: Backward, name: str, out: fx.Node) -> set[fx.Node]:
    """Parameter ``name``'s gradient output has no path from the data that bypasses the clipped
    sums, reads at least one, and each is clipped to its group's C. Returns what ``out`` is
    computed from (``release_ancestors``)."""
    if out in proof.leaked:
        cut = proof.g.copy()
        cut.remove_nodes_from(proof.clipped)
        path = leak_path(cut, proof.sources, out)
        raise PrivacyError(
            f"the gradient of parameter '{name}' has a path from the data that bypasses "
            f"per-sample clipping: {' -> '.join(n.name for n in path)}")
    ancestors = release_ancestors(proof.g, out, proof.memo)
    mine = [c for c in proof.clipped if c in ancestors]
    if not mine:
        raise PrivacyError(f"the gradient of parameter '{name}' does not depend on the clip "
                           f"factor")
    config = proof.config
    bound = config.clip_bounds[config.group_of(name)] if proof.adaptive is None \
        else proof.adaptive
    for c in mine:
        if proof.bound_of[proof.factor_of[c]] != bound:
            raise PrivacyError(f"the gradient of parameter '{name}' is clipped to "
                               f"{proof.bound_of[proof.factor_of[c]]}, but its group's bound is "
                               f"{bound}")
    return ancestors


def check_deferred(name: str, out: fx.Node) -> None:
    """noise="optimizer": the output is the tagged clipped sum that dpfx.DPOptimizer noises."""
    if out.meta.get("dpfx_output") != "clipped_grad":
        raise PrivacyError(f"the gradient output of parameter '{name}' is not the tagged "
                           f"clipped sum that dpfx.DPOptimizer noises")


def check_no_other_batch_mixing(gm: fx.GraphModule, an: BatchAnalysis) -> None:
    """After the rewrite, the clipped sums are the only ops that may combine examples: a rule
    that read a batch-wide value (a count over the whole batch, say) would leak through it."""
    mixing = mixing_ops(gm, an.rerun(gm.graph), skip={"clipped_sum", "block_clip",
                                                       "unclipped_count"})
    if mixing:
        raise PrivacyError(
            "the rewritten backward graph combines examples outside the clipped sums:\n  - "
            + "\n  - ".join(f"{node.name} = {node.target}: {why}" for node, why in mixing))
