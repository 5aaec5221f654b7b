"""Which of a model's modules are compiled as blocks, and how each is called.

    installed = prepare(model, "auto", args, kwargs, config, owner=new_owner())

``select`` finds the blocks the ``blocks=`` option names. ``prepare`` tells which arguments of
each block carry the batch from two eager probes of the model (Note [Per-block private graphs]
in blocks/__init__.py), compiles each distinct block (``block_signature``) once
(blocks/capture.py) and installs every one (blocks/call.py).
"""
from __future__ import annotations

import unittest.mock

import torch
import torch.utils._pytree as pytree

from dpfx.blocks.call import install, uninstall, without_empty_caches
from dpfx.blocks.capture import compile_block
from dpfx.blocks.sizes import resized
from dpfx.config import DPConfig
from dpfx.errors import CaptureError
from dpfx.ops.blocks import PLACES
from dpfx.passes.block import norm_rows


def block_signature(block: torch.nn.Module, args: tuple, kwargs: dict, batched: set[int]
                    ) -> tuple:
    """What two blocks must share to share one compiled graph."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    shapes = tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                   for n, p in block.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers())
    call = tuple((tuple(x.shape[1:]) if i in batched else tuple(x.shape), x.dtype,
                  x.requires_grad, i in batched) if isinstance(x, torch.Tensor) else ("const", x)
                 for i, x in enumerate(leaves))
    return (type(block), str(spec), shapes, buffers, call)


def select(model: torch.nn.Module, blocks) -> list[tuple[str, torch.nn.Module]]:
    """The blocks ``blocks`` names in ``model``: "auto" (a Hugging Face model's
    ``_no_split_modules`` classes, else the longest ModuleList of one class), module classes, or
    module names. Blocks inside other blocks are left to those."""
    from dpfx.errors import OptionError

    named = list(model.named_modules())
    if blocks in (True, "auto"):
        classes = set(_no_split_modules(model))
        # an FSDP unit's class is FSDP<its class>: its own class is the next in its MRO
        found = [(n, m) for n, m in named
                 if n and any(c.__name__ in classes for c in type(m).__mro__[:2])]
        if not found:
            found = [(n, m) for n, m in named if n and _is_fsdp_unit(m)]
        if not found:
            for n, m in named:
                if isinstance(m, torch.nn.ModuleList) and len(m) >= 1 \
                        and len({type(c) for c in m}) == 1 and len(m) > len(found) \
                        and any(True for _ in m[0].parameters()):
                    found = [(f"{n}.{i}" if n else str(i), c) for i, c in enumerate(m)]
        if not found:
            raise OptionError("blocks='auto' found no repeated block in the model (no Hugging "
                              "Face _no_split_modules, no ModuleList of one class): pass "
                              "blocks=[BlockClass] or the blocks' module names")
    elif isinstance(blocks, (list, tuple, set)) and blocks:
        classes = tuple(b for b in blocks if isinstance(b, type))
        names = {b for b in blocks if isinstance(b, str)}
        unknown = names - {n for n, _ in named}
        if unknown:
            raise OptionError(f"blocks: no module named {sorted(unknown)} in the model")
        if len(classes) + len(names) != len(blocks):
            raise OptionError("blocks: give module classes or module names")
        found = [(n, m) for n, m in named if n and (n in names or isinstance(m, classes))]
        if not found:
            raise OptionError(f"blocks: no module of {[c.__name__ for c in classes]} in the "
                              f"model")
    else:
        raise OptionError(f"blocks={blocks!r}: expected 'auto', or a list of module classes or "
                          f"names")
    outer = []
    for n, m in found:
        if not any(n.startswith(o + ".") for o, _ in outer):
            outer.append((n, m))
    return outer


def _no_split_modules(model: torch.nn.Module) -> list:
    """Hugging Face's repeated blocks, of the model or of the model a PEFT wrapper holds."""
    for m in model.modules():
        found = getattr(m, "_no_split_modules", None)
        if found:
            return list(found)
    return []


def _is_fsdp_unit(m: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(m, FSDPModule)


def _probe(model, blocks, args, kwargs, n: int) -> dict[int, list]:
    """Each block's calls (flattened leaves and spec) in an eager forward at batch size n."""
    calls: dict[int, list] = {id(m): [] for _, m in blocks}

    def record(module, a, kw):
        leaves, spec = pytree.tree_flatten((a, kw))
        leaves = without_empty_caches(leaves, module)
        calls[id(module)].append((leaves, spec))
        return pytree.tree_unflatten(leaves, spec)     # the block runs as its op will

    hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for _, m in blocks]
    a, kw = pytree.tree_map_only(torch.Tensor, lambda t: resized(t, n), (args, kwargs))
    try:
        # the model's code takes the path it takes under dynamo (Hugging Face builds an explicit
        # attention mask where eager passes None), so the probe sees the calls the graph makes
        with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                unittest.mock.patch("torch.compiler.is_compiling", return_value=True):
            model(*a, **kw)
    finally:
        for h in hooks:
            h.remove()
    return calls


