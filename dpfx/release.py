"""The loop around the graph: one release per forward, one per optimizer step, and only dpfx's
gradients in a private step.

    out = dp_model(x)                 # check_loop_inputs: no input requiring grad, no parameter
                                      # frozen or unfrozen since compile; track_release: a hook
                                      # on the backward
    loss.backward()                   # the release; a second backward of this forward is refused
    opt.step()                        # DPOptimizer: p.grad must be what dpfx's backward left

The graph proof covers one backward graph. What the user's loop does with it is checked here, at
run time, before anything is written:

# Note [One release per forward]
A backward of dpfx's graph is one release: it clips the forward's examples and, with
noise="graph", adds fresh noise. Running it twice for one forward (``backward(retain_graph=True)``
twice, ``torch.autograd.grad`` then ``backward``) releases every example twice, 2C in all, while
one release is accounted. ``track_release`` finds the autograd node of dpfx's compiled function
among the outputs' grad_fns and registers a pre-hook on it, which runs before that node's
backward: the second run is refused before the graph writes anything. The backward graph's
runner refuses to run unless that hook has run just before it (``DPBackend.release_checked``), so
a forward whose outputs hid the node from the search fails closed.

# Note [One release per accounted step]
Without a ``DPOptimizer``, every backward of dpfx's graph is its own DP-SGD release (with
noise="graph", its own noise), counted in ``dp_model.releases``: accounting them is the caller's
job, one Poisson-sampled Gaussian step each. A ``DPOptimizer`` counts one accountant step per
``step()``, so once one is attached a second backward before ``step()`` is refused: with
noise="graph" it would add a second noisy release to p.grad, with noise="optimizer" it would sum
two sampled batches under one noise draw, both accounted as one step. Virtual batches are the
one way to sum physical batches under one noise draw: ``signal_skip_step`` makes the next
``step()`` a skipped one, which still closes its backward. A release that ``zero_grad()``
discards unstepped (noise="graph": the noisy gradient was in p.grad) is counted in the
accountant all the same; with noise="optimizer" nothing was released and nothing is counted.

# Note [Only dpfx's gradients reach a private step]
``DPOptimizer.step()`` steps p.grad, which autograd accumulates from every backward since the
last ``zero_grad``: the raw model's, a module sharing the weight, dpfx's. dpfx's backward checks,
before accumulating into p.grad, that p.grad is None or zero, or is dpfx's own gradient of an
earlier backward untouched since; after accumulating, it records which tensor p.grad is and its
version counter. ``step()`` refuses any p.grad that is not that tensor at that version: one a
plain backward wrote or added to, or one changed in place after the backward (dpfx cannot tell
an in-place change from an added gradient). With noise="optimizer" dpfx's gradient leaves p.grad
for ``dp_model.clipped_sums`` at once, so any p.grad at ``step()`` is foreign.
(tests/test_loop_privacy.py)
"""
from __future__ import annotations

import weakref

import torch

from .errors import PrivacyError

_COMPILED_NODE = "CompiledFunctionBackward"


def check_loop_inputs(module, tensors: list[torch.Tensor]) -> None:
    """Refusals of a training forward that the graph cannot see: an input that requires grad
    (its gradient leaves the graph unclipped), and a parameter frozen or unfrozen since compile."""
    config = module.dp_config
    if not config.allow_input_grads:
        for i, t in enumerate(tensors):
            if t.requires_grad:
                raise PrivacyError(
                    f"input {i} of the dpfx-compiled module requires grad: the gradient flowing "
                    f"back into it (and into whatever computed it, such as a trainable encoder "
                    f"upstream) is neither clipped nor noised. Compile the upstream module in (one "
                    f"dpfx.compile of a module whose forward runs both), or detach the input; if "
                    f"you need input gradients and accept that they are not private, pass "
                    f"dpfx.compile(..., allow_input_grads=True).")
    for name, p, trainable in module._trainable_at_compile:
        if p.requires_grad != trainable:
            change = "unfrozen (requires_grad=True)" if p.requires_grad else \
                "frozen (requires_grad=False)"
            raise PrivacyError(
                f"parameter '{name}' was {change} after dpfx.compile: the compiled graphs, the "
                f"clipping groups and the DPOptimizer fix the set of trainable parameters. Call "
                f"dpfx.compile again after changing requires_grad (and build a new DPOptimizer).")


