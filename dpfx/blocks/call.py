"""A compiled block installed in its module: ``block.forward`` calls ``dpfx::block_fwd`` under
the private forward of the dpfx model that compiled it, and the block's own forward otherwise.

    install(block, key, (out_leaves, out_spec), leaves, spec, owner=token)
    with PrivateForward(token):
        model(x)          # each installed block: one dpfx::block_fwd
    uninstall(block)

(Note [Only dpfx's own forward calls a compiled block], Note [A block call's flattening], Note
[An empty cache is no argument].)
"""
from __future__ import annotations

import itertools

import torch
import torch.utils._pytree as pytree

from dpfx.errors import CaptureError
from dpfx.ops.blocks import PLACES, kernels


# Note [Only dpfx's own forward calls a compiled block]
# A block's ``forward`` is replaced for good, but only the private forward of the dpfx model
# that compiled it may take the compiled path: any other call of the module (the user's
# ``model(...)``, ``generate()`` with a key/value cache, a public step, a reference copy's
# capture, a second ``dpfx.compile`` capturing or probing the same model) runs the block's own
# forward, unchanged, with autograd's plain gradients. The route is chosen by the caller, not by
# the arguments: dpfx's forward names itself in ``_CALLER`` (``PrivateForward``, entered around
# its compiled call), and each ``BlockCall`` takes the compiled path only when its owner is the
# caller (a block installed with no owner: under any dpfx forward). Dynamo reads ``_CALLER``
# while it traces the block call, so the model's graph is guarded on its owner's token: the
# steady state pays one guard, and a graph traced under one caller is never run under another.
# A block compiled by two dpfx models keeps both calls in a chain: each hands a call it does not
# own to the forward it replaced.
_CALLER = [0]       # the token of the dpfx model whose private forward runs; 0: none
_OWNERS = itertools.count(1)


def new_owner() -> int:
    """A token for one dpfx model's blocks (``prepare``'s ``owner``, ``PrivateForward``'s)."""
    return next(_OWNERS)


class PrivateForward:
    """``with PrivateForward(token):`` dpfx's private forward of the model ``token`` names:
    its compiled blocks take their compiled path (Note [Only dpfx's own forward calls a
    compiled block])."""

    __slots__ = ("token", "_outer")

    def __init__(self, token: int):
        self.token = token
        self._outer: list[int] = []

    def __enter__(self):
        self._outer.append(_CALLER[0])
        _CALLER[0] = self.token

    def __exit__(self, *exc):
        _CALLER[0] = self._outer.pop()
        return False


class BlockCall:
    """``block.forward`` replaced: under its owner's private forward, the call's tensors, the
    block's parameters and constants go to ``dpfx::block_fwd`` (the non-tensor arguments must
    be those the key was compiled with); any other call runs the forward it replaced."""

    def __init__(self, block: torch.nn.Module, key: str, signature: tuple, owner: int = 0):
        self.key = key
        self.owner = owner
        # the forward this call replaced: an instance attribute (another dpfx model's call, a
        # hook's wrapper) or None for the class's own
        self.replaced = block.__dict__.get("forward")
        self.signature = signature
        self.block = block      # a reference cycle the module's own collection frees
        self.flat = None        # Note [A block call's flattening]
        self.spec = None
        self.num_outputs = kernels(key).num_outputs
        # Where each parameter and buffer lives, in named_parameters()'s order, found once: the
        # model's capture traces this call once per layer, and a walk of the module tree per
        # call is what dynamo spends its time on.
        named = list(block.named_parameters())
        self.trainable = [_slot(block, n) for n, p in named if p.requires_grad]
        self.frozen = [_slot(block, n) for n, p in named if not p.requires_grad]
        self.buffers = [_slot(block, n) for n, _ in block.named_buffers()]

    def __call__(self, *args, **kwargs):
        block = self.block
        caller = _CALLER[0]
        if caller == 0 or (self.owner and caller != self.owner):
            if self.replaced is not None:
                return self.replaced(*args, **kwargs)
            return type(block).forward(block, *args, **kwargs)
        # See Note [A block call's flattening]
        leaves = None
        if self.flat is not None and len(args) == self.flat[0] and tuple(kwargs) == self.flat[1]:
            leaves = [*args, *kwargs.values()]
            if not all(_is_leaf(x) for x in leaves):
                leaves = None
        same_structure = True
        if leaves is None:
            leaves, spec = pytree.tree_flatten((args, kwargs))
            same_structure = self.spec is None or spec == self.spec
        leaves = without_empty_caches(leaves, block)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        constants = tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
        if constants != self.constants or not same_structure:
            raise CaptureError(
                f"dpfx: block {type(block).__name__} is called with arguments other than those "
                f"it was compiled for ({_describe(leaves)}; compiled for "
                f"{_describe(self.constants)}); compile without blocks")
        params = [getattr(m, a) for m, a in self.trainable]
        frozen = [getattr(m, a) for m, a in self.frozen]
        if not all(p.requires_grad for p in params) or any(p.requires_grad for p in frozen):
            raise CaptureError(
                f"dpfx: a parameter of block {type(block).__name__} changed requires_grad since "
                f"the block was compiled; compile the model again")
        buffers = [getattr(m, a) for m, a in self.buffers]
        outs = torch.ops.dpfx.block_fwd(self.key, tensors + params + frozen + buffers)
        if self.out_spec.is_leaf():
            return outs[0]
        it = iter(outs[:self.num_outputs])
        return pytree.tree_unflatten(
            [next(it) if x is _TENSOR else x for x in self.out_constants], self.out_spec)


