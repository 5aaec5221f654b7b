"""The release: each gradient output is exactly (clipped sums + noise) / D, nothing between.

    slot = check_release(name, out, an, config, real)   # the add_noise_ entries it takes, or None

The clip and the noise are each checked where they are made (clip.py, noise.py); this checks
what joins them, so that nothing reweights one against the other (Note [The release is checked
as a whole]), in both forms the release takes: a noise_scale node added to the clipped side and
divided by D (the sliced draw), or a getitem of the graph's one ``dpfx::add_noise_`` call (Note
[Noise added in place] in ops/noise.py).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dpfx.config import DPConfig
from dpfx.errors import PrivacyError
from dpfx.graph.batch import BatchAnalysis
from dpfx.passes.verify.patterns import is_add_noise

aten = torch.ops.aten
prims = torch.ops.prims


# Note [The release is checked as a whole]
# The checks above pin each ingredient: the clip coefficient of every clipped sum, the scale of
# every noise slice. What joins them must not reweight one against the other: a clipped sum
# multiplied by 2 after the fact, or noise multiplied by 0.5 before it is added, would keep every
# ingredient right and still halve the noise-to-sensitivity ratio. So each gradient output must
# be, exactly, cast?(mul(add(moves(clipped sums), noise_scale), 1/D)), or cast?(mul(moves(c),
# 1/D)) with c a clipped sum that accumulates into (moves of) the noise_scale node (an
# embedding's index_put: Note [The clipped sum accumulates into the noise]): the noise_scale
# node added as it is, exactly one noise term, the clipped side reached from clipped_sum nodes
# through norm-preserving data movement and adds of such sides only (a tied weight's uses, each
# clipped sum once), one final scaling by 1/D (the configured expected batch size, or a division
# by the batch size symbol; none for a "sum" loss), and a dtype cast. The CPU form (Note [Noise
# added in place], ops/noise.py) is cast?(moves(getitem(add_noise_ call, k + 1))) with the
# call's std, multiplier and divisor pinned and its base k walked as the clipped side above.
# (tests/passes/test_verifier.py::test_release_reweighted_after_the_checks_is_rejected)
_RELEASE_MOVES = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.t.default, aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.clone.default, aten.alias.default,
    prims.convert_element_type.default,
}


def check_release(name: str, out: fx.Node, an: BatchAnalysis, config: DPConfig,
                   real: fx.Node | None = None) -> tuple | None:
    def refuse(why: str):
        raise PrivacyError(f"the gradient of parameter '{name}' is not (clipped sum + noise) / D "
                           f"as released: {why}")

    node = out
    if node.target is prims.convert_element_type.default:
        node = node.args[0]
    item = node     # the output itself may be a move (tagged private_grad)
    while item.target in _RELEASE_MOVES and item.meta.get("dpfx") in (None, "private_grad"):
        item = item.args[0]
    span = None     # Note [Vector parameters' per-sample gradients stacked] (clip_noise.py)
    if item.target is aten.slice.Tensor and item.meta.get("dpfx") in (None, "private_grad"):
        span, item = item, item.args[0]
    if item.target is operator.getitem and is_add_noise(item.args[0]):
        if real is not None and config.loss_reduction == "mean" and \
                config.expected_batch_size is None:
            refuse(f"{item.name} is released by dpfx::add_noise_, whose divisor is a size: a "
                   f"padded batch's D is its real_examples input")
        return _check_release_in_place(name, item, an, config, refuse, span)
    if span is not None:
        refuse(f"{span.name} slices what is not a sum that dpfx::add_noise_ released")
    if config.loss_reduction == "mean":
        if config.expected_batch_size is not None:
            exact = node.target is aten.mul.Tensor and isinstance(node.args[1], float) and \
                node.args[1] == 1.0 / config.expected_batch_size
        else:
            divisor = node.args[1] if node.target is aten.div.Tensor else None
            exact = isinstance(divisor, fx.Node) and (divisor is real if real is not None else (
                isinstance(divisor.meta.get("val"), torch.SymInt) and
                an.size(divisor.meta["val"]) == an.batch))
        if not exact:
            refuse(f"{node.name} = {node.target} is not the division by D")
        node = node.args[0]
    if node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
        noise = [x for x in node.args
                 if isinstance(x, fx.Node) and x.meta.get("dpfx") == "noise_scale"]
        if len(noise) != 1:
            refuse(f"{node.name} does not add a noise_scale node as it is")
        stack = [node.args[1] if node.args[0] is noise[0] else node.args[0]]
    else:   # Note [The clipped sum accumulates into the noise] (passes/clip_noise.py)
        noise, stack = [], [node]
    _walk_clipped_side(stack, noise, refuse)
    if len(noise) != 1:
        refuse(f"{len(noise)} noise terms reach it, not one")


def _walk_clipped_side(stack: list, noise: list, refuse) -> None:
    """Walk the clipped side of a release down to its clipped sums: adds of such sides and
    norm-preserving moves only, each clipped sum once; a clipped sum accumulated into (moves of)
    a noise_scale node appends that node to ``noise``."""
    reached = set()
    while stack:
        x = stack.pop()
        if not isinstance(x, fx.Node):
            refuse(f"the constant {x!r} is added to the noise")
        if x.meta.get("dpfx") == "clipped_sum":
            if x in reached:
                refuse(f"the clipped sum {x.name} is added twice")
            reached.add(x)
            if x.target in _ACCUMULATES_INTO_ARG0 and through_release_moves(x.args[0]).meta.get(
                    "dpfx") == "noise_scale":
                noise.append(x.args[0])
            continue
        if x.target is aten.add.Tensor and len(x.args) == 2 and not x.kwargs:
            stack.extend(x.args)
        elif x.target is operator.getitem and x.args[0].meta.get("dpfx") == "clipped_sum":
            stack.append(x.args[0])     # the weight output of a book-keeping convolution_backward
        elif x.target in _RELEASE_MOVES and x.meta.get("dpfx") is None:
            stack.append(x.args[0])
        else:
            refuse(f"{x.name} = {x.target} lies between the clipped sum and the noise")


def _check_release_in_place(name: str, item: fx.Node, an: BatchAnalysis, config: DPConfig,
                            refuse, span: fx.Node | None = None) -> tuple:
    """The release of Note [Noise added in place] (ops/noise.py): the output is cast?(moves(
    getitem(call, k + 1))) of an auto_functionalized_v2 of dpfx::add_noise_ whose std is sigma *
    C and whose (multiplier, divisor) is exactly 1/D, whose sum k is a whole base of its own (no
    view of one), and whose base k is a clipped side; or cast?(moves(``span``)), ``span`` a
    slice [start, end) of a 1-D getitem(call, k + 1), step 1, constant bounds (Note [Vector
    parameters' per-sample gradients stacked] in clip_noise.py). Returns (call, index, start,
    end): the entries of sum k this parameter takes, which no other parameter's may overlap."""
    call, index = item.args
    kwargs = call.kwargs
    bases = kwargs.get("_all_bases")
    n = kwargs.get("_sums_length")
    expected = {"std", "multiplier", "divisor", "_sums_length", "_all_bases",
                *(f"_sums_{k}_base_index" for k in range(n if isinstance(n, int) else 0))}
    if set(kwargs) != expected or not isinstance(bases, (list, tuple)) or len(bases) != n or \
            any(kwargs[f"_sums_{k}_base_index"] != k for k in range(n)) or \
            len(set(bases)) != n or len(call.args) != 1:
        refuse(f"{call.name} is not one dpfx::add_noise_ over {n} whole, distinct sums")
    if not isinstance(index, int) or not 1 <= index <= n:
        refuse(f"{item.name} is not one of {call.name}'s noised sums")
    if kwargs["std"] != config.noise_std:
        raise PrivacyError(f"the noise of parameter '{name}' is not N(0, (sigma*C)^2): scale "
                           f"{kwargs['std']}, expected {config.noise_std}")
    multiplier, divisor = kwargs["multiplier"], kwargs["divisor"]
    if config.loss_reduction == "mean" and config.expected_batch_size is not None:
        exact = multiplier == 1.0 / config.expected_batch_size and _is_one(divisor)
    elif config.loss_reduction == "mean":
        val = divisor.meta.get("val") if isinstance(divisor, fx.Node) else None
        exact = multiplier == 1.0 and isinstance(val, torch.SymInt) and \
            an.size(val) == an.batch
    else:
        exact = multiplier == 1.0 and _is_one(divisor)
    if not exact:
        refuse(f"{call.name} scales by {multiplier} / {divisor}, not by 1/D")
    noise = []
    _walk_clipped_side([bases[index - 1]], noise, refuse)
    if noise:
        refuse(f"its clipped sum accumulates into noise before {call.name} adds more")
    if span is None:
        return call, index, 0, float("inf")     # the whole sum
    length = item.meta["val"].shape[0] if item.meta["val"].dim() == 1 else None
    given = list(span.args[1:])
    dim, start, end, step = given + [0, None, None, 1][len(given):]
    if span.kwargs or not isinstance(length, int) or dim != 0 or step != 1 or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x for x in (start, end)):
        refuse(f"{span.name} is not a slice [start, end) of {item.name}, step 1, with constant "
               f"bounds")
    return call, index, min(start, length), min(end, length)


def _is_one(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x == 1


# Clipped-sum ops that add their values into their first argument: index_put(base, ...,
# accumulate=True) in its masked form. Their base may be the noise itself.
_ACCUMULATES_INTO_ARG0 = {aten._unsafe_masked_index_put_accumulate.default}


def through_release_moves(node: fx.Node) -> fx.Node:
    while isinstance(node, fx.Node) and node.target in _RELEASE_MOVES and \
            node.meta.get("dpfx") is None:
        node = node.args[0]
    return node
