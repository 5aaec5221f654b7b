"""The loss's scale on each step: what the check proved, evaluated on the step's values.

    values = normalizer_values(verdict, batch, inputs)
    factor, changed = eval_scale(verdict, batch, values, "mean")   # or a PerTerm, or a refusal

check.py proves the loss ``sum_k c_k sum_i t_k(z_i)``, each c_k a Python weight times a part
that depends on the batch (a power of its size, normalizers such as a token count), and returns
a ``Verdict`` that says how to compute them. This module computes them on each step and removes
the batch-dependent part, so that each example's gradient is that of its own term (Note [The
per-example term] in check.py): one factor on the backward's starting gradient, or each term on
its own scale where their parts differ (Note [Terms on their own scales]).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.fx as fx

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Term:
    weight_power: int           # p in B^p
    normalizers: tuple          # ((index into Verdict.normalizer outputs, power q), ...)


@dataclasses.dataclass
class Verdict:
    """What the check proved: the terms' batch-dependent scales, and how to evaluate them."""
    terms: list[Term]
    evaluate_normalizers: Callable | None   # real inputs -> tuple of scalar tensors
    declared: str                           # "mean" | "sum": the scale the loss itself has
    scalar_normalizers: frozenset = frozenset()   # those that are Python numbers
    weights: tuple | None = None            # (the terms' relative weights, B) on the last step
    sized: dict = dataclasses.field(default_factory=dict)   # outputs whose size a normalizer reads
    replayed: fx.GraphModule | None = None  # the loss as replayed, and its terms' nodes: for
    term_nodes: list = dataclasses.field(default_factory=list)   # Note [Terms on their own scales]
    normalizer_calls: tuple = ()            # the call each normalizer was computed in
    term_calls: tuple = ()                  # the call of each term's reduction over the batch
    _scaled: Callable | None = None


@dataclasses.dataclass
class PerTerm:
    """eval_scale's answer when the terms' batch-dependent scales differ: each term's own
    factor, and the factor of the whole (Note [Terms on their own scales])."""
    ratios: list[float]
    factor: float



def normalizer_values(verdict: Verdict, batch: int, inputs: list) -> tuple:
    """The normalizers N_j on the step's inputs (empty where eval_scale reads none)."""
    if batch == 0 or not verdict.terms or not verdict.evaluate_normalizers:
        return ()
    return verdict.evaluate_normalizers(*(
        torch.tensor(v) if isinstance(v, (int, float)) else
        torch.empty(()).expand(batch, *verdict.sized[i]) if i in verdict.sized else v
        for i, v in enumerate(inputs)))


def _power(value, q: int) -> float:
    """``value ** q`` for a normalizer; infinite for a count of 0 under a negative power (a token
    mean whose batch has no token left that is not ignored: that term's sum is 0, and the term
    is left out of the release, where Python's float power would raise)."""
    value = float(value)
    if value == 0.0 and q < 0:
        return math.inf
    return value ** q


def eval_scale(verdict: Verdict, batch: int, values: tuple, reduction: str
               ) -> tuple[float, bool] | str:
    """The factor by which the backward's starting gradient is multiplied on this step so that
    each example's gradient is that of its own term (Note [The per-example term]), and whether
    it differs from 1; or why the terms cannot be put on one scale. ``values`` are the
    normalizers on this step (``normalizer_values``). ``reduction="mean"`` targets 1/B, which
    the backward graph undoes."""
    if batch == 0 or not verdict.terms:
        return 1.0, False
    target = 1.0 / batch if reduction == "mean" else 1.0
    negative = next((float(values[i]) for term in verdict.terms for i, _ in term.normalizers
                     if i not in verdict.scalar_normalizers and float(values[i]) < 0), None)
    if negative is not None:
        # See Note [A constant factor is no change of scale]
        return (f"it is multiplied or divided by a tensor of value {negative:.4g}, and dpfx "
                f"cannot tell a negative constant in a tensor from a statistic of the batch, "
                f"whose sign would flip every example's gradient. Write the sign as a Python "
                f"number or a negation (`-loss`, `-0.5 * loss`)")
    if len(verdict.terms) == 1 and not verdict.scalar_normalizers:
        # the steady state's common case, what the loop below computes for one term
        b = float(batch) ** verdict.terms[0].weight_power
        for i, q in verdict.terms[0].normalizers:
            b *= _power(values[i], q)
        if b == 0 or not math.isfinite(b):
            return 1.0, False
        verdict.weights = ((1.0,), batch)
        return target / b, abs(target / b - 1.0) > 1e-6
    batch_parts, weights = [], []
    for term in verdict.terms:
        b, w = float(batch) ** term.weight_power, 1.0
        for i, q in term.normalizers:
            if i in verdict.scalar_normalizers:
                w *= _power(values[i], q)
            else:
                b *= _power(values[i], q)
        batch_parts.append(b)
        weights.append(w)
    # A term whose batch-dependent part is 0 or infinite (a token mean over no token that is
    # not ignored) has nothing in it this step: it is left out (ratio 0), and the others keep
    # their own scales, as they would with it present.
    present = [b for b in batch_parts if b != 0 and math.isfinite(b)]
    top = max(abs(w) for w in weights)
    if not present or top == 0 or not math.isfinite(top):
        return 1.0, False
    first = present[0]
    per_term = len(present) < len(batch_parts) or any(
        abs(s - first) > 1e-6 * max(abs(first), abs(s)) for s in present[1:])
    relative = tuple(w / top for w in weights)
    if verdict.weights is not None and _follows_batch(verdict.weights, relative, batch):
        return (f"the Python numbers weighting its terms changed with the batch size "
                f"({_ratios(verdict.weights[0])} at B = {verdict.weights[1]}, "
                f"{_ratios(relative)} at B = {batch}): a weight computed from the batch would "
                f"let one example rescale every other example's gradient. Weight the terms with "
                f"constants or a schedule, and write the batch size only as a common factor of "
                f"the whole loss, or with tensor ops (.mean(), out.size(0))")
    verdict.weights = (relative, batch)
    if per_term:
        return PerTerm([1.0 / (b * top) if b != 0 and math.isfinite(b) else 0.0
                        for b in batch_parts], target)
    factor = target / (first * top)
    return factor, abs(target / (first * _as_batch(top, batch)) - 1.0) > 1e-6


