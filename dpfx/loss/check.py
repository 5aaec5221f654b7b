"""The loss check: is the loss a scalar times a sum over examples of per-example terms?

    out = dp_model(x)                      # tracked (loss/track.py) in training mode
    loss = F.cross_entropy(out, y)         # recorded: one call
    loss.backward()                        # replayed here with a symbolic batch, then released

``loss/track.py`` records the torch calls that lead from dpfx's outputs to the loss. This module
replays them under ``make_fx`` with Inductor's decompositions, on fake tensors whose dim 0 is one
batch symbol (the model's outputs, and every other tensor the loss used whose dim 0 has the batch
size), and proves on the ATen graph:

1. No op mixes examples: the forward check's rules (``verify.mixing_ops``: a reduction over the
   batch, an op whose ``dim`` names the batch, a layout that cannot be proven) plus indexing
   along the batch dim (``out[perm]``), anywhere, also on the labels' side (a batch statistic of
   the labels that reaches a per-example term couples examples just the same).
2. The terminal rule: from the loss down, only linear ops (add, sub, neg, views, sums and means
   over any dims, products with values that do not depend on the outputs) until a ``sum``/``mean``
   whose input carries the batch. So ``loss = sum_k c_k * sum_i t_k(out_i)``.
3. Each term's scale ``c_k`` is ``s_k * v_k * B^p * prod_j N_j^q_j``: ``s_k`` from the sizes of
   means over an example's own positions (a mean over (B, K) divides by K), ``v_k`` the Python
   numbers the term is multiplied or divided by (replayed as scalar inputs: Note [Python numbers
   in the loss]), a power of the batch size (a mean over it, ``len(out)`` inside torch's
   ``kl_div``), and *normalizers* N_j, scalars computed from the labels or other inputs (the
   count of non-ignored tokens of a token mean, ``mask.sum()``, HF's ``num_items_in_batch``).
   The exceptions to rule 1 are the reductions that only feed the normalizers.

Note [The per-example term]
dpfx clips each example's gradient of its own term ``l_i = sum_k (v_k / v) * s_k * t_k(z_i)``,
``v = max_k |v_k|``: every scalar applied after the batch reduction is removed, whatever it is,
since dpfx cannot tell ``0.5`` from ``1 / len(y)`` and a factor that depends on the batch couples
examples even when the terms do not (a token mean divides every example's gradient by the whole
batch's token count N: one added example changes N, and with N inside each example's term the
release moves by more than C; a ``sum / len(y)`` clips each gradient at C * B). So the batch
size written any way (a mean, ``size(0)``, ``len(y)``, a Python int, ``reduction="batchmean"``),
a token count and a constant factor on the whole loss all give the same release; a mean over an
example's own positions stays a mean (Opacus's "mean" semantics). Terms may be weighted against
each other by Python numbers (``ce + 0.3 * mse``, a KL weight annealed by a schedule): those
ratios are the objective's, taken as given like any constant inside an example's term. Not
proven: that such a number does not depend on the batch (``ce.sum() / len(y) + aux.sum()``
weighs the terms by B); a ratio that changes between steps by powers of the batch size's change
is refused, which catches that only once the batch size has changed. Write the batch size as a
common factor of the whole loss, or with tensor ops (``.mean()``), where it is removed exactly.
dpfx evaluates the removed part on the step's real inputs and multiplies the backward's
starting gradient by its inverse (times 1/B for
loss_reduction="mean", whose graph undoes a 1/B); terms whose batch-dependent parts differ (a
token mean plus a mean over examples) each lose their own (Note [Terms on their own scales]).
The loss value the user sees is untouched, and a changed scale is warned about once
(``LossScaleWarning``).
(tests/loss/test_loss_corpus.py::test_one_added_example_moves_the_release_by_at_most_C_over_D)
"""
from __future__ import annotations

import dataclasses
import math
import operator
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
from dpfx.graph.batch import BatchAnalysis, BatchDim, product, sym_expr
from dpfx.passes.verify import mixing_ops

aten = torch.ops.aten
prims = torch.ops.prims

# A batch size that no other size of a loss computation is likely to equal: make_fx's symbolic
# shapes need a hint, and a Python number equal to it (the batch size written as a number) is
# then a shape error rather than a silent match.
_BATCH_HINT = 7919