def track_release(module, outputs, inputs) -> None:
    """Hook the backward of this forward's dpfx graph (Note [One release per forward])."""
    stop = {t.grad_fn for t in inputs if t.grad_fn is not None}
    todo = [t.grad_fn for t in outputs
            if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, nodes = set(), []
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        if type(node).__name__ == _COMPILED_NODE:
            nodes.append(node)
            continue
        todo.extend(next_node for next_node, _ in node.next_functions)
    state = {"released": False}
    for node in nodes:
        node.register_prehook(_before_release(weakref.ref(module),
                                              weakref.ref(module._dpfx_backend), state))


def _before_release(module_ref, backend_ref, state):
    def hook(grad_outputs):
        if state["released"]:
            raise PrivacyError(
                "a second backward of one dpfx forward (backward(retain_graph=True) twice, or "
                "torch.autograd.grad then backward): every example of that batch would be "
                "released again with fresh noise, 2*max_grad_norm in all, while one release is "
                "accounted. Run a new forward for each backward. This backward has written "
                "nothing.")
        module = module_ref()
        if module is not None:
            optimizer = module._dpfx_optimizer() if module._dpfx_optimizer else None
            if optimizer is not None:
                optimizer._open_release()
            module.releases += 1
        state["released"] = True
        backend = backend_ref()
        if backend is not None:
            backend.release_checked = True      # read by the backward graph's runner
    return hook


def second_backward_error(noise: str) -> PrivacyError:
    summed = ("add a second noisy release to p.grad" if noise == "graph" else
              "sum two sampled batches' clipped gradients under one noise draw")
    return PrivacyError(
        f"a second backward before DPOptimizer.step(): it would {summed}, and the accountant "
        f"counts one step per step(). Call step() after every backward; to accumulate "
        f"micro-batches into one step use virtual batches (make_private(..., "
        f"max_physical_batch_size=...) or dpfx.VirtualBatches), which noise the sum once and "
        f"account it as one logical batch. This backward has written nothing.")


class GradientLedger:
    """Which tensor, at which version, each parameter's p.grad was when dpfx's backward last
    accumulated into it (Note [Only dpfx's gradients reach a private step])."""

    def __init__(self):
        self._grads: dict[str, tuple] = {}

    def vouches(self, name: str, grad: torch.Tensor | None) -> bool:
        entry = self._grads.get(name)
        return grad is not None and entry is not None and entry[0]() is grad \
            and entry[1] == grad._version

    def before_accumulate(self, name: str, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None or self.vouches(name, grad) or not bool(grad.any()):
            return
        raise PrivacyError(
            f"parameter '{name}' already holds a gradient that dpfx did not produce (a backward "
            f"of the raw model, or of a module sharing the parameter, since the last zero_grad), "
            f"and dpfx's private gradient would be added to it. Call zero_grad() before the "
            f"private forward and backward. Gradients of this backward may be partly written: "
            f"zero them before the next step.")

    def after_accumulate(self, name: str, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._grads[name] = (weakref.ref(p.grad), p.grad._version)

    def check(self, named) -> None:
        for name, p in named:
            if p.grad is not None and not self.vouches(name, p.grad):
                raise PrivacyError(
                    f"parameter '{name}' has a gradient that is not the one dpfx's backward "
                    f"produced: it was written or added to by a backward outside dpfx's graph "
                    f"(the raw model, a module sharing the parameter), or changed in place after "
                    f"the backward (dpfx cannot tell that from an added gradient). A private step "
                    f"takes only dpfx's gradients: zero_grad(), then forward through the "
                    f"dpfx-compiled module and backward once.")
