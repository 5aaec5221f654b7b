"""The loop around the graph: one release per forward, one per optimizer step, and only dpfx's
gradients in a private step.

    out = dp_model(x)                 # check_loop_inputs: no input requiring grad, no parameter
                                      # frozen or unfrozen since compile; track_release: a hook
                                      # on the backward
    loss.backward()                   # the release; a second backward of this forward is refused
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # post-processing: allowed
    opt.step()                        # DPOptimizer: p.grad must hold dpfx's release, edited in
                                      # place or not, and no plain gradient autograd added

The graph proof covers one backward graph. What the user's loop does with it is checked here, at
run time, before anything is written; this module is the one owner of those checks (the
backward graph's runner, the parameters' gradient hooks, DPOptimizer and the loss tracking call
into it):

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
``DPOptimizer.step()`` steps p.grad, into which autograd accumulates every backward since the last
``zero_grad``: dpfx's, the raw model's, a module's sharing the weight. dpfx's gradient is the
release; whatever is computed from it alone is post-processing and releases nothing more:
``clip_grad_norm_``, ``clip_grad_value_``, weight decay ``p.grad.add_(p, alpha=wd)``, GradScaler's
``unscale_``, reading it. So dpfx watches what autograd accumulates, not what user code does to
the tensor it released into:

- after every accumulation into p.grad, in any backward, the post-accumulate-grad hook of the
  parameter (registered at compile) records which tensor p.grad now is and whose gradient it
  holds: dpfx's release if that backward ran dpfx's graph (with noise="graph"; with
  noise="optimizer" the clipped sum leaves p.grad at once, Note [Clipped sums stay out of p.grad]
  in api.py), a plain gradient if it did not (the raw model, a module sharing the parameter,
  before or after dpfx's backward, in its backward call or another);
- dpfx's backward, in the parameter's tensor hook that runs just before it accumulates
  (``check_gradient``), refuses a p.grad that is not None, not all zero, and not the
  tensor holding dpfx's release;
- ``step()`` refuses the same: a p.grad into which a plain backward accumulated (until
  ``zero_grad()`` or a new release of dpfx's replaces it), or a tensor assigned to p.grad
  (``p.grad = g``), which dpfx cannot vouch for.

An edit in place of the tensor holding the release is the user's code, never autograd's, and is
accepted as post-processing: dpfx takes it to be a function of the release and of public values
(a weight decay reads the parameters, which are the output of earlier private steps). Copying a
plain gradient into it (``p.grad.copy_(g)``) would be the user's own leak, which no check of the
tensor can tell from clipping. ``torch.autograd.grad`` accumulates nothing and leaves p.grad as
it was. A gradient that is all zero carries nothing, whoever wrote it: ``zero_grad(set_to_none=
False)`` clears a plain gradient as ``zero_grad()`` does. The checks compare tensor identities;
only a p.grad that is not dpfx's release has its values read (to see whether it is all zero).

With noise="optimizer" p.grad is None between the backward and ``step()`` (the clipped sums wait
in ``dp_model.clipped_sums``), so post-processing there finds nothing (``clip_grad_norm_``
returns 0). ``step()`` writes the noised gradient into p.grad and then calls the inner
optimizer's ``step()``; post-processing of that release goes in a pre-hook of the inner
optimizer (``opt.original_optimizer.register_step_pre_hook``), which runs in between.
(tests/test_post_processing.py, tests/test_loop_privacy.py)
"""
from __future__ import annotations

import sys
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


def compiled_nodes(roots: list, stop: set = frozenset()) -> list:
    """The autograd nodes of dpfx's compiled functions reachable from ``roots`` (autograd
    nodes), not walking below them or into ``stop``."""
    todo, seen, nodes = list(roots), set(), []
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        if type(node).__name__ == _COMPILED_NODE:
            nodes.append(node)
            continue
        todo.extend(next_node for next_node, _ in node.next_functions)
    return nodes