_SUMS = {aten.sum.default, aten.sum.dim_IntList}
_MEANS = {aten.mean.default, aten.mean.dim}
_PASS_THROUGH = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                 aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
                 aten.unsqueeze.default, aten.clone.default, aten.alias.default,
                 aten.permute.default, aten.expand.default, prims.convert_element_type.default,
                 aten._to_copy.default, aten.detach.default, aten.neg.default,
                 aten.select.int, aten.slice.Tensor, aten.t.default, aten.transpose.int}
_PRODUCTS = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
_IN_PLACE_PRODUCTS = {aten.mul_.Tensor: aten.mul.Tensor, aten.mul_.Scalar: aten.mul.Scalar,
                      aten.div_.Tensor: aten.div.Tensor, aten.div_.Scalar: aten.div.Scalar}
_SUMS_OF_TWO = {aten.add.Tensor, aten.sub.Tensor}
# Ops that pick rows by data: along the batch dim they give example i another example's row.
_INDEXING = {aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_put.default,
             aten.index_put_.default, aten._unsafe_index_put.default}


class LossRefused(Exception):
    """A reason the loss is not a per-example sum, at the recorded call that caused it."""

    def __init__(self, record: int | None, op: str, reason: str, at_replay: bool = False):
        super().__init__(reason)
        self.record, self.op, self.reason = record, op, reason
        self.at_replay = at_replay      # the replay itself failed (not the check)


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
    symbol = env.create_symbol(_BATCH_HINT, ConstantSource("dpfx_loss_batch"), DimDynamic.DYNAMIC)
    sym_batch = env.create_symintnode(symbol, hint=_BATCH_HINT)
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
        if first is not None and result is not None and symbol in _free(first.shape[0]) and (
                not result.dim() or symbol not in _free(result.shape[0])):
            continue
        return taken
    raise error if error is not None else ValueError("no reading of the sizes keeps the batch")


def _free(size) -> set:
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