# Note [A constant factor is no change of scale]
# ``1.5 * F.mse_loss(out, t, reduction="sum")``, ``-loss``, ``(-0.5 * loss).backward()`` for
# gradient ascent: a Python number on the whole loss is removed with the other scalars (Note
# [The per-example term] in check.py), its magnitude only: the sign stays in each example's
# term, so the release is sign(c) times the clipped sum plus noise, whose sensitivity is C and
# whose noise, symmetric, is the same. Such a factor does not change the loss's reduction, so
# ``LossScaleWarning`` (which says when the reduction differs from ``loss_reduction``, or a
# count of the batch divides the loss) reads the largest weight's magnitude |c| as part of the
# batch's scale only where it is a power of the batch size other than 1 (``sum / len(y)``,
# ``* (1 / len(y))``, which dpfx cannot tell from a constant): at B = 1 no number is one.
# A tensor the loss is multiplied or divided by (a count, ``mask.sum()``) is removed with its
# sign, so a negative one is refused rather than trained as if positive: dpfx cannot tell a
# constant tensor from a statistic of the batch, and a sign that followed the batch would let
# one example flip every example's gradient.
# (tests/loss/test_loss_sign.py)
def _as_batch(weight: float, batch: int) -> float:
    """``weight`` where it is ``batch ** q`` for an integer q != 0 and batch > 1, else 1."""
    if batch > 1 and weight > 0 and math.isfinite(weight):
        q = math.log(weight) / math.log(batch)
        if round(q) != 0 and abs(q - round(q)) < 1e-9:
            return weight
    return 1.0


# Note [Terms on their own scales]
# A loss whose terms' batch-dependent scales differ (BERT's pre-training loss: a token mean over
# the masked tokens plus a mean over examples; a token loss plus a distillation term with
# "batchmean") cannot be put on the per-example scale by one factor on the backward's starting
# gradient. Its checked program can: ``scaled_terms`` reruns the replayed loss on the step's
# real values with each term's node multiplied by its own factor (1 / (its batch-dependent part
# * the largest Python weight)), so the graph computes sum_k (v_k / v) s_k sum_i t_k(z_i)
# exactly, and differentiates it with respect to the outputs; loss_track then runs the backward
# from the outputs' autograd edges with those gradients instead of the user's loss. Everything
# above a term is linear (the terminal rule), so scaling the term's node scales its whole
# contribution. (tests/loss/test_loss_corpus.py::test_terms_on_their_own_scales)
def scaled_terms(verdict: Verdict, inputs: list, ratios: list[float]) -> torch.Tensor:
    """The per-example loss of Note [Terms on their own scales] on the step's values."""
    if verdict._scaled is None:
        graph = fx.Graph()
        env: dict = {}
        out = graph.graph_copy(verdict.replayed.graph, env)
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            scales = graph.placeholder("dpfx_term_scales")
        by_name = {n.name: n for n in graph.nodes}
        old_names = {old.name: new for old, new in env.items()}
        scaled_nodes = set()
        for k, name in enumerate(verdict.term_nodes):
            node = old_names.get(name, by_name.get(name))
            if node in scaled_nodes:
                continue    # Note [A stack of batch sums]: a term reached along several paths
            scaled_nodes.add(node)
            users = list(node.users)
            with graph.inserting_after(node):
                factor = graph.call_function(aten.select.int, (scales, 0, k))
            with graph.inserting_after(factor):
                scaled = graph.call_function(aten.mul.Tensor, (node, factor))
            for u in users:
                u.replace_input_with(node, scaled)
        graph.output(out)
        verdict._scaled = fx.GraphModule(verdict.replayed, graph).forward
    return verdict._scaled(*inputs, torch.tensor(ratios, dtype=torch.float64))


def _follows_batch(last: tuple, relative: tuple, batch: int) -> bool:
    """Whether the terms' relative weights changed since the last step by powers of the batch
    size's change (``ce.sum() / len(y) + aux.sum()``): a Python number computed from the batch.
    A schedule (a KL weight annealed over steps) changes them otherwise and is the user's.
    This sees such a weight only once the batch size has changed, after a step was released:
    Note [The per-example term] says what is and is not proven."""
    weights, before = last
    if before == batch or all(abs(r - w) <= 1e-6 for r, w in zip(relative, weights)):
        return False
    growth = batch / before
    powers = [growth ** p for p in (-2, -1, 1, 2)]
    moved = False
    for r, w in zip(relative, weights):
        if abs(r - w) <= 1e-6 * max(abs(r), abs(w)):
            continue
        if w == 0 or not any(abs(r / w - q) <= 1e-6 * q for q in powers):
            return False
        moved = True
    return moved


def _ratios(weights: tuple) -> str:
    return ":".join(f"{w:.4g}" for w in weights)