def track_release(module, outputs, inputs) -> None:
    """Hook the backward of this forward's dpfx graph (Note [One release per forward])."""
    stop = {t.grad_fn for t in inputs if t.grad_fn is not None}
    nodes = compiled_nodes([t.grad_fn for t in outputs if isinstance(t, torch.Tensor)], stop)
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
            elif not module.releases and "transformers.trainer" in sys.modules:
                # a Trainer among the callers means its module was imported; importing dpfx.hf
                # (and with it transformers' Trainer and peft) costs 0.17 s otherwise
                from .hf import warn_if_plain_trainer
                warn_if_plain_trainer(module)
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


# Note [One forward per backward]
# Each backward graph clips the per-example gradients of its own forward. Two forwards that
# reach one backward (dp(a) + dp(b), a siamese net, two augmented views of each example)
# would be clipped separately: an example in both contributes up to 2C while the noise is
# sized for C, a silently weaker guarantee than accounted. Joint clipping needs both uses in
# one graph, so the fix is one forward that takes both inputs. dpfx detects the case exactly:
# two of its backward graphs running inside one autograd graph task (one .backward() call), or
# (loss_track.py) two forwards' outputs meeting in one loss. Each check runs before its graph,
# so the refused second graph has written nothing.
# (tests/test_inputs.py::test_two_forwards_one_backward_refused)
TWO_FORWARDS = (
    "two forwards of one dpfx model reached a single loss or backward (e.g. dp(a) + dp(b), a "
    "siamese net, two augmented views): each forward would be clipped on its own, so an example "
    "used in both could contribute up to 2*max_grad_norm while the noise is sized for one. "
    "Compile one module whose forward takes all the inputs (forward(a, b) returning both "
    "outputs) so every use of a parameter is clipped together, or call backward once per "
    "forward (each is then its own DP step).")


def check_backward_may_run(backend) -> None:
    """Run by the backward graph's runner before it writes anything: the loss was checked
    (loss_track.py), this forward's release hook ran (Note [One release per forward]), and no
    other forward's graph ran in this backward (Note [One forward per backward])."""
    if not backend.loss_released:
        raise PrivacyError(
            "the backward reached dpfx's graph from a loss dpfx did not check: the model's "
            "output left dpfx's tracking (a custom autograd.Function, .data, a NumPy round "
            "trip, a tensor rebuilt from its values), so dpfx cannot prove that the loss "
            "keeps examples apart. Compute the loss with torch ops on the output dpfx "
            "returned. dpfx's graph has written no gradient.")
    if not backend.release_checked:
        raise PrivacyError(
            "dpfx's backward graph ran without its release check (Note [One release per "
            "forward] in release.py): dpfx could not find its compiled function among the "
            "autograd nodes of the forward's outputs. Return the model's outputs as tensors "
            "(or tuples, lists, dicts of them). This backward has written nothing.")
    backend.release_checked = False
    task = torch._C._current_graph_task_id()
    if task != -1 and task == backend.last_graph_task:
        raise PrivacyError(TWO_FORWARDS + " Zero the gradients before retrying: the first "
                           "forward's have been written.")
    backend.last_graph_task = task


# -- gradient ownership: the hooks on every trainable parameter ------------------------------


def check_gradient(backend_ref, name: str, module_ref, param_ref, grad: torch.Tensor) -> None:
    backend = backend_ref()
    if backend is None:
        return
    if name not in backend.graph_params:
        raise PrivacyError(
            f"parameter '{name}' received a gradient, but dpfx's compiled graph does not read it: "
            f"it is used outside the dpfx-compiled module (by the loss or another module), or by "
            f"code that ran outside dpfx's graph. That gradient would be neither clipped nor "
            f"noised. Use every trainable parameter inside the compiled module's forward, or "
            f"freeze it (requires_grad=False). Gradients of this backward may be partly written: "
            f"zero them before the next step.")
    if torch._C._current_graph_task_id() != backend.last_graph_task:
        return
    if backend.produced.pop(name, None) is not grad:
        raise PrivacyError(
            f"parameter '{name}' received a gradient beyond the private one dpfx's graph "
            f"produced: it is also used outside the dpfx-compiled module in this backward (a "
            f"regularizer on the weight in the loss, or another module sharing it), and autograd "
            f"would add that plain gradient to the clipped, noised one. Move that use into the "
            f"compiled module's forward, or detach it. Gradients of this backward may be partly "
            f"written: zero them before the next step.")
    module, p = module_ref(), param_ref()
    if module is not None and p is not None:
        module._ledger.before_accumulate(name, p)