# Note [A stack of batch sums]
# A loss written per position, ``torch.stack([F.cross_entropy(o[:, t], y[:, t], reduction="sum")
# for t in range(T)]).sum() / B``, stacks scalars that are each a sum over the batch: ATen
# writes the stack as ``cat`` of unsqueezed scalars. A cat is linear (each entry of its result
# is one entry of one input), so above the batch reductions it is walked like an add: each
# input becomes its own term with the scale of the whole cat, and what follows the cat must
# itself pass the terminal rule (sums, means, selections, constant weights). So the loss stays
# ``sum_k c_k sum_i t_k(z_i)`` with public c_k; a max, a product, a softmax or a logsumexp over
# the stacked vector is refused at that op, an index tensor at ``index``, and a selection whose
# position is a number read from the data (``s[int(y[0, 0])]`` in the captured loss, an
# unbacked symbol) is refused at the selection: it would make each example's term depend on
# another example's values. An input of the cat that still carries the batch is refused as a
# value that reaches the loss without a sum over the batch. A batch reduction reached along
# several paths (``s.sum() + s[0]``; a selection walks every input of the cat) is one term per
# path in the verdict, all with the same batch-dependent part, so the same factor: where each
# term is scaled on its own, its node is scaled once (``scaled_terms``, as loss_graph's dict of
# scaled copies does), and the paths' linear part above it adds the rest.
# (tests/loss/test_loss_check.py::test_stacked_batch_sums_match_reference,
# tests/loss/test_loss_check.py::test_stacks_that_mix_examples_are_refused)
def analyze(gm: fx.GraphModule, placeholders: list[Placeholder], record_of: dict,
            factors: list) -> Verdict:
    phs = list(gm.graph.find_nodes(op="placeholder"))
    outputs = {ph for ph, p in zip(phs, placeholders) if p.is_output}
    symbols = {next(iter(outputs)).meta["val"].shape[0].node.expr}
    loss = gm.graph.find_nodes(op="output")[0].args[0]
    an = BatchAnalysis(gm.graph, symbols, {ph.name: BatchDim(0, inner=sympy.Integer(k))
                                           for ph, k in zip(phs, factors) if k is not None})
    batch = an.batch
    on_outputs = _descendants(gm.graph, outputs)

    def refuse(node, reason):
        raise LossRefused(record_of.get(node), _op_name(node), reason)

    val = loss.meta.get("val") if isinstance(loss, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.numel() != 1:
        raise LossRefused(None, "backward", "the loss is not a single number: call backward on "
                          "the mean or the sum over dim 0 of per-example losses")

    terms: list[tuple] = []        # (scale sympy expr, ((normalizer node, power), ...))
    linear: set[fx.Node] = set()

    def walk(node: fx.Node, scale, norms: tuple) -> None:
        if node not in on_outputs:
            return                  # an added constant: no gradient reaches the outputs
        linear.add(node)
        t = node.target
        if t in _IN_PLACE_PRODUCTS:
            # ``loss *= k`` (HF Trainer scales its loss so): the product of its operand, sound
            # only while nothing else aliases the operand (a view taken before would see the
            # scaled value in the backward but the unscaled one here)
            if len(node.args[0].users) != 1:
                refuse(node, "scales in place a value that another op also reads; write the "
                             "product out of place (`loss = loss * k`)")
            t = _IN_PLACE_PRODUCTS[t]
        if an.is_batched(node):
            refuse(node, "reaches the loss without a sum or mean over the batch")
        if t in _SUMS or t in _MEANS:
            src = node.args[0]
            if t in _MEANS:
                scale = scale * product(an.shape(node.meta["val"])) / product(an.shape(src.meta["val"]))
            if an.is_batched(src):
                terms.append((scale, norms, node))
                return
            return walk(src, scale, norms)
        if t in _PASS_THROUGH:
            if any(_is_size(a) and not _free(a.meta["val"]) <= {batch}
                   for a in pytree.tree_leaves(node.args[1:])):
                # Note [A stack of batch sums]: which entries a selection keeps is public
                refuse(node, "selects entries by a number read from the data (example i's "
                             "term would depend on another example's values)")
            sign = -1 if t is aten.neg.default else 1
            return walk(node.args[0], scale * sign, norms)
        if t in _SUMS_OF_TWO:
            alpha = node.kwargs.get("alpha", 1)
            walk(node.args[0], scale, norms)
            if isinstance(node.args[1], fx.Node):
                walk(node.args[1], scale * (-alpha if t is aten.sub.Tensor else alpha), norms)
            return
        if t in _PRODUCTS:
            a, b = node.args[:2]
            divide = t in (aten.div.Tensor, aten.div.Scalar)
            if not divide and _is_size(a):
                a, b = b, a
            if _is_size(b):
                # a size of the batch's tensors (``reduced / input.size(0)`` inside torch's
                # kl_div "batchmean"): a power of the batch size, removed like a mean's
                size = sympy.sympify(sym_expr(b.meta["val"]))
                if not size.free_symbols <= {batch}:
                    refuse(node, f"scales the loss by {size}, which depends on the data")
                return walk(a, scale / size if divide else scale * size, norms)
            if isinstance(b, fx.Node) and b in on_outputs:
                if divide or (isinstance(a, fx.Node) and a in on_outputs):
                    refuse(node, "multiplies or divides two values computed from the model's "
                                 "outputs over the batch (the loss is not a sum of per-example "
                                 "terms)")
                a, b = b, a
            if node.kwargs.get("rounding_mode") is not None:
                refuse(node, "rounds a value computed from the model's outputs")
            if not isinstance(b, fx.Node):
                factor = sympy.nsimplify(b) if isinstance(b, (int, float)) else None
                if factor is None:
                    refuse(node, f"scales the loss by {b!r}")
                return walk(a, scale / factor if divide else scale * factor, norms)
            if _depends_on_inputs(b):
                if b.meta["val"].numel() != 1:
                    if any(an.is_batched(x) for x in ancestors(b)):
                        refuse(node, "weights the batch's sum with values computed over the "
                                     "whole batch")
                    return walk(a, scale, norms)        # a constant weight tensor
                return walk(a, scale, norms + ((b, -1 if divide else 1),))
            return walk(a, scale, norms)                # a tensor constant: a weight
        if t is aten.cat.default:
            # See Note [A stack of batch sums]
            for part in node.args[0]:
                walk(part, scale, norms)
            return
        refuse(node, "is not a sum or mean over the batch of per-example terms (only sums, means, "
                     "constant weights and normalizers may combine examples)")

    try:
        walk(loss, sympy.Integer(1), ())
        for node in linear:
            if any(u not in linear and u.op != "output" for u in node.users):
                refuse(node, "combines the batch's examples into a value that the loss then "
                             "uses per example (e.g. centering or scaling by a batch statistic)")
        structure = None
    except LossRefused as e:
        structure = e
    # A mixing op is the more useful report: it is where the examples meet.
    exempt = _only_feeding(gm.graph, linear, on_outputs) | {
        n for n in gm.graph.find_nodes(op="call_function", target=aten.slice.Tensor)
        if _whole_slice(n)}
    for node, reason in mixing_ops(gm, an, skip=set()):
        # a sum over the batch that the loss then uses non-linearly: the structure says why
        if node not in exempt and not (structure and node.target in _SUMS | _MEANS):
            refuse(node, reason)
    for node in _rows_by_index(gm, an):
        if node not in exempt:
            refuse(node, _BY_INDEX)
    if structure is not None:
        raise structure
    scalars = {ph for ph, p in zip(phs, placeholders) if p.is_scalar}
    return _verdict(gm, terms, batch, scalars, outputs, record_of)


def analyze_rows(gm: fx.GraphModule, placeholders: list[Placeholder], record_of: dict,
                 factors: list) -> None:
    """A model input computed from the batch's tensors (Note [The batch's own tensors are
    followed too] in loss/track.py) must keep examples apart: no op mixes them, and the result
    carries the batch in dim 0, example i's row computed from example i's rows only."""
    phs = list(gm.graph.find_nodes(op="placeholder"))
    batched = {ph for ph, k in zip(phs, factors) if k is not None}
    if not batched:
        return
    symbols = {next(iter(batched)).meta["val"].shape[0].node.expr}
    an = BatchAnalysis(gm.graph, symbols, {ph.name: BatchDim(0, inner=sympy.Integer(k))
                                           for ph, k in zip(phs, factors) if k is not None})
    for node, reason in mixing_ops(gm, an, skip=set()):
        raise LossRefused(record_of.get(node), _op_name(node), reason)
    for node in _rows_by_index(gm, an):
        raise LossRefused(record_of.get(node), _op_name(node), _BY_INDEX)
    result = gm.graph.find_nodes(op="output")[0].args[0]
    lay = an.layout(result) if isinstance(result, fx.Node) else None
    if not (isinstance(lay, BatchDim) and lay.dim == 0 and lay.is_plain):
        raise LossRefused(None, "input", "does not carry the batch's examples in dim 0, one row "
                                         "each")


_BY_INDEX = "picks rows along the batch dim by index (example i would use another example's row)"


def _rows_by_index(gm: fx.GraphModule, an: BatchAnalysis) -> list[fx.Node]:
    """Indexing ops whose index names the batch dim of a tensor with a proven layout, by
    anything but each row's own number (an arange over the rows: ``logp[arange(B), y]``, whose
    other indices the forward rule of passes/indexing.py, run by ``mixing_ops``, checks)."""
    found = []
    for node in gm.graph.nodes:
        if node.target in _INDEXING:
            src = an.layout(node.args[0]) if isinstance(node.args[0], fx.Node) else None
            idx = node.args[1]
            if isinstance(src, BatchDim) and src.dim < len(idx) and idx[src.dim] is not None:
                own = an.layout(idx[src.dim]) if isinstance(idx[src.dim], fx.Node) else None
                if not (isinstance(own, BatchDim) and own.index_of is not None):
                    found.append(node)
    return found


def _verdict(gm, terms, batch, scalars: set, outputs: set, record_of: dict) -> Verdict:
    norm_nodes: list[fx.Node] = []
    out_terms, declared = [], set()
    for scale, norms, node in terms:
        scale = sympy.powsimp(sympy.nsimplify(scale))
        weight, power = scale.as_coeff_exponent(batch)
        if batch in sympy.sympify(weight).free_symbols or not power.is_integer:
            raise LossRefused(None, "scale", f"the loss's scale {scale} depends on the batch size "
                                             f"in a way dpfx cannot undo")
        refs = []
        for n, q in norms:
            if n not in norm_nodes:
                norm_nodes.append(n)
            refs.append((norm_nodes.index(n), q))
        declared.add("mean" if power < 0 or any(q < 0 for _, q in refs) else "sum")
        out_terms.append(Term(int(power), tuple(refs)))
    evaluate = _extract(gm, norm_nodes) if norm_nodes else None
    # a normalizer may read an output's size (a class-weight mean's expand to (B, K)), never
    # its values: the outputs are handed in as expanded stand-ins of their shape
    phs = list(gm.graph.find_nodes(op="placeholder"))
    sized = {}
    if norm_nodes:
        needed = set().union(*(ancestors(n) for n in norm_nodes))
        sized = {i: tuple(ph.meta["val"].shape[1:]) for i, ph in enumerate(phs)
                 if ph in needed and ph in outputs}
    return Verdict(out_terms, evaluate, declared.pop() if len(declared) == 1 else "mixed",
                   frozenset(i for i, n in enumerate(norm_nodes) if n in scalars), sized=sized,
                   replayed=gm, term_nodes=[node.name for _, _, node in terms],
                   normalizer_calls=tuple(record_of.get(n) for n in norm_nodes),
                   term_calls=tuple(record_of.get(node) for _, _, node in terms))


def _extract(gm: fx.GraphModule, nodes: list[fx.Node]) -> Callable:
    """A graph computing the normalizers from the real inputs (they never read the outputs)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    needed = set().union(*(ancestors(n) | {n} for n in nodes))
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node in needed:
            env[node] = graph.node_copy(node, lambda a: env[a])
    # a normalizer's own last cast (an int count to float) is left out: eval_scale reads each
    # value as a Python float anyway, and every op here is paid on every step
    outs = [env[n] for n in nodes]
    outs = [o.args[0] if o.target in (prims.convert_element_type.default,
                                      aten._to_copy.default) and len(o.users) == 0 else o
            for o in outs]
    graph.output(tuple(outs))
    graph.eliminate_dead_code()
    for node in graph.find_nodes(op="call_function", target=prims.convert_element_type.default):
        # the same cast through aten: prims' Python wrapper costs ~15 us a call
        node.target, node.args = aten._to_copy.default, (node.args[0],)
        node.kwargs = {"dtype": node.meta["val"].dtype}
    # its forward, called directly: Module.__call__'s hooks machinery costs more than the ops
    return fx.GraphModule(gm, graph).forward


def _whole_slice(node: fx.Node) -> bool:
    """``x[:, 0]`` slices every dim before the one it selects: start 0, step 1, no end."""
    start, end, step = (list(node.args[2:]) + [None, None, None])[:3]
    return start in (None, 0) and step in (None, 1) and (end is None or (
        isinstance(end, int) and end >= 2**62))


def _is_size(node) -> bool:
    """A node whose value is a Python number computed from sizes (a SymInt of the batch)."""
    return isinstance(node, fx.Node) and isinstance(
        node.meta.get("val"), (torch.SymInt, torch.SymFloat, int, float))


def _descendants(graph: fx.Graph, roots: set) -> set:
    """Nodes computed from ``roots``' values; a size (``sym_size`` of an output, and numbers
    computed from sizes) carries no value of theirs, so it does not pass the relation on."""
    found = set(roots)
    for node in graph.nodes:
        if any(a in found for a in node.all_input_nodes) and not _is_size(node):
            found.add(node)
    return found


def is_number(v) -> bool:
    """A Python number a loss may scale by (a bool is not one)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def ancestors(node: fx.Node) -> set:
    """Every node ``node`` reads, directly or through others."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _depends_on_inputs(node: fx.Node) -> bool:
    return any(a.op == "placeholder" for a in ancestors(node) | {node})


def _only_feeding(graph: fx.Graph, linear: set, on_outputs: set) -> set:
    """The linear part, plus every node not computed from the outputs whose every use is in the
    set (the normalizers' own computation: a count over the batch's labels). A reduction that
    also feeds a per-example term is not exempt."""
    exempt = set(linear)
    for node in reversed(graph.nodes):
        if node.op in ("placeholder", "output") or node in exempt or node in on_outputs:
            continue
        if node.users and all(u in exempt for u in node.users):
            exempt.add(node)
    return exempt


def _op_name(node: fx.Node) -> str:
    target = node.target
    if target is operator.getitem:
        return "getitem"
    return str(getattr(target, "__name__", target)).replace(".default", "")


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
    return factor, abs(factor - 1.0) > 1e-6


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
