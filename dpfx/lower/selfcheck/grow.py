"""The self-check's larger size, grown from the smaller by one example added before it.

    if grow.grows(check, served) and (dims := grow.tangent_dims(check)) is not None:
        grown = grow.run(check, served[1], served[0], args, sizes, generator, dims)
        check._check_at(served[0], ..., grown)     # the smaller size, compared with the reference

The larger size runs compiled only: its forward rows must be the smaller size's, and its
release may move by at most one example's clip bound (Note [The second size grows the first]);
a failure is blamed on what the eager reference shows (Note [The self-check blames only what it
has shown]).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from dpfx.errors import PrivacyError
from dpfx.graph.batch import BatchDim
from dpfx.lower.selfcheck.batches import (call_boxed, every_example, other_examples, random_like,
                                          rows_from, saved_by_backward_name, synthetic)
from dpfx.lower.selfcheck.compare import close
from dpfx.lower.selfcheck.stream import recording
from dpfx.ops import noise as cpu_noise
from dpfx.passes.clip_noise import REAL_EXAMPLES


# Note [The second size grows the first]
# Comparing both sizes with the eager reference, each with its own independence run, takes ten
# graph runs, half of them eager: on a large model a third of torch.compile's whole cold first
# step. So where the backward's release is known (the backend sets
# ``release``: not under adaptive clipping or padded batches; not for 16-bit or random forwards,
# whose rows would not agree across sizes to the budget; not with a captured loss, whose saved
# terms carry the loss's normalizers, 1/B among them), the larger size B + 1 runs compiled only,
# on a batch whose examples 1.. are the smaller batch's, with the same output gradients on them:
# - the compiled forward at both sizes, before the larger backward runs (it may reuse its
#   donated saved tensors' buffers): every example's rows of every batch-laid output (saved
#   activations included) must be the same at B and at B + 1 with an example added before it,
#   and batch-free outputs the same. This is the independence test (what changing example 0
#   would change, adding it changes) and the test that no code assumed either size.
# - the compiled backward at both sizes, noiseless, the shared examples' output gradients the
#   same up to the mean's 1/B (Note [A mean's output gradients carry 1/B]): with S the released
#   sums times D, the added example may move S by at most its clip bound,
#       ||S(B + 1) - S(B)|| <= sqrt(sum_g C_g^2) (1 + 1e-3) + 1e-4 ||S(B)||,
#   the canary test, on the generated code at the larger size.
# - the smaller size is compared with the eager reference, forward and backward: the
#   comparison of the generated code against the proven graph.
# What the larger size does not show: a backward wrong there by less than one example's bound (a
# utility error, not a leak: mixing examples moves the sum by more). The check costs six runs, two
# of them eager (figures: BENCHMARKS.md, "Levers in the code"). Elsewhere both sizes run the full
# comparison. (tests/lower/test_selfcheck.py::test_code_wrong_at_the_larger_size_only_is_refused)


# Note [A mean's output gradients carry 1/B]
# Under loss_reduction="mean" the output gradients a backward receives carry the loss's 1/B, and
# the graph takes it off with the batch size of the call: each example's gradient is B times the
# one the graph computes from them (passes/clip_noise.py). The grown check draws the larger
# size's output gradients and gives the smaller size the same rows; fed as they are, every
# shared example's gradient at B + 1 would be (B + 1)/B times its gradient at B, and each
# unclipped example would move the sum by 1/B of its norm. With some examples near C and the
# added one clipped, that passed C on correct code, at some C and not others. So for a mean the
# smaller size's output gradients are the larger's rows times (B + 1)/B, as a mean loss's would
# be: every shared example's gradient is then the same at both sizes, and only the added one
# moves S. The backward is linear in its output gradients, so this is exact up to rounding.
# (tests/lower/test_selfcheck_sweep.py: C swept across the examples' norms, both reductions)


@dataclasses.dataclass(frozen=True)
class Release:
    """What the compiled backward releases, for Note [The second size grows the first]: its
    gradient outputs' positions, D (None: the batch size, a mean without expected_batch_size;
    1 for clipped sums and sums), the most one example may move the sum of clipped gradients
    (sqrt(sum_g C_g^2)), and whether the graph multiplies each example's gradient by the batch
    size of the call (loss_reduction="mean": Note [A mean's output gradients carry 1/B])."""
    positions: frozenset
    divisor: float | None
    bound: float
    mean: bool = False


def grows(check, served: list) -> bool:
    return len(served) == 2 and served[1] == served[0] + 1 and check.release is not None \
        and check.backward is not None and check.compare_backward \
        and not check.forward.random and not check.low_precision() and not check.targets \
        and "loss" not in check.layouts \
        and all(name != REAL_EXAMPLES for name, _ in check.backward.inputs)


def tangent_dims(check) -> dict | None:
    """The batch dim of each backward input the check draws (an output's gradient), by
    position: None for one without the batch; None in all where one holds the batch
    other than as a dim of its own."""
    saved = set(check.forward.outputs)
    dims = {}
    for k, (name, meta) in enumerate(check.backward.inputs):
        if name in saved or name.startswith("rng_state_output_"):
            continue
        if isinstance(meta, torch.SymInt):
            if meta.node.expr.free_symbols & set(check.batch_symbols):
                return None
            continue
        if not isinstance(meta, torch.Tensor):
            continue
        found = []
        for d, size in enumerate(meta.shape):
            if not isinstance(size, torch.SymInt):
                continue
            expr = size.node.expr
            if expr in check.batch_symbols:
                found.append(d)
            elif expr.free_symbols & set(check.batch_symbols):
                return None
        if len(found) > 1:
            return None
        dims[k] = found[0] if found else None
    return dims


def _tangent_scale(check, large: int, small: int) -> float:
    """Note [A mean's output gradients carry 1/B]: what the smaller size's output gradients
    are the larger size's times, so that every shared example's gradient is the same."""
    return large / small if check.release.mean else 1.0


def run(check, large: int, small: int, args: list, sizes: dict, generator,
        dims: dict) -> "Grown":
    """The compiled forward and backward at the larger size; the smaller size's inputs,
    its examples 1 on."""
    at_large = {**sizes, **{s: large for s in check.batch_symbols}}
    at_small = {**sizes, **{s: small for s in check.batch_symbols}}
    fw_large = [synthetic(name, meta, a, at_large, generator, check.batch_inputs, check.targets)
                for (name, meta), a in zip(check.forward.inputs, args)]
    fw_small = [rows_from(a, 0 if name in check.batch_inputs else None, meta, at_small)
                for (name, meta), a in zip(check.forward.inputs, fw_large)]
    got = call_boxed(check.forward.compiled, fw_large, check.device)
    del fw_large
    grown = Grown(fw_small, got, {}, large, at_large, check.release)
    # before the larger backward runs: it may reuse its saved tensors' buffers (donated)
    grown.small = call_boxed(check.forward.compiled, fw_small, check.device)
    mixed = _mixed_rows(check, small, grown.small, grown.outputs, large, at_small, at_large)
    grown.outputs = None
    if mixed is not None:
        raise GrownFailure("forward", small, large, output=mixed[0], batch_free=mixed[1])
    saved = saved_by_backward_name(check.forward, got)
    del got
    bw_args, tangents = [], {}
    scale = _tangent_scale(check, large, small)
    for k, (name, meta) in enumerate(check.backward.inputs):
        value = saved[name] if name in saved else random_like(meta, at_large, generator)
        if k in dims:
            tangents[k] = rows_from(value, dims[k], meta, at_small, scale)
        bw_args.append(value)
    del saved
    with cpu_noise.noiseless():
        released = call_boxed(check.backward.compiled, bw_args, check.device, consume=True)
    grown.tangents = tangents
    for i in check.release.positions:
        if i < len(released) and isinstance(released[i], torch.Tensor):
            grown.large[i] = released[i]
    return grown


def _mixed_rows(check, b: int, got: list, outputs: list, large: int, at_small: dict,
                at_large: dict) -> tuple | None:
    """(name, batch-free?) of the first forward output whose examples' rows at size ``b``
    are not those they have at ``large``, where an example was added before them (or,
    batch-free, not the same): something mixes examples or assumed a batch size. None:
    every output agrees."""
    for name, layout, x, y in zip(check.forward.outputs, check.layouts, got, outputs):
        if not isinstance(x, torch.Tensor) or (layout is not None
                                               and not isinstance(layout, BatchDim)):
            continue
        if layout is not None:
            # See Note [An arange over the rows] in graph/batch.py: an output that counts
            # the rows holds each row's number, one example further on in the larger batch
            shift = 0 if layout.index_of is None else 1 if layout.index_of == "unit" else \
                y.shape[layout.dim] - x.shape[layout.dim]
            x = every_example(x, layout, b, at_small)
            y = other_examples(y, layout, large, at_large)
            if shift:
                y = y - shift
        if not close(x, y, 1e-4):
            return name, layout is None
    return None


# -- Note [The self-check blames only what it has shown] -------------------------------------
def blame(check, failure: "GrownFailure", args: list, sizes: dict, start,
          dims: dict) -> PrivacyError:
    """The grown experiment again on the same batches, run by the verified graphs
    eagerly: the error names the compiled code only where the proven graph passes."""
    generator = torch.Generator(device="cpu")
    generator.set_state(start)
    large, small = failure.large, failure.b
    at_large = {**sizes, **{s: large for s in check.batch_symbols}}
    at_small = {**sizes, **{s: small for s in check.batch_symbols}}
    fw_large = [synthetic(name, meta, a, at_large, generator, check.batch_inputs, check.targets)
                for (name, meta), a in zip(check.forward.inputs, args)]
    fw_small = [rows_from(a, 0 if name in check.batch_inputs else None, meta, at_small)
                for (name, meta), a in zip(check.forward.inputs, fw_large)]
    want_large = call_boxed(check.forward.reference, fw_large, check.device, consume=True)
    want_small = call_boxed(check.forward.reference, fw_small, check.device, consume=True)
    if failure.which == "forward":
        mixed = _mixed_rows(check, small, want_small, want_large, large, at_small, at_large)
        return failure.error(reference_failed=mixed is not None)
    scale = _tangent_scale(check, large, small)
    saved = saved_by_backward_name(check.forward, want_large)
    bw_large, tangents = [], {}
    for k, (name, meta) in enumerate(check.backward.inputs):
        value = saved[name] if name in saved else random_like(meta, at_large, generator)
        if k in dims:
            tangents[k] = rows_from(value, dims[k], meta, at_small, scale)
        bw_large.append(value)
    del saved, want_large
    released_large = _released_by_reference(check, bw_large)
    saved = saved_by_backward_name(check.forward, want_small)
    bw_small = [saved[name] if name in saved else tangents[k] if k in tangents else
                random_like(meta, at_small, generator)
                for k, (name, meta) in enumerate(check.backward.inputs)]
    del saved, want_small
    released_small = _released_by_reference(check, bw_small)
    d_large = float(large) if check.release.divisor is None else check.release.divisor
    d_small = float(small) if check.release.divisor is None else check.release.divisor
    gap = 0.0
    for i in check.release.positions:
        x, y = released_large.get(i), released_small.get(i)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            gap += float(torch.dist(x.double() * d_large, y.double() * d_small)) ** 2
    return failure.error(reference_moved=math.sqrt(gap))


def _released_by_reference(check, bw_args: list) -> dict:
    """The verified backward's noiseless release, run eagerly: position -> gradient."""
    with cpu_noise.noiseless():
        recording.collect = {}
        try:
            out = call_boxed(check.backward.reference, bw_args, check.device, consume=True)
            collected = recording.collect
        finally:
            recording.collect = None
    released = {i: x for i, x in enumerate(out) if isinstance(x, torch.Tensor)}
    released.update(collected)
    return released


class Grown:
    """The larger size's run, kept for the smaller size's check."""

    def __init__(self, fw_args, outputs, tangents, size, sizes, release: Release):
        self.fw_args, self.outputs, self.tangents = fw_args, outputs, tangents
        self.size, self.sizes, self.release = size, sizes, release
        self.large: dict = {}       # position -> the larger size's released gradient
        self.small: list | None = None    # the smaller size's compiled forward outputs
        self.gap = 0.0              # sum over positions of ||S_large - S_small||^2
        self.norm = 0.0             # ... of ||S_small||^2
        self.finite = True

    def _d(self, b: int) -> float:
        return float(b) if self.release.divisor is None else self.release.divisor

    def account(self, position: int, small: torch.Tensor) -> None:
        large = self.large.pop(position, None)
        if large is None or not isinstance(small, torch.Tensor):
            return
        d_small, d_large = self._d(self.size - 1), self._d(self.size)
        norm = float(torch.linalg.vector_norm(small, dtype=torch.float64)) * d_small
        if not math.isfinite(float(torch.linalg.vector_norm(large))):
            self.finite = False     # an example's non-finite terms are selected away
            return
        if not math.isfinite(norm):
            return                  # the eager comparison lines these up
        # ||S_large - S_small|| without a copy of either (torch.dist fuses the difference)
        scaled = small if d_small == d_large else small * (d_small / d_large)
        gap = float(torch.dist(large, scaled)) * d_large
        self.gap += gap * gap
        self.norm += norm * norm

    def check(self, b: int) -> None:
        moved = math.sqrt(self.gap)
        limit = self.release.bound * (1 + 1e-3) + 1e-4 * math.sqrt(self.norm)
        if self.large or not self.finite or not moved <= limit:
            raise GrownFailure("backward", b, self.size, moved=moved, limit=limit,
                                bound=self.release.bound, unmatched=bool(self.large),
                                finite=self.finite)


# Note [The self-check blames only what it has shown]
# The grown comparison runs compiled code only, so a failure there shows that the generated
# code moved (or mixed) something, not whose fault it is. Before it refuses, the check runs the
# same experiment on the same batches through the verified graphs eagerly. Where they pass, the
# generated code is not the graph dpfx proved, and the error says so (a torch bug: the eager
# backend runs the proven graph). Where they fail too, the fault is dpfx's own (its rewrite, or
# this check's premise about the graph), and the error says that instead and does not send the
# user to another backend. Either way dpfx refuses to train. The reference runs only on this
# path. (tests/lower/test_selfcheck.py::test_a_grown_failure_blames_what_the_reference_shows)
class GrownFailure(Exception):
    """What the grown comparison saw (Note [The second size grows the first])."""

    def __init__(self, which: str, b: int, large: int, *, output: str | None = None,
                 moved: float = math.nan, limit: float = math.nan, bound: float = math.nan,
                 unmatched: bool = False, finite: bool = True, batch_free: bool = False):
        super().__init__(which)
        self.batch_free = batch_free
        self.which, self.b, self.large, self.output = which, b, large, output
        self.moved, self.limit, self.bound = moved, limit, bound
        self.unmatched, self.finite = unmatched, finite

    def error(self, reference_failed: bool | None = None,
              reference_moved: float | None = None) -> PrivacyError:
        if self.which == "forward":
            changed = f"the batch-free output {self.output}" if self.batch_free else \
                f"the other examples' rows of output {self.output}"
            seen = (f"dpfx's self-check of the compiled forward: adding an example before the "
                    f"others changed {changed} (batch size {self.b} against {self.large})")
            ours = reference_failed
            reference = "the verified graph, run eagerly on the same batches, changed them too" \
                if ours else "the verified graph, run eagerly on the same batches, did not"
        else:
            what = (" and released a gradient the smaller batch did not" if self.unmatched
                    else " and released a non-finite gradient" if not self.finite else "")
            seen = (f"dpfx's self-check of the compiled backward: one example added to a batch "
                    f"of {self.b} moved the sum of clipped gradients (noiseless, times D) by "
                    f"{self.moved:.6g}{what}; one example may move it by at most its clip bound "
                    f"{self.bound:.6g} (limit with rounding {self.limit:.6g})")
            ours = reference_moved is not None and not reference_moved <= self.limit
            reference = f"the verified graph, run eagerly on the same batches, moved it by " \
                f"{reference_moved:.6g}"
        if ours:
            return PrivacyError(
                f"{seen}; {reference}. So the fault is in dpfx (its rewrite of this model, or "
                f"the self-check itself), not in the code torch generated. dpfx refuses to "
                f"train. Please report it with the model, dpfx.explain(model)'s output and "
                f"your torch version; DPFX_DUMP_DIR=dumps writes the graphs.")
        return PrivacyError(
            f"{seen}; {reference}. So the code Inductor generated is not the graph dpfx proved "
            f"(it mixes examples or assumed a batch size: a torch bug), and dpfx refuses to "
            f"train with it. backend='eager' runs the proven graph; please report this with "
            f"your torch version (DPFX_DUMP_DIR=dumps writes the graphs).")