def prepare(model: torch.nn.Module, blocks, args: tuple, kwargs: dict, config: DPConfig,
            places=None, owner: int = 0) -> list[torch.nn.Module]:
    """Compile the blocks ``blocks`` names, each distinct one once, from two eager probes of
    ``model(*args, **kwargs)`` at batch sizes 2 and 3 (a tensor whose dim 0 follows them
    carries the batch), and install them. Returns the installed blocks. ``places(chosen)``:
    id(block) -> the ``Place`` of each block whose parameters live elsewhere (Note [A block
    whose parameters live elsewhere] in ops/blocks.py); ``owner``: the token of the dpfx model
    whose private forward calls them (Note [Only dpfx's own forward calls a compiled block])."""
    chosen = select(model, blocks)
    small, large = (_probe(model, chosen, args, kwargs, n) for n in (2, 3))
    _refuse_shared(chosen, large)
    placed = places(chosen) if places is not None else {}
    keys: dict[tuple, str] = {}
    installed = []
    try:
        for name, block in chosen:
            if not large[id(block)]:
                continue    # never called: nothing to compile
            (leaves2, spec2), (leaves3, spec3) = small[id(block)][0], large[id(block)][0]
            if str(spec2) != str(spec3):
                raise CaptureError(f"dpfx: block {name} ({type(block).__name__}) is called with "
                                   f"arguments whose structure depends on the batch size; "
                                   f"compile without blocks")
            batched = set()
            for i, (x2, x3) in enumerate(zip(leaves2, leaves3)):
                if not isinstance(x3, torch.Tensor):
                    if not isinstance(x3, (type(None), bool, int, float, str, torch.dtype)):
                        raise CaptureError(
                            f"dpfx: block {name} ({type(block).__name__}) is called with "
                            f"{type(x3).__name__} argument {x3!r}; a block's arguments must be "
                            f"tensors or constants ), or compile without blocks")
                    continue
                if x3.dim() and x2.shape[0] == 2 and x3.shape[0] == 3 \
                        and x2.shape[1:] == x3.shape[1:]:
                    batched.add(i)
                elif x2.shape != x3.shape:
                    raise CaptureError(
                        f"dpfx: block {name} ({type(block).__name__}) is called with a tensor "
                        f"whose shape follows the batch other than in dim 0 ({tuple(x2.shape)} "
                        f"at 2 examples, {tuple(x3.shape)} at 3); compile without blocks")
            a, kw = pytree.tree_unflatten(leaves3, spec3)
            # which of its parameters share a clipping group: one norm row each group (Note
            # [One norm row per clipping group] in passes/block.py)
            groups = [config.group_of(f"{name}.{n}") for n, p in block.named_parameters()
                      if p.requires_grad]
            signature = (block_signature(block, a, kw, batched),
                         tuple(norm_rows(groups, len(groups))))
            if signature not in keys:
                keys[signature] = compile_block(block, a, kw, batched, config, groups)
            with torch.no_grad():
                out_leaves, out_spec = pytree.tree_flatten(block(*a, **kw))
            key = keys[signature]
            place = placed.get(id(block))
            if place is not None:
                key = f"{key}#{place.name}"
                PLACES[key] = place
            install(block, key, (out_leaves, out_spec), leaves3, spec3, owner)
            installed.append(block)
    except BaseException:
        for block in installed:
            uninstall(block)
        raise
    return installed


# Note [A block used more than once is refused]
# A block's ops compute the squared per-sample norm of its parameters' gradient from one call's
# operands (passes/block.py), and the model's clip factor sums one norm row per call. A module
# called more than once in a forward (ALBERT's one layer group at every depth), or two blocks
# that share a parameter, would give the parameter one row per call: the norm of each use's
# gradient, not of their sum, which is the example's gradient and what must be clipped. Such a
# model is refused before anything is installed; the one-graph path clips the sum exactly.
def _refuse_shared(chosen: list, calls: dict[int, list]) -> None:
    owner_of: dict[int, str] = {}
    for name, block in chosen:
        count = len(calls[id(block)])
        if count > 1:
            raise CaptureError(
                f"dpfx: block {name} ({type(block).__name__}) is called {count} times in one "
                f"forward (a layer shared across depth); its parameters' per-example gradient "
                f"is the sum over its uses, which per-block graphs cannot clip. Compile without "
                f"blocks (blocks=False, the one graph clips it exactly)")
        for pname, p in block.named_parameters():
            other = owner_of.setdefault(id(p), f"{name}.{pname}")
            if other != f"{name}.{pname}":
                raise CaptureError(
                    f"dpfx: blocks share the parameter {other} (also {name}.{pname}); its "
                    f"per-example gradient is the sum over the blocks, which per-block graphs "
                    f"cannot clip. Compile without blocks (blocks=False, the one graph clips it "
                    f"exactly)")
