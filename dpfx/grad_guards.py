"""The gradient guards: hooks on a compiled model's trainable parameters that check every
gradient they receive before autograd accumulates it.

    guards = GradientGuards(dp_model, model, backend)   # post-accumulate hooks, at compile
    guards.guard(model)      # after the first training forward: a tensor hook per parameter
    guards.remove()          # the module is replaced (or collected): the hooks come off

The release state the hooks consult has one owner, the release gate (loss/gate.py); the guards
only call it at the right moments.

# Note [Every gradient a parameter receives is dpfx's]
The graph proof covers the graph; what reaches p.grad is autograd's sum of every
contribution to the parameter's gradient in that backward. After the first training
forward, every trainable parameter gets a tensor hook, which autograd calls with that total
before accumulating it:
- a parameter the graph does not read (used by the loss or another module outside the
  compiled forward, or by code dynamo ran outside dpfx's graph) must get no gradient at all;
- in a backward that ran dpfx's graph, a parameter the graph reads must get exactly the
  tensor dpfx's backward produced for it (identity: one contribution is passed through
  unchanged; a second one, such as a regularizer on the weight written in the loss, makes
  autograd pass a fresh sum).
Either failure raises a PrivacyError before that gradient is accumulated. A backward that
never ran dpfx's graph (plain autograd on the raw model) runs as it would without dpfx; the
post-accumulate-grad hook marks what it accumulated as plain, which DPOptimizer.step()
refuses (Note [Only dpfx's gradients reach a private step] in loss/gate.py). A parameter the
model does not use is left alone.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any

import torch


class GradientGuards:
    """The hooks of one compiled module on its model's trainable parameters: a post-accumulate
    hook on each from compile, and a tensor hook on each from the first training forward."""

    def __init__(self, owner, model: torch.nn.Module, backend):
        self._backend = backend
        self._handles: dict[Any, Any] = {}
        self.complete = False   # every trainable parameter has its tensor hook
        weakref.finalize(owner, remove_hooks, self._handles)
        # Note [A parameter's hooks are one frame each] in loss/gate.py
        for name, p in model.named_parameters():
            if p.requires_grad:
                self._handles["after_accumulate", name] = \
                    p.register_post_accumulate_grad_hook(functools.partial(
                        backend.gate.accumulated, name, backend.config.noise))

    def guard(self, model: torch.nn.Module) -> None:
        """A tensor hook on each trainable parameter that has none yet (Note [Every gradient a
        parameter receives is dpfx's]), once the backend knows which parameters its graph
        reads."""
        backend = self._backend
        if backend.graph_params is None:
            return
        for name, p in model.named_parameters():
            if p.requires_grad and name not in self._handles:
                self._handles[name] = p.register_hook(functools.partial(
                    backend.gate.check_gradient, name, weakref.ref(p)))
        # Parameters trainable at compile are all there is to guard: check_loop_inputs refuses
        # any later change of requires_grad, and a parameter added later makes dynamo capture
        # again (then the walk runs again: the call's after_capture).
        self.complete = True

    def remove(self) -> None:
        remove_hooks(self._handles)


def remove_hooks(handles: dict) -> None:
    for handle in handles.values():
        handle.remove()

