"""The loss's recorded calls replayed on fake tensors with one batch symbol, as an ATen graph.

    gm, record_of, factors, taken = replay(calls, placeholders, loss_ref, batch)
    verdict = check.analyze(gm, placeholders, record_of, factors)      # the proof (check.py)

``loss/track.py`` records the torch calls that lead from dpfx's outputs to the loss. This module
runs them again under ``make_fx`` with Inductor's decompositions, on fake tensors whose dim 0 is
one batch symbol (the model's outputs, and every other tensor the loss used whose dim 0 has the
batch size: Note [Which inputs of the loss carry the batch]), so that check.py proves the loss
for every batch size at once. A Python number that scales a tensor is replayed as a scalar input
(``SCALING``) and an int that is a multiple of the batch size as k * B where that reading runs
(``SIZE_ARGS``; Note [Python numbers in the loss]); loss kernels that torch cannot trace with a
symbolic batch are replayed in forms it can (``REPLAYED_AS``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

import dpfx.ops  # noqa: F401  (dpfx::ctc_loss_per_example)
from dpfx.graph.batch import sym_expr

# A batch size that no other size of a loss computation is likely to equal: make_fx's symbolic
# shapes need a hint, and a Python number equal to it (the batch size written as a number) is
# then a shape error rather than a silent match.
BATCH_HINT = 7919


@dataclasses.dataclass(frozen=True)
class Placeholder:
    shape: tuple            # an output's dim 0 is None (the batch)
    dtype: torch.dtype
    device: torch.device
    is_output: bool
    is_scalar: bool = False     # a Python number the loss multiplies or divides by
    is_data: bool = False       # a batch tensor of dpfx's loader: the batch in dim 0

    @staticmethod
    def scalar(value) -> "Placeholder":
        dtype = torch.int64 if isinstance(value, int) else torch.float64
        return Placeholder((), dtype, torch.device("cpu"), False, True)


_T = torch.Tensor
# Calls whose Python-number operand (one of the first two arguments) scales a tensor: replayed
# as a scalar placeholder (Note [Python numbers in the loss]).
SCALING = {_T.__mul__, _T.__rmul__, _T.__truediv__, _T.__imul__, _T.__itruediv__, _T.mul,
           _T.div, _T.true_divide, _T.mul_, _T.div_, torch.mul, torch.div, torch.true_divide,
           torch.multiply, torch.divide, _T.multiply, _T.divide}
# Calls whose int arguments are sizes: an int that is a multiple k of the batch size may be
# the batch size written as a number (``x.view(y.shape)``, ``view(x.size(0), -1)``).
SIZE_ARGS = {_T.view, _T.reshape, _T.expand, _T.repeat, _T.unflatten, _T.new_zeros,
             _T.new_ones, _T.new_empty, _T.new_full, _T.narrow, _T.split, torch.reshape,
             torch.narrow, torch.split, torch.unflatten, _T.tile, torch.tile,
             torch.broadcast_to, _T.broadcast_to}


def replay(calls: list, placeholders: list[Placeholder], loss_ref: tuple, batch: int,
           not_batch: frozenset = frozenset()) -> tuple[fx.GraphModule, dict, list, set]:
    """make_fx of the recorded calls on fake inputs with one batch symbol. Returns the graph,
    node -> call index, for each placeholder the multiple of the batch its dim 0 holds (None:
    no batch), and the (call, leaf) size ints read as the batch size (Note [Python numbers in
    the loss]). Placeholders in ``not_batch`` are read as constants.

    Note [Which inputs of the loss carry the batch]
    The model's outputs carry it in dim 0. Another tensor the loss reads (labels, a mask) carries
    it when, in the first call that uses it, a tracked argument's dim 0 is ``k * B`` and the
    tensor's dim 0 is k times the step's batch size: ``F.cross_entropy(logits.view(-1, V),
    y.view(-1))`` pairs y's B*T rows with the logits' rows. Such a dim is taken as the batch
    flattened with each example's k rows together (``y.view(-1)`` of (B, T)). A first pass on
    fake tensors finds these sizes; the second is traced.

    Note [A unit's rows beside a tensor of one row per unit]
    Under ``per_user`` the model's outputs hold k rows per user (dim 0 of k * U) and the user's
    own mask holds one row per user, (U, k): ``per_example.view_as(mask)`` meets them in one
    call, and no dim of the outputs is the mask's U. Where a call's tracked argument holds such
    a merged dim (k * B, k > 1), a tensor whose dim 0 is the step's B carries the batch too,
    one row per unit. Like every reading here it is the user's call at this step's B, and the
    check proves the traced program per unit for every B; a constant that only collides with B
    is read as one where this reading cannot be replayed (loss/track.py's collisions)."""
    from torch._inductor.decomposition import select_decomp_table

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    symbol = env.create_symbol(BATCH_HINT, ConstantSource("dpfx_loss_batch"), DimDynamic.DYNAMIC)
    sym_batch = env.create_symintnode(symbol, hint=BATCH_HINT)
    factors: list = [1 if ph.is_output else None for ph in placeholders]
    record_of: dict[str, int] = {}
    with mode:
        fakes: dict[int, torch.Tensor] = {
            i: torch.empty((sym_batch, *ph.shape[1:]), dtype=ph.dtype, device=ph.device)
            for i, ph in enumerate(placeholders) if ph.is_output or (
                ph.is_data and ph.shape[0] == batch and i not in not_batch)}
        for i in fakes:
            factors[i] = 1

        def first_use(j: int, call_values: list) -> torch.Tensor:
            if j not in fakes:
                ph = placeholders[j]
                # the batch in dim 0 of a tracked argument, or in another of its dims (a
                # time-first (T, B, C) tensor beside (B,) lengths)
                sizes = [v.shape[d] for v in (() if j in not_batch else call_values)
                         if isinstance(v, torch.Tensor) and v.dim() and ph.shape
                         for d in range(v.dim())]
                merged = False
                for n in sizes:
                    size = sympy.sympify(sym_expr(n))
                    k = sympy.simplify(size / symbol)
                    merged |= symbol in size.free_symbols and k.is_Integer and int(k) > 1
                    if symbol in size.free_symbols and k.is_Integer and int(k) * batch == \
                            ph.shape[0]:
                        factors[j] = int(k)
                        fakes[j] = torch.empty((n, *ph.shape[1:]), dtype=ph.dtype,
                                               device=ph.device)
                        break
                else:
                    if merged and ph.shape and ph.shape[0] == batch:
                        # See Note [A unit's rows beside a tensor of one row per unit]
                        factors[j] = 1
                        fakes[j] = torch.empty((sym_batch, *ph.shape[1:]), dtype=ph.dtype,
                                               device=ph.device)
                    else:
                        fakes[j] = torch.empty(ph.shape, dtype=ph.dtype, device=ph.device)
            return fakes[j]

        def times_batch(k: int):
            return k * sym_batch

        sizes: dict[int, frozenset] = {}     # call -> positions of its ints read as k * B
        run_calls(calls, first_use, lambda i: None, times_batch, sizes, symbol)
        inputs = [fakes[i] for i in range(len(placeholders))]

        def on_record(index: int) -> None:
            for node in get_proxy_mode().tracer.graph.nodes:
                record_of.setdefault(node.name, index)

        def traced(*xs):
            return run_calls(calls, lambda j, _: xs[j], on_record, times_batch,
                             sizes)[loss_ref[0]][loss_ref[1]]

        gm = make_fx(traced, decomposition_table=select_decomp_table(),
                     tracing_mode="real")(*inputs)
    gm.graph.eliminate_dead_code()    # nll_loss's total_weight of a sum: computed, never used
    taken = {(i, pos) for i, positions in sizes.items() for pos in positions}
    return gm, {n: record_of.get(n.name) for n in gm.graph.nodes}, factors, taken


# Note [An index that counts the rows]
# ``-logp[torch.arange(len(y)), y].mean()`` (and ``logp[range(n), y]``) is the hand-written NLL
# of many tutorials: row i reads its own row's entry at its own label. The plain loop records
# the arange as a tensor built outside its tracking, and a tensor whose dim 0 is the batch's
# would be read as per-example data, its values unknown; indexing the batch dim with it would
# be refused (it could name any row). Its values are known at the step: the first index of a
# ``__getitem__`` (the one into dim 0: an arange into a feature dim, whose length may equal B,
# stays a constant), a 1-D integer tensor or a ``range`` holding exactly 0, 1, ..., k * B - 1,
# is replayed as ``arange(k * B)`` of the symbolic batch, whose values the batch analysis proves to be each row's own number (Note [An
# arange over the rows] in graph/batch.py), and the forward rule for indexing
# (passes/indexing.py) then checks the op as it checks one in the model. The values are read
# again at every step, and the verdict cache's key holds the reading, so a step whose index is
# anything else is checked afresh. (tests/loss/test_loss_check.py::
# test_an_index_that_counts_the_rows_is_each_examples_own)
def run_calls(calls: list, placeholder: Callable, on_record: Callable,
              batch_size: Callable = None, sizes: dict | None = None, symbol=None) -> list:
    """Execute recorded calls: ("in", j) is placeholder j; (func, spec, leaves) a call whose
    leaves are ("p", j) placeholders, ("r", call, leaf) earlier results, ("c", value),
    ("k", k, value) a size int that may be the batch size times k, and ("a", k, dtype, device)
    an index that counts the batch's k * B rows (Note [An index that counts the rows]).

    Note [Python numbers in the loss]
    A size int that is a multiple k of the step's batch size (``view(y.shape)``,
    ``view(x.size(0), -1)``, ``view(b * t, V)``) may be the batch size written as a number, or a
    constant that happens to equal it (B = T). The first, fake pass decides each call on its
    own (``sizes``, keyed by call; with ``symbol`` given): the ints as written, then each one
    alone as ``k * B``; the first reading that runs and, where the call's first tensor carries
    the batch in dim 0, keeps it in dim 0 of the result, is taken, and the traced pass repeats
    it. Any reading is sound: at this step's B every reading is the call the user made, and the
    check proves the traced program per-example for every value of the symbol. The reading
    only decides whether a per-example loss is recognized as one."""
    values: list = []
    for i, call in enumerate(calls):
        if call[0] == "in":
            values.append([placeholder(call[1], [])])
            continue
        func, spec, descr = call
        results = [values[d[1]][d[2]] for d in descr if d[0] == "r"]

        def leaf(j: int, d: tuple, taken: frozenset):
            if d[0] == "p":
                return placeholder(d[1], results)
            if d[0] == "r":
                return values[d[1]][d[2]]
            if d[0] == "k":
                return batch_size(d[1]) if j in taken else d[2]
            if d[0] == "a":     # Note [An index that counts the rows]
                return torch.arange(batch_size(d[1]), dtype=d[2], device=d[3])
            return d[1]

        def run(taken: frozenset):
            leaves = [leaf(j, d, taken) for j, d in enumerate(descr)]
            a, kw = unflatten(leaves, spec)
            return leaves, pytree.tree_leaves(REPLAYED_AS.get(func, func)(*a, **kw))

        try:
            if i not in sizes if sizes is not None else False:
                sizes[i] = _read_sizes(descr, run, symbol)
            _, out = run(sizes.get(i, frozenset()) if sizes is not None else frozenset())
        except Exception as e:
            if not hasattr(e, "dpfx_call"):
                e.dpfx_call = i         # where the replay failed, for the refusal's line
            raise
        values.append(out)
        on_record(i)
    return values


def _read_sizes(descr: tuple, run: Callable, symbol) -> frozenset:
    """The reading of a call's size ints (Note [Python numbers in the loss])."""
    positions = [j for j, d in enumerate(descr) if d[0] == "k"]
    if not positions:
        return frozenset()
    error = None
    for taken in [frozenset()] + [frozenset({j}) for j in positions]:
        try:
            leaves, out = run(taken)
        except Exception as e:      # a shape error: not this reading
            error = e
            continue
        first = next((v for v in leaves if isinstance(v, torch.Tensor) and v.dim()), None)
        result = next((v for v in out if isinstance(v, torch.Tensor)), None)
        if first is not None and result is not None and symbol in free_symbols(first.shape[0]) and (
                not result.dim() or symbol not in free_symbols(result.shape[0])):
            continue
        return taken
    raise error if error is not None else ValueError("no reading of the sizes keeps the batch")


def free_symbols(size) -> set:
    return sympy.sympify(sym_expr(size)).free_symbols



# Note [Losses replayed through a per-example op]
# Some loss kernels have no form torch can trace with a symbolic batch: CTC's output sizes
# depend on the targets' values. Such a loss is replayed through ``dpfx::ctc_loss_per_example``,
# an op whose fake kernel states its result, one loss per example, and whose layout the batch
# analysis reads off its shape: row i of the result comes from column i of the (T, B, C)
# log-probabilities and row i of the (B, S) targets and of the lengths, which is what CTC
# computes (each example's alignment is its own). The reduction is then written out in ATen
# ("mean": each loss over its target length, then the batch mean), where the check sees it.
# Only padded (B, S) targets: concatenated 1-D targets locate example i's labels by the other
# examples' lengths, a layout dpfx cannot prove, and are refused.
# (tests/loss/test_loss_corpus.py, the "ctc" idiom)
def _ctc_replayed(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean",
                  zero_infinity=False):
    if targets.dim() != 2 or not isinstance(input_lengths, torch.Tensor) or not isinstance(
            target_lengths, torch.Tensor):
        raise ValueError("CTC with concatenated targets or list lengths: pass padded (B, S) "
                         "targets and tensor lengths")
    losses = torch.ops.dpfx.ctc_loss_per_example(log_probs, targets, input_lengths,
                                                 target_lengths, blank, zero_infinity)
    if reduction == "mean":
        return (losses / target_lengths.clamp(min=1).to(losses.dtype)).mean()
    return losses.sum() if reduction == "sum" else losses


def _pad_replayed(input: torch.Tensor, pad, mode: str = "constant", value=None):
    """``F.pad`` with a constant, written as narrow and cat: ATen's constant_pad_nd reads its
    input's sizes as ints on fake tensors, which would fix the batch symbol to its hint (HF's
    causal LM loss pads the labels so). The same values as F.pad, and the labels' rows stay
    visibly each example's own."""
    if mode != "constant":
        return F.pad(input, pad, mode=mode, value=value)
    value = 0 if value is None else value
    out = input
    for k in range(len(pad) // 2):
        d = input.dim() - 1 - k
        left, right = pad[2 * k], pad[2 * k + 1]
        if left < 0:
            out = out.narrow(d, -left, out.shape[d] + left)
        if right < 0:
            out = out.narrow(d, 0, out.shape[d] + right)
        parts = [out]
        for side, n in ((0, left), (1, right)):
            if n > 0:
                shape = list(out.shape)
                shape[d] = n
                filler = out.new_full(shape, value)
                parts.insert(0, filler) if side == 0 else parts.append(filler)
        if len(parts) > 1:
            out = torch.cat(parts, d)
    return out.clone() if out is input else out


def _constant_pad_nd_replayed(input: torch.Tensor, pad, value=0):
    return _pad_replayed(input, pad, "constant", value)


# Note [A loss's own validation is not replayed]
# ``F.gaussian_nll_loss`` (``nn.GaussianNLLLoss``) refuses a variance with a negative entry by a
# Python ``if`` on ``torch.any(var < 0)``: on fake tensors with a symbolic batch, a branch on a
# value of the whole batch, which the replay refuses as data-dependent. The branch only raises,
# and the user's own call has already run on the step's real tensors without raising (the
# replay follows the call), so the loss's value is the rest of its code: it is replayed as that
# code, torch's line for line but for the check (the variance clamped at ``eps`` under
# ``no_grad``, so that gradients pass through the clamp as in torch). A variance that is a
# statistic of the batch is still refused, at the op that computes it.
# (tests/loss/test_loss_corpus.py, the "gaussian_nll" idioms and the coupled
# "gaussian_nll_batch_variance")
def _gaussian_nll_replayed(input, target, var, full=False, eps=1e-6, reduction="mean"):
    if isinstance(var, float):
        var = var * torch.ones_like(input)
    if var.size() != input.size():
        if input.size()[:-1] == var.size():
            var = torch.unsqueeze(var, -1)
        elif not (input.ndim == var.ndim and sum(
                y for x, y in zip(input.size(), var.size()) if x != y) == 1):
            raise ValueError("var is of incorrect size")
    var = var.clone()
    with torch.no_grad():
        var.clamp_(min=eps)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    if reduction == "mean":
        return loss.mean()
    return loss.sum() if reduction == "sum" else loss


REPLAYED_AS = {F.ctc_loss: _ctc_replayed, F.pad: _pad_replayed,
               torch.constant_pad_nd: _constant_pad_nd_replayed,
               F.gaussian_nll_loss: _gaussian_nll_replayed}


def flatten(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """pytree's flatten, with a cheaper form for the common call without containers."""
    for a in args:
        if isinstance(a, _CONTAINERS):
            return pytree.tree_flatten((args, kwargs))
    for a in kwargs.values():
        if isinstance(a, _CONTAINERS):
            return pytree.tree_flatten((args, kwargs))
    return [*args, *kwargs.values()], ("flat", len(args), tuple(kwargs))


_CONTAINERS = (list, tuple, dict)


def unflatten(leaves: list, spec) -> tuple[tuple, dict]:
    if isinstance(spec, tuple):
        n = spec[1]
        return tuple(leaves[:n]), dict(zip(spec[2], leaves[n:]))
    return pytree.tree_unflatten(leaves, spec)


def is_number(v) -> bool:
    """A Python number a loss may scale by (a bool is not one)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)