# Note [Clipped sums stay out of p.grad]
# With noise="optimizer" the backward graph outputs sum_i clip(g_i), which is not private until
# DPOptimizer adds the noise. A post-accumulate-grad hook moves it from p.grad into
# dp_model.clipped_sums and sets p.grad back to None, so an optimizer that is not a DPOptimizer
# finds no gradient at all (it skips the parameter) instead of an un-noised one. Only a backward
# that ran dpfx's graph is moved: a plain one's gradient stays in p.grad, recorded in the ledger
# as plain, where DPOptimizer.step() refuses it. With noise="graph" the hook records p.grad as
# dpfx's release (Note [Only dpfx's gradients reach a private step] ).
def after_accumulate(module_ref, name: str, p: torch.Tensor) -> None:
    module = module_ref()
    if module is None or p.grad is None:
        return
    if torch._C._current_graph_task_id() != module._dpfx_backend.last_graph_task:
        module._ledger.accumulated_plain(name, p)
        return
    if module.dp_config.noise == "graph":
        module._ledger.released(name, p)
        return
    acc = module.clipped_sums.get(name)
    if acc is None:
        module.clipped_sums[name] = p.grad
        module.examples += module._pending_examples
        module._pending_examples = 0
    else:
        acc.add_(p.grad)
        if module._pending_examples:
            module.examples += module._pending_examples
            module._pending_examples = 0
    p.grad = None


class GradientLedger:
    """Which tensor each parameter's p.grad was after autograd last accumulated into it, and
    whether it then held dpfx's release or a plain gradient (Note [Only dpfx's gradients reach a
    private step])."""

    def __init__(self):
        self._grads: dict[str, tuple[weakref.ref, bool]] = {}   # name -> (p.grad, dpfx's?)

    def released(self, name: str, p: torch.Tensor) -> None:
        """dpfx's backward accumulated its release into p.grad, or DPOptimizer wrote it."""
        self._grads[name] = (weakref.ref(p.grad), True)

    def accumulated_plain(self, name: str, p: torch.Tensor) -> None:
        """A backward that did not run dpfx's graph accumulated into p.grad."""
        self._grads[name] = (weakref.ref(p.grad), False)

    def vouches(self, name: str, grad: torch.Tensor | None) -> bool:
        entry = self._grads.get(name)
        return entry is not None and entry[1] and entry[0]() is grad

    def _unvouched(self, name: str, grad: torch.Tensor | None) -> str | None:
        """What ``grad`` holds if it is set, not dpfx's release and not all zero, else None."""
        if grad is None or self.vouches(name, grad) or not bool(grad.any()):
            return None
        entry = self._grads.get(name)
        if entry is not None and entry[0]() is grad:
            return ("autograd accumulated a plain gradient into it, in a backward outside "
                    "dpfx's graph (the raw model's, or a module's sharing the parameter)")
        return ("it is a tensor assigned to p.grad (p.grad = ...), which dpfx's backward did not "
                "write")

    def before_accumulate(self, name: str, p: torch.Tensor) -> None:
        held = self._unvouched(name, p.grad)
        if held is None:
            return
        raise PrivacyError(
            f"parameter '{name}' already holds a gradient that is not dpfx's release: {held}; "
            f"dpfx's private gradient would be added to it. Call zero_grad() before the "
            f"private forward and backward. Gradients of this backward may be partly written: "
            f"zero them before the next step.")

    def check(self, named) -> None:
        """At ``DPOptimizer.step()``: every p.grad is None, all zero, or dpfx's release."""
        for name, p in named:
            held = self._unvouched(name, p.grad)
            if held is not None:
                raise PrivacyError(
                    f"parameter '{name}' has a gradient that is not dpfx's release: {held}. It "
                    f"would not be private. A private step takes dpfx's release, edited in place "
                    f"or not (clip_grad_norm_, weight decay, unscaling): zero_grad(), then "
                    f"forward through the dpfx-compiled module and backward once. Nothing was "
                    f"stepped.")