def _slot(block: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """(the module that holds ``name``, its attribute name)."""
    path, _, attr = name.rpartition(".")
    return block.get_submodule(path), attr


def install(block: torch.nn.Module, key: str, out, leaves: list, spec=None, owner: int = 0
            ) -> None:
    """``block(...)`` calls the compiled block ``key`` from now on, under the private forward
    of the dpfx model ``owner`` names (0: of any; Note [Only dpfx's own forward calls a compiled
    block]); ``uninstall`` undoes it.
    ``leaves``: an example call's flattened arguments (its tensors stand for any tensor), and
    ``spec`` the pytree spec of its ``(args, kwargs)`` (None: every call is flattened);
    ``out``: the example call's flattened outputs and their spec. An output that is not a
    tensor (``None`` for attention weights not asked for) is no output of the block's graph:
    it is returned as the example returned it."""
    out_leaves, out_spec = out
    call = BlockCall(block, key, (), owner)
    call.out_spec = out_spec
    call.out_constants = [_TENSOR if isinstance(x, torch.Tensor) else x for x in out_leaves]
    tensors = sum(1 for x in out_leaves if isinstance(x, torch.Tensor))
    if tensors != call.num_outputs:
        raise CaptureError(f"dpfx: block {type(block).__name__} returns {tensors} tensors, its "
                           f"compiled graph {call.num_outputs}; compile without blocks")
    call.constants = tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
    call.flat, call.spec = _flat_call(spec), spec
    block.forward = call


# Note [A block call's flattening]
# The model's capture traces each block call's Python once per layer, and dynamo's trace of
# pytree's flattening of the call's arguments costs about a quarter of its time on a deep model.
# A call whose positional arguments and keyword values are each a leaf (a tensor
# or a constant, no container) has those values, in that order, as its leaves: the example call
# the block was installed with tells whether it is such a call, and how many positional
# arguments and which keywords (in order) it had. A call with that count and those keywords
# takes the values as they are if each is a leaf (its structure is then the example's); any
# other call is flattened by pytree and must have the example's structure. Either way its leaves
# are then compared with the example's (tensors where it had tensors, the same constants
# elsewhere). A call that differs in structure alone (a mask in a tuple, the same values passed
# positionally) is refused: the compiled block computes what the example call computed.
def _is_leaf(x) -> bool:
    return isinstance(x, (torch.Tensor, bool, int, float, str, type(None))) or \
        pytree.tree_is_leaf(x)


def _flat_call(spec) -> tuple[int, tuple] | None:
    """(positional count, keywords in order) if the example call whose ``(args, kwargs)`` spec
    is ``spec`` had only leaves for arguments, else None."""
    if spec is None:
        return None
    args_spec, kwargs_spec = spec.children()
    if args_spec.type is not tuple or kwargs_spec.type is not dict or \
            not all(c.is_leaf() for c in [*args_spec.children(), *kwargs_spec.children()]):
        return None
    return args_spec.num_children, tuple(kwargs_spec.context)


_TENSOR = "<tensor>"     # a tensor argument's place in a call's constants


# Note [An empty cache is no argument]
# A Hugging Face model called without ``use_cache=False`` makes a fresh key/value cache in every
# forward and hands it to each decoder layer, which appends its keys and values and attends over
# what the cache holds: with the cache empty, exactly its own. In training nothing reads the
# cache afterwards. A block is therefore called with ``None`` in its place, which computes the
# same outputs (in the probes too, so that the cache stays empty for the next block); a cache
# that already holds positions (prefix tuning's past keys) changes what the block computes and
# is refused.
def without_empty_caches(leaves: list, block) -> list:
    out = []
    for x in leaves:
        if x is not None and not isinstance(x, (torch.Tensor, bool, int, float, str)) and \
                hasattr(x, "get_seq_length") and hasattr(x, "update"):
            if x.get_seq_length() != 0:
                raise CaptureError(
                    f"dpfx: block {type(block).__name__} is called with a key/value cache that "
                    f"already holds {x.get_seq_length()} positions; a compiled block cannot read "
                    f"one. Compile without blocks")
            x = None
        out.append(x)
    return out


def _describe(leaves) -> str:
    return ", ".join(_TENSOR if isinstance(x, torch.Tensor) else repr(x) for x in leaves)


def uninstall(block: torch.nn.Module) -> None:
    call = block.__dict__.get("forward")
    if isinstance(call, BlockCall):
        PLACES.pop(call.key, None)
        if call.replaced is not None:
            block.forward = call.replaced
        else:
            del block.forward
