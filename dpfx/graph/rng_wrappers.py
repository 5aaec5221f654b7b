"""The ops activation checkpointing runs under a saved RNG state, read as the op they wrap.

    wrapped = rng_wrapped(node)     # node: run_and_save_rng_state(sdpa, q, k, v)
    wrapped.target, wrapped.args    # sdpa, (q, k, v): what the batch analysis and the forward
    wrapped.meta["val"]             # check read, as of the op itself; its outputs' fake values
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx


# Note [An op run under a saved RNG state]
# Activation checkpointing recomputes a region's forward inside the backward, and a random op there
# (a dropout draw; an attention kernel, which takes a dropout probability) must give the same
# values twice. The partitioner wraps each: the forward runs ``run_and_save_rng_state(op, *args)``,
# which returns (the generator's state read before the op, the op's outputs), and the backward
# ``run_with_rng_state(state, op, *args)``, which returns the op's outputs. The wrappers carry no
# fake value, so read off shapes alone a merged batch dim (a pair's two rows, ``per_user``'s k*U)
# is Ambiguous, and the op inside would escape the forward check. Both are analysed and checked
# as the op they run (``WrappedOp``: its target, its arguments without the state, its values read
# from the wrapper's getitem or, in the backward, computed by the op's fake kernel): its layouts
# are the op's own, and the forward check flags what it would flag in the op; a wrapped op whose
# outputs cannot be computed is refused where it reads the batch. The state is a batch-free
# tensor that holds no example (``rng_state``).
# (tests/graph/test_rng_wrappers.py; tests/hf/test_trl_dpo.py trains DPO checkpointed)
def _rng_wrappers() -> tuple:
    from torch._prims import rng_prims

    return rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state


@dataclasses.dataclass(eq=False)
class WrappedOp:
    """The op a ``run_and_save_rng_state`` or ``run_with_rng_state`` node runs, seen as a node of
    its own (Note [An op run under a saved RNG state]): what the analysis and the forward check
    read of a node (target, args, kwargs, meta with the op's value, inputs), the wrapper's name."""
    node: fx.Node
    target: Any
    args: tuple
    kwargs: dict
    meta: dict
    op: str = "call_function"

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def all_input_nodes(self) -> list[fx.Node]:
        found: dict[fx.Node, None] = {}
        fx.node.map_arg((self.args, self.kwargs), lambda a: found.setdefault(a))
        return list(found)


def rng_wrapped(node: fx.Node) -> WrappedOp | None:
    """The op ``node`` runs under a saved RNG state, or None for any other node."""
    if node.op != "call_function":
        return None
    save, run_with = _rng_wrappers()
    if node.target is save:
        op, args = node.args[0], node.args[1:]
        outs = [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]
        meta = {**node.meta, **(outs[0].meta if outs else {})}   # the op's own, copied there
        if meta.get("val") is None:
            meta["val"] = _fake_run(op, args, node.kwargs)
    elif node.target is run_with:
        op, args = node.args[1], node.args[2:]
        meta = {**node.meta, "val": _fake_run(op, args, node.kwargs)}
    else:
        return None
    return WrappedOp(node, op, tuple(args), dict(node.kwargs), meta)


def saves_state(node: fx.Node) -> bool:
    """A ``run_and_save_rng_state`` node: it returns (the state, the op's outputs)."""
    return node.op == "call_function" and node.target is _rng_wrappers()[0]


def rng_state(node: fx.Node) -> bool:
    """The generator's state a ``run_and_save_rng_state`` node returns first: read before the
    op runs, it holds no example (Note [An op run under a saved RNG state])."""
    return node.target is operator.getitem and node.args[1] == 0 and \
        isinstance(node.args[0], fx.Node) and saves_state(node.args[0])


def _fake_run(op, args, kwargs) -> Any:
    """An ATen op's fake value on its inputs' fake values; None where it has none (the forward
    check refuses such a wrapped op where it reads the batch)."""
    from torch._guards import detect_fake_mode

    if not isinstance(op, torch._ops.OpOverload):
        return None
    args, kwargs = fx.node.map_arg((args, kwargs), lambda a: a.meta.get("val"))
    mode = detect_fake_mode((args, kwargs))
    if mode is None:
        return None
    try:
        with mode:
            return op(*args, **kwargs)
    except Exception:       # no value: refused where it reads the batch
        return None
