"""The ``dpfx::block_*`` ops: a block of the model (a decoder layer) called as one op, so that
its private graph is compiled once and shared by every identical block.

A block's private graph (``dpfx/blocks.py`` builds it) is split at the clip coefficient:

    block_fwd(key, args)   -> [outputs..., saved]          the block's forward
    block_bwd(key, [saved, *reads]) -> [input grads..., norms, held]
                              norms: f32[R, B], row rows[j] the squared per-sample norm of
                              the block's parameters in parameter j's clipping group (what the
                              graph holds, before any scaling; passes/block.py)
    block_grad(key, [norms, held, *ops]) -> [grad_0, ..., grad_P-1]   the plain sums
    block_clip(key, coefs, keeps, [held, *ops]) -> [clipped_0, ..., clipped_P-1]
                              sum_i where(keep_j[i], coefs_j[i] * g_i[j], 0) for each j

``saved`` and ``held`` are handles (Note [A block's own tensors stay out of the model's graph]):
``saved`` stands for the activations the block's forward saved, ``held`` for the part B
operands that part A made; ``reads`` are the rest of what part A reads (the call's arguments and
parameters, the output gradients) and ``ops`` the rest of part B's operands (those of them), in
the orders ``graph_reads`` and ``graph_operands`` give.

``args`` of ``block_fwd`` are the block's tensor call arguments, then its parameters in the
order the block's ``Kernels`` name them. The op's autograd formula calls ``block_bwd`` and
``block_grad``: a model whose blocks are these ops trains non-privately with the same gradients
as the model itself. dpfx's per-sample rewrite (``rules/block.py``) replaces each
``block_grad`` by the norms of ``block_bwd`` and one ``block_clip``, so the block's parameters
are clipped by the clip factor of the whole model's graph, like any other parameter.

Every op is functional (its outputs are new tensors), so Inductor calls it as an extern kernel
and the graph around it keeps its order. The kernels live in the process's ``KERNELS`` table,
filled when a block is compiled; a key that is not there is an error naming the block (a graph
loaded without its blocks).

# Note [A block's own tensors stay out of the model's graph]
What a block's forward saves for its backward (a dozen activations of a decoder layer), and the
book-keeping operands its part A makes for part B, are read by the block's own ops alone. As
outputs of the ops, every one would be a tensor the model's capture traces through dynamo, the
joint trace and Inductor's lowering at each block call (each with symbolic shapes, whose
arithmetic is most of the cost): several times the joint trace's time, and more backward nodes
(BENCHMARKS.md, "Levers in the code").
So the op keeps them in ``_HELD`` and returns a handle in their place: a one-element int64
tensor of zeros (equal in every run, so the self-check's comparisons and its independence test
pass over it), keyed by its storage. The entry lives exactly as long as the handle: a finalizer
on the handle drops it, so the activations are freed when autograd frees the saved handle, as
it freed the tensors themselves. Only tensors the op made are held: the call's arguments and
the output gradients are graph tensors whose buffers Inductor may reuse once the graph no longer
reads them, so they stay operands of the graph. A handle that is not the op's own (a copy) finds
no entry and fails loudly. The table is the ops' Python state: a replayed CUDA graph would not
run it, so a block op cannot be captured in one as it stands. (tests/test_blocks.py::
test_a_handle_holds_its_tensors_while_it_lives; test_model_of_blocks_against_the_loop checks
that no handle outlives a step)

# Note [A block whose parameters live elsewhere]
A block that is an FSDP2 unit (loop/fsdp.py) holds its parameters' values only while one of its
ops runs, and its clipped sums leave the model's graph as soon as they are formed. Its ops are
called with the key ``"<key>#<block name>"``, whose ``PLACES`` entry is the block's ``Place``:

- ``block_fwd`` and ``block_bwd`` (and ``block_clip`` if its operands include a parameter) run
  inside ``place.resident()``, which gathers the block's parameters for the call if they are not
  there and frees them after;
- ``block_clip`` hands the block's clipped sums to ``place.clipped(sums)`` and returns zeros
  with stride 0 (no storage) in their place: the model's graph is built and proven over the
  same ops, and the sums reach the optimizer by the place (a reduce-scatter to the ranks that
  own each coordinate). Only a backward that dpfx runs for the user's step (``live()``, set by
  the backend's runner) hands them over; the self-check's runs compute them and drop them.

The kernels are the block's, whatever the suffix: the compiled block is shared, only where its
parameters and sums live differs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Callable, Protocol

import torch


@dataclasses.dataclass
class Kernels:
    """What the ops of one block key run: the block's kernels, which take and return lists of
    tensors (every saved activation and operand among them: the ops hold those, Note [A block's
    own tensors stay out of the model's graph]); the ``fake`` ones run the block's FX graphs
    (the block's self-check compares them with the kernels)."""
    name: str                       # the block's class, for errors
    params: list[str]               # parameter names within the block, in ``args`` order
    num_inputs: int                 # tensor call arguments before the parameters
    num_outputs: int                # user outputs before the saved tensors of block_fwd
    # positions (among block_fwd's args) of the call arguments the backward returns a
    # gradient for; None for the others
    grad_inputs: list[int]
    forward: Callable[[list], list]
    backward: Callable[[list], list]
    grad: Callable[[list], list]
    clip: Callable[[list, list, list], list]
    # which of ``forward``'s args and outputs ``backward`` (part A) reads, in its order:
    # ("arg", i) | ("saved", k) (an output of ``forward`` after the user outputs) | ("grad", k)
    backward_reads: list[tuple[str, int]]
    fake_forward: Callable[[list], list] | None = None
    fake_backward: Callable[[list], list] | None = None
    fake_grad: Callable[[list], list] | None = None
    fake_clip: Callable[[list, list, list], list] | None = None
    # part B's operands: ("out", k) output k of ``backward``, ("in", i) its input i
    operands: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    norms: int = 0                  # the position of norms among ``backward``'s outputs
    rows: list[int] = dataclasses.field(default_factory=list)  # parameter j's row of norms
    # the batch layouts (graph/batch.py) of ``forward``'s and ``backward``'s outputs
    forward_layouts: list | None = None
    backward_layouts: list | None = None
    operands_read_params: bool = False      # an operand is a parameter or constant of the block
    # the ops' outputs as empty tensors, from the block's graphs' output metadata (what the ops'
    # fake implementations return): ``shapes_forward(args)``, ``shapes_backward(reads, device)``
    # (the graph's reads, ``graph_reads``), ``shapes_grad(device)``, ``shapes_clip(device)``
    shapes_forward: Callable[[list], list] | None = None
    shapes_backward: Callable[[list, torch.device], list] | None = None
    shapes_grad: Callable[[torch.device], list] | None = None
    shapes_clip: Callable[[torch.device], list] | None = None


KERNELS: dict[str, Kernels] = {}


class Place(Protocol):
    """Where one block's parameters and clipped sums live (Note [A block whose parameters live
    elsewhere])."""
    def resident(self) -> contextlib.AbstractContextManager: ...
    def stand_in(self) -> contextlib.AbstractContextManager: ...
    def clipped(self, sums: list[torch.Tensor]) -> None: ...


# key -> its block's place; the sharding that made the place holds it
PLACES: weakref.WeakValueDictionary[str, Place] = weakref.WeakValueDictionary()
_LIVE = [0]


class _Live:
    """``live()``: a plain class, since every graph run of every step enters it."""

    __slots__ = ()

    def __enter__(self):
        _LIVE[0] += 1

    def __exit__(self, *exc):
        _LIVE[0] -= 1
        return False


_LIVE_CONTEXT = _Live()


def live() -> _Live:
    """The ops run for the user's step: a block's clipped sums go to its place."""
    return _LIVE_CONTEXT


@contextlib.contextmanager
def stand_ins():
    """Every place's parameters hold values made on this rank alone, for the self-check, which
    reads every input of the model's graph and runs on one rank's schedule (a collective there
    could meet another rank's step): any values check the compiled code against its graph."""
    with contextlib.ExitStack() as stack:
        for place in list(PLACES.values()):
            stack.enter_context(place.stand_in())
        yield


def _place(key: str) -> Place | None:
    place = PLACES.get(key)
    if place is None and "#" in key:
        raise RuntimeError(f"dpfx: block {key!r} has no place for its parameters in this "
                           f"process (its model was released or its blocks uninstalled)")
    return place


def _resident(key: str):
    place = _place(key)
    return place.resident() if place is not None else contextlib.nullcontext()


def kernels(key: str) -> Kernels:
    found = KERNELS.get(key.partition("#")[0])
    if found is None:
        raise RuntimeError(f"dpfx: no compiled block {key!r} in this process: a graph that calls "
                           f"a dpfx block was loaded without compiling the block (compile the "
                           f"model with dpfx in this process)")
    return found


_HELD: dict[int, list[torch.Tensor]] = {}


def _handle(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """A handle holding ``tensors`` while it lives (Note [A block's own tensors stay out of the
    model's graph])."""
    handle = torch.zeros(1, dtype=torch.int64, device=device)
    key = handle.untyped_storage().data_ptr()
    _HELD[key] = tensors
    weakref.finalize(handle, _HELD.pop, key, None)
    return handle


def _held(handle: torch.Tensor) -> list[torch.Tensor]:
    found = _HELD.get(handle.untyped_storage().data_ptr())
    if found is None:
        raise RuntimeError("dpfx: a block op was handed a handle that is not a block op's own "
                           "(a copy of it, or one whose tensors were freed)")
    return found


def _fake_handle(device) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64, device=device)


def graph_reads(k: Kernels) -> list[int]:
    """The positions, among ``k.backward_reads``, of what ``block_bwd`` takes after its handle:
    every read but the saved activations."""
    return [i for i, (kind, _) in enumerate(k.backward_reads) if kind != "saved"]


def _is_held(k: Kernels, source: tuple[str, int]) -> bool:
    kind, i = source
    return kind == "out" or k.backward_reads[i][0] == "saved"


def graph_operands(k: Kernels) -> list[tuple[str, int]]:
    """Part B's operands as the model's graph passes them: ("out", n), the ``held`` handle,
    output n of ``block_bwd``; then ("in", i), input i of ``block_bwd``, for each operand that
    is one of the graph's reads."""
    position = {r: 1 + n for n, r in enumerate(graph_reads(k))}
    return [("out", k.norms + 1)] + [("in", position[i]) for kind, i in k.operands
                                    if not _is_held(k, (kind, i))]


def _all_reads(k: Kernels, saved: list, reads: list) -> list:
    """Part A's reads in ``k.backward_reads`` order, from the saved activations and the graph's."""
    it_saved, it_reads = iter(saved), iter(reads)
    return [next(it_saved) if kind == "saved" else next(it_reads)
            for kind, _ in k.backward_reads]


def _all_operands(k: Kernels, operands: list) -> list:
    """Part B's operands in ``k.operands`` order, from a held handle and the graph's ones."""
    held, rest = iter(_held(operands[0])), iter(operands[1:])
    return [next(held) if _is_held(k, s) else next(rest) for s in k.operands]


def op_layouts(k: Kernels, forward: bool) -> list | None:
    """The batch layouts of ``block_fwd``'s (or ``block_bwd``'s) outputs in the model's graph;
    a handle has none: it holds no example's data in its entries."""
    layouts = k.forward_layouts if forward else k.backward_layouts
    if layouts is None:
        return None
    return list(layouts[:k.num_outputs if forward else k.norms + 1]) + [None]


@torch.library.custom_op("dpfx::block_fwd", mutates_args=())
def block_fwd(key: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    k = kernels(key)
    with _resident(key):
        outs = k.forward(list(args))
    return outs[:k.num_outputs] + [_handle(outs[k.num_outputs:], outs[0].device)]


@block_fwd.register_fake
def _block_fwd_fake(key, args):
    outs = kernels(key).shapes_forward(list(args))
    return outs + [_fake_handle(outs[0].device)]


@torch.library.custom_op("dpfx::block_bwd", mutates_args=())
def block_bwd(key: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    k = kernels(key)
    reads = _all_reads(k, _held(args[0]), list(args[1:]))
    with _resident(key):
        outs = k.backward(reads)
    held = [outs[i] if kind == "out" else reads[i] for kind, i in k.operands
            if _is_held(k, (kind, i))]
    return outs[:k.norms + 1] + [_handle(held, outs[k.norms].device)]


@block_bwd.register_fake
def _block_bwd_fake(key, args):
    outs = kernels(key).shapes_backward(list(args[1:]), args[0].device)
    return outs + [_fake_handle(args[0].device)]


@torch.library.custom_op("dpfx::block_grad", mutates_args=())
def block_grad(key: str, operands: list[torch.Tensor]) -> list[torch.Tensor]:
    k = kernels(key)
    with _resident(key) if k.operands_read_params else contextlib.nullcontext():
        return k.grad([operands[0]] + _all_operands(k, list(operands[1:])))


@block_grad.register_fake
def _block_grad_fake(key, operands):
    return kernels(key).shapes_grad(operands[0].device)


@torch.library.custom_op("dpfx::block_clip", mutates_args=())
def block_clip(key: str, coefs: list[torch.Tensor], keeps: list[torch.Tensor],
               operands: list[torch.Tensor]) -> list[torch.Tensor]:
    k = kernels(key)
    place = _place(key)
    operands = _all_operands(k, list(operands))
    if place is None:
        return k.clip(list(coefs), list(keeps), operands)
    with place.resident() if k.operands_read_params else contextlib.nullcontext():
        sums = k.clip(list(coefs), list(keeps), operands)
    if _LIVE[0]:
        place.clipped(sums)
    return _no_storage(sums)


@block_clip.register_fake
def _block_clip_fake(key, coefs, keeps, operands):
    sums = kernels(key).shapes_clip(coefs[0].device)
    return _no_storage(sums) if "#" in key else sums


def _no_storage(sums: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zeros of each sum's shape and dtype, stride 0: they hold no storage."""
    return [torch.zeros((), dtype=s.dtype, device=s.device).expand(s.shape) for s in sums]


def operands(k: Kernels, args: list, outs: list) -> list:
    """Part B's operands of one block call: from part A's outputs or its inputs (``k``'s own
    kernels' lists, not the ops')."""
    return [outs[i] if kind == "out" else args[i] for kind, i in k.operands]


def _setup_context(ctx, inputs, output):
    key, args = inputs
    k = kernels(key)
    ctx.key = key
    ctx.num_args = len(args)
    # what block_bwd takes besides the output gradients: the handle of the saved activations,
    # the call's arguments and parameters as they came
    ctx.save_for_backward(output[k.num_outputs],
                          *[args[i] for kind, i in k.backward_reads if kind == "arg"])


def _backward(ctx, grads):
    k = kernels(ctx.key)
    handle, *saved = ctx.saved_tensors
    saved = iter(saved)
    reads = []
    for kind, i in k.backward_reads:
        if kind == "grad":
            g = grads[i]
            reads.append(g if g is not None else torch.zeros(()))
        elif kind == "arg":
            reads.append(next(saved))
    outs = block_bwd(ctx.key, [handle] + reads)
    taken = [handle] + reads
    ops = [outs[n] if kind == "out" else taken[n] for kind, n in graph_operands(k)]
    params = block_grad(ctx.key, [outs[k.norms]] + ops)
    arg_grads = [None] * ctx.num_args
    for pos, i in enumerate(k.grad_inputs):
        arg_grads[i] = outs[pos]
    for j in range(len(k.params)):
        arg_grads[k.num_inputs + j] = params[j]
    return None, arg_grads


block_fwd.register_autograd(_backward, setup_context=_setup_context)
