"""The ``dpfx::block_*`` ops: a block of the model (a decoder layer) called as one op, so that
its private graph is compiled once and shared by every identical block.

A block's private graph (``dpfx/blocks.py`` builds it) is split at the clip coefficient:

    block_fwd(key, args)   -> [outputs..., saved...]        the block's forward
    block_bwd(key, args)   -> [input grads..., norms, operands...]
                              norms: f32[R, B], row rows[j] the squared per-sample norm of
                              the block's parameters in parameter j's clipping group (what the
                              graph holds, before any scaling; passes/block.py)
    block_grad(key, [norms, *ops]) -> [grad_0, ..., grad_P-1]   the plain sums over examples
    block_clip(key, coefs, keeps, ops) -> [clipped_0, ..., clipped_P-1]
                              sum_i where(keep_j[i], coefs_j[i] * g_i[j], 0) for each j

``args`` of ``block_fwd`` are the block's tensor call arguments, then its parameters in the
order the block's ``Kernels`` name them. The op's autograd formula calls ``block_bwd`` and
``block_grad``: a model whose blocks are these ops trains non-privately with the same gradients
as the model itself. dpfx's per-sample rewrite (``rules/block.py``) replaces each
``block_grad`` by the norms of ``block_bwd`` and one ``block_clip``, so the block's parameters
are clipped by the clip factor of the whole model's graph, like any other parameter.

Every op is functional (its outputs are new tensors), so Inductor calls it as an extern kernel
and the graph around it keeps its order. The kernels and the fake implementations live in the
process's ``KERNELS`` table, filled when a block is compiled; a key that is not there is an
error naming the block (a graph loaded without its blocks).

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
    """What the ops of one block key run. Each callable takes and returns lists of tensors; the
    ``fake`` ones compute only shapes (they run under a FakeTensorMode)."""
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
    # which of block_fwd's args and outputs block_bwd reads, in its order: ("arg", i) |
    # ("saved", k) (an output of block_fwd after the user outputs) | ("grad", k)
    backward_reads: list[tuple[str, int]]
    fake_forward: Callable[[list], list] | None = None
    fake_backward: Callable[[list], list] | None = None
    fake_grad: Callable[[list], list] | None = None
    fake_clip: Callable[[list, list, list], list] | None = None
    # part B's operands: ("out", k) output k of block_bwd, ("in", i) its input i
    operands: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    norms: int = 0                  # the position of norms among block_bwd's outputs
    rows: list[int] = dataclasses.field(default_factory=list)  # parameter j's row of norms
    # the batch layouts (graph/batch.py) of block_fwd's and block_bwd's outputs
    forward_layouts: list | None = None
    backward_layouts: list | None = None
    operands_read_params: bool = False      # an operand is a parameter or constant of the block


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


@contextlib.contextmanager
def live():
    """The ops run for the user's step: a block's clipped sums go to its place."""
    _LIVE[0] += 1
    try:
        yield
    finally:
        _LIVE[0] -= 1


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


@torch.library.custom_op("dpfx::block_fwd", mutates_args=())
def block_fwd(key: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    k = kernels(key)
    with _resident(key):
        return k.forward(list(args))


@block_fwd.register_fake
def _block_fwd_fake(key, args):
    return kernels(key).fake_forward(list(args))


@torch.library.custom_op("dpfx::block_bwd", mutates_args=())
def block_bwd(key: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    k = kernels(key)
    with _resident(key):
        return k.backward(list(args))


@block_bwd.register_fake
def _block_bwd_fake(key, args):
    return kernels(key).fake_backward(list(args))


@torch.library.custom_op("dpfx::block_grad", mutates_args=())
def block_grad(key: str, operands: list[torch.Tensor]) -> list[torch.Tensor]:
    k = kernels(key)
    with _resident(key) if k.operands_read_params else contextlib.nullcontext():
        return k.grad(list(operands))


@block_grad.register_fake
def _block_grad_fake(key, operands):
    return kernels(key).fake_grad(list(operands))


@torch.library.custom_op("dpfx::block_clip", mutates_args=())
def block_clip(key: str, coefs: list[torch.Tensor], keeps: list[torch.Tensor],
               operands: list[torch.Tensor]) -> list[torch.Tensor]:
    k = kernels(key)
    place = _place(key)
    if place is None:
        return k.clip(list(coefs), list(keeps), list(operands))
    with place.resident() if k.operands_read_params else contextlib.nullcontext():
        sums = k.clip(list(coefs), list(keeps), list(operands))
    if _LIVE[0]:
        place.clipped(sums)
    return _no_storage(sums)


@block_clip.register_fake
def _block_clip_fake(key, coefs, keeps, operands):
    sums = kernels(key).fake_clip(list(coefs), list(keeps), list(operands))
    return _no_storage(sums) if "#" in key else sums


def _no_storage(sums: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zeros of each sum's shape and dtype, stride 0: they hold no storage."""
    return [torch.zeros((), dtype=s.dtype, device=s.device).expand(s.shape) for s in sums]


def operands(k: Kernels, args: list, outs: list) -> list:
    """Part B's operands of one block call: from block_bwd's outputs or its inputs."""
    return [outs[i] if kind == "out" else args[i] for kind, i in k.operands]


def _setup_context(ctx, inputs, output):
    key, args = inputs
    k = kernels(key)
    ctx.key = key
    ctx.num_args = len(args)
    # what block_bwd reads: the call's arguments and parameters as they came, the saved tensors
    # block_fwd returned after its outputs
    reads = [args[i] if kind == "arg" else output[k.num_outputs + i]
             for kind, i in k.backward_reads if kind != "grad"]
    ctx.save_for_backward(*reads)


def _backward(ctx, grads):
    k = kernels(ctx.key)
    saved = iter(ctx.saved_tensors)
    args = []
    for kind, i in k.backward_reads:
        if kind == "grad":
            g = grads[i]
            args.append(g if g is not None else torch.zeros(()))
        else:
            args.append(next(saved))
    outs = block_bwd(ctx.key, args)
    params = block_grad(ctx.key, [outs[k.norms]] + operands(k, args, outs))
    arg_grads = [None] * ctx.num_args
    for pos, i in enumerate(k.grad_inputs):
        arg_grads[i] = outs[pos]
    for j in range(len(k.params)):
        arg_grads[k.num_inputs + j] = params[j]
    return None, arg_grads


block_fwd.register_autograd(_backward, setup_context=_setup_context)
