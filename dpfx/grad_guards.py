"""The gradient guards: a compiled model's hooks on its trainable parameters, and the check of
what their p.grad holds before dpfx's backward releases into them.

    guards = GradientGuards(dp_model, model, backend)   # post-accumulate hooks, at compile
    guards.check_held(names, ledger)   # the release gate, before the backward graph writes
    guards.remove()          # the module is replaced (or collected): the hooks come off

The release state the hooks consult has one owner, the release gate (loss/gate.py); the guards
only call it at the right moments.

# Note [Every gradient a parameter receives is dpfx's]
The graph proof covers the graph; what reaches p.grad is autograd's sum of every contribution
to the parameter's gradient in that backward. In a backward that runs dpfx's graph, a trainable
parameter of the model must receive exactly the tensor dpfx's backward produced for it, or
nothing. Autograd's graph of that backward is known before it runs, and every way into a
parameter's accumulation other than dpfx's compiled function is an edge of it that dpfx walks:

- the loss's own nodes, from each root of the backward call down to dpfx's outputs
  (``_check_autograd`` and ``_check_other_roots`` in loss/backward.py, before the backward
  starts): a parameter of the model met there (a regularizer on the weight written in the loss,
  another module sharing it, a module of the model called on the output) is refused, naming it;
- the graph's inputs that are not leaves (``ReleaseGate.track`` at the forward: an input
  computed from a parameter outside the forward, with ``allow_input_grads``): refused the same
  way;
- the captured loss (loss/captured.py) is the graph's output itself, and arithmetic on it with
  anything that needs a gradient is refused where it is written.

So a refusal comes before anything is written, and no hook per parameter has to compare tensors
on every backward. A hook the user registers on a parameter (``p.register_hook``) receives
dpfx's release and may return another tensor: that is the user's code transforming the release,
taken as post-processing, like an edit of p.grad in place (Note [Only dpfx's gradients reach a
private step] in loss/gate.py). What p.grad held before is the gate's to check
(``admit_backward`` reads it here, ``check_held``: None, all zero, or dpfx's earlier release).
A backward that never ran dpfx's graph (plain autograd on the raw model) runs as it would
without dpfx; the post-accumulate-grad hook marks what it accumulated as plain, which
DPOptimizer.step() refuses (Note [Only dpfx's gradients reach a private step] in
loss/gate.py). A parameter the model does not use is left alone.
"""
from __future__ import annotations

import functools
import itertools
import operator
import weakref
from typing import Any

import torch

_GRAD = operator.attrgetter("grad")
# Note [Tensors are compared by identity]
# ``list.count(None)`` and ``None in list`` call ``Tensor.__eq__(None)`` for every tensor in the
# list, which raises and catches a TypeError inside torch: about 13 us a tensor, 0.1 ms a step
# for eight parameters. Lists that may hold tensors are tested against None by identity, in C.
_NONES = itertools.repeat(None)


class GradientGuards:
    """The post-accumulate hooks of one compiled module on its model's trainable parameters, and
    the read of their p.grad before a backward releases into them."""

    def __init__(self, owner, model: torch.nn.Module, backend):
        self._handles: dict[Any, Any] = {}
        self._noise_setting = backend.config.noise
        self._named = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self._released_into: dict[tuple, tuple[list, list]] = {}   # names -> (names, params)
        weakref.finalize(owner, remove_hooks, self._handles)
        # Note [A parameter's hook is one frame] in loss/gate.py
        for name, p in self._named.items():
            self._handles["after_accumulate", name] = \
                p.register_post_accumulate_grad_hook(functools.partial(
                    backend.gate.accumulated, name, backend.config.noise))
        backend.gate.watch(self)

    def check_held(self, names: tuple, ledger) -> None:
        """Before the backward graph releases into the parameters ``names``: each p.grad is None,
        all zero or dpfx's release (``ledger.before_accumulate`` refuses the rest). Their
        p.grad read in C: on the common path (after ``zero_grad()``) every one is None."""
        entry = self._released_into.get(names)
        if entry is None:
            known = [n for n in names if n in self._named]
            entry = self._released_into[names] = (known, [self._named[n] for n in known])
        held = list(map(_GRAD, entry[1]))
        if all(map(operator.is_, held, _NONES)):
            return
        for name, p, grad in zip(entry[0], entry[1], held):
            if grad is not None:
                ledger.before_accumulate(name, p)

    def record_released(self, names: tuple, ledger) -> None:
        """After a proven backward that released into ``names`` (noise="graph"): each p.grad
        that is set holds dpfx's release (``ReleaseGate._settle``). With noise="optimizer" the
        post-accumulate hooks moved the clipped sums out of p.grad already."""
        if self._noise_setting != "graph":
            return
        known, params = self._released_into[names]
        grads = list(map(_GRAD, params))
        steps = ledger.steps
        if not all(map(operator.is_not, grads, _NONES)):
            kept = [(n, g) for n, g in zip(known, grads) if g is not None]
            known, grads = [n for n, _ in kept], [g for _, g in kept]
        ledger.record(zip(known, zip(map(weakref.ref, grads), itertools.repeat(True),
                                     itertools.repeat(steps))))

    def remove(self) -> None:
        remove_hooks(self._handles)


def remove_hooks(handles: dict) -> None:
    for handle in handles.values():
        handle.remove()
