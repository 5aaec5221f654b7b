"""The release gate: the one owner of the state that decides whether dpfx's backward may release,
and of what it released. One per compiled model; its methods are that state's only writers.

    gate = ReleaseGate(on_unaccounted_release)   # made by dpfx.compile, held by DPBackend
    gate.begin_forward()                         # DPModule: a call of the compiled module
    gate.graph_forward()                         #   DPBackend: dpfx's compiled forward ran
    gate.end_forward(training, batch)            # DPModule: a training forward ran through it
    gate.track(outputs, inputs)                  #   and its backward is hooked
    with gate.proven():                          # the loss tracker or the captured loss: a loss
        torch.autograd.backward(loss)            #   dpfx proved runs its backward, in which
            gate.open_release()                  #   the hook: one release per forward and step
            gate.admit_backward(names)           #   the backward graph's runner, before it writes
            gate.accumulated(...)                #   each parameter's post-accumulate hook
    gate.close_step()                            # DPOptimizer.step(), a skipped step, zero_grad()

One forward moves through four states: *forward* (it ran through dpfx's graph), *proven* (its loss
was proven a scaled sum of per-example terms), *released* (its backward graph clipped, and with
noise="graph" noised, its examples' gradients) and *stepped* (DPOptimizer counted the release).
Each check below refuses a move out of order before anything is written. The loss tracker, the
captured loss, the backend and the optimizer ask the gate; none of them writes its fields
(tests/test_layers.py::test_only_the_gate_writes_the_release_state).

# Note [One release per forward]
A backward of dpfx's graph is one release: it clips the forward's examples and, with
noise="graph", adds fresh noise. Running it twice for one forward (``backward(retain_graph=True)``
twice, ``torch.autograd.grad`` then ``backward``) releases every example twice, 2C in all, while
one release is accounted. ``track`` finds the autograd node of dpfx's compiled function among the
outputs' grad_fns and registers a pre-hook on it, which runs before that node's backward: the
second run is refused before the graph writes anything. The backward graph's runner refuses to
run unless that hook has run just before it (``admit_backward``), so a forward whose outputs hid
the node from the search fails closed.

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

A second ``loss.backward()`` without ``retain_graph`` would meet torch's "backward through the
graph a second time" in the loss's own nodes, and with it, torch's error about donated buffers
in the compiled function, before this hook: the loss tracker reads the forward's record
(``track`` returns it) and raises dpfx's refusal first, before autograd runs
(tests/loop/test_mis_setups.py::test_second_backward_is_named_first). ``backward(retain_graph=
True)`` on a compiled backward that reuses its saved tensors' memory (donated buffers) is torch's
refusal, at the first backward; ``proven`` names it as this rule.

# Note [One forward per backward]
Each backward graph clips the per-example gradients of its own forward. Two forwards that reach
one backward (dp(a) + dp(b), a siamese net, two augmented views of each example) would be clipped
separately: an example in both contributes up to 2C while the noise is sized for C, a silently
weaker guarantee than accounted. Joint clipping needs both uses in one graph, so the fix is one
forward that takes both inputs. dpfx detects the case exactly: two of its backward graphs running
inside one autograd graph task (one .backward() call), or (loss/track.py) two forwards' outputs
meeting in one loss. Each check runs before its graph, so the refused second graph has written
nothing. (tests/capture/test_inputs.py::test_two_forwards_one_backward_refused)

# Note [Only dpfx's gradients reach a private step]
``DPOptimizer.step()`` steps p.grad, into which autograd accumulates every backward since the last
``zero_grad``: dpfx's, the raw model's, a module's sharing the weight. dpfx's gradient is the
release; whatever is computed from it alone is post-processing and releases nothing more:
``clip_grad_norm_``, ``clip_grad_value_``, weight decay ``p.grad.add_(p, alpha=wd)``, GradScaler's
``unscale_``, reading it. So dpfx watches what autograd accumulates, not what user code does to
the tensor it released into:

- after every accumulation into p.grad, in any backward, the post-accumulate-grad hook of the
  parameter (registered at compile, ``accumulated``) records which tensor p.grad now is and whose
  gradient it holds: dpfx's release if that backward ran dpfx's graph (with noise="graph"; with
  noise="optimizer" the clipped sum leaves p.grad at once, Note [Clipped sums stay out of
  p.grad]), a plain gradient if it did not (the raw model, a module sharing the parameter, before
  or after dpfx's backward, in its backward call or another);
- dpfx's backward, before its graph writes anything (``admit_backward``, from the backward
  graph's runner), refuses a p.grad of a parameter it is about to release into that is not
  None, not all zero, and not the tensor holding dpfx's release (Note [Every gradient a
  parameter receives is dpfx's] in grad_guards.py says why nothing but dpfx's gradient reaches
  those parameters in that backward);
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
(tests/loop/test_post_processing.py, tests/loop/test_loop_privacy.py)

# Note [Clipped sums stay out of p.grad]
With noise="optimizer" the backward graph outputs sum_i clip(g_i), which is not private until
DPOptimizer adds the noise. The post-accumulate-grad hook (``accumulated``) moves it from p.grad
into the gate's clipped sums and sets p.grad back to None, so an optimizer that is not a
DPOptimizer finds no gradient at all (it skips the parameter) instead of an un-noised one. Only a
backward that ran dpfx's graph is moved: a plain one's gradient stays in p.grad, recorded as
plain, where DPOptimizer.step() refuses it. With noise="graph" the hook records p.grad as dpfx's
release (Note [Only dpfx's gradients reach a private step]).
"""
from __future__ import annotations

import contextlib
import inspect
import operator
import os
import sys
import warnings
import weakref
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

import dpfx
from dpfx.errors import DPFXWarning, PrivacyError

COMPILED_NODE = "CompiledFunctionBackward"   # aot_autograd's autograd node
_FIRST = operator.itemgetter(0)
_ACCUMULATE_GRAD = type(torch.zeros((), requires_grad=True).expand(1).grad_fn.next_functions[0][0])
_LEAF_KINDS = {_ACCUMULATE_GRAD, type(None)}    # a compiled function's edges to leaves, or none
_graph_task_id = torch._C._current_graph_task_id

TWO_FORWARDS = (
    "two forwards of one dpfx model reached a single loss or backward (e.g. dp(a) + dp(b), a "
    "siamese net, two augmented views): each forward would be clipped on its own, so an example "
    "used in both could contribute up to 2*max_grad_norm while the noise is sized for one. "
    "Compile one module whose forward takes all the inputs (forward(a, b) returning both "
    "outputs) so every use of a parameter is clipped together, or call backward once per "
    "forward (each is then its own DP step).")


# The calls that start a backward, which the loss tracker and the captured loss intercept (each
# runs it inside ``ReleaseGate.proven``): for each, the names of its loss and gradient arguments.
BACKWARD_CALLS = {torch.Tensor.backward: ("self", "gradient"),
                  torch.autograd.backward: ("tensors", "grad_tensors"),
                  torch.autograd.grad: ("outputs", "grad_outputs")}
BACKWARD_SIGNATURES = {f: inspect.signature(f) for f in BACKWARD_CALLS}
# the keywords of ``loss.backward(...)`` that need no binding
BACKWARD_KWARGS = {"gradient", "retain_graph", "create_graph", "inputs"}


# Note [The model passed to dpfx.compile]
# ``dp = dpfx.compile(model, ...)`` shares the model's parameters, and ``model`` itself still
# trains: ``model(x).backward()`` and a torch optimizer give ordinary, non-private gradients. The
# slip is silent unless dpfx says so, and dpfx sees it where it already looks: the
# post-accumulate-grad hook that every trainable parameter carries from compile on
# (``accumulated``) finds a gradient that no backward of dpfx's graph wrote. The first such
# backward warns (``PlainGradientWarning``), once per compiled model; a private step costs
# nothing more, since the check runs only on the plain branch. A backward of another module
# compiled over the same model (two dpfx.compile calls, one padded to buckets and one not) is
# plain to this model's gate but private: it is not warned about. A deliberate public phase (pre-
# training on public data before the private one) is declared with ``with dpfx.public(model):``
# (loop/checks.py), under which plain backwards are expected and nothing is said. The same slip
# with a batch of dpfx's loader reaches the loss check, whose refusal names the parameter as the
# model's own (loss/track.py); ``DPOptimizer.step()`` refuses a plain gradient in either case
# (Note [Only dpfx's gradients reach a private step]). (tests/loop/test_mis_setups.py)
class PlainGradientWarning(DPFXWarning):
    """The model given to dpfx.compile trained outside dpfx: its parameters received gradients
    that are neither clipped nor noised."""


# each trainable parameter of a compiled model -> (its model's gate, its name), latest compile
_COMPILED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_GATES: "weakref.WeakSet[ReleaseGate]" = weakref.WeakSet()   # every live gate with parameters


def gates_of(params) -> list["ReleaseGate"]:
    """The gates of the compiled modules that ``params`` belong to (each dpfx.compile of it)."""
    ids = {id(p) for p in params}
    return [g for g in list(_GATES) if g._owned & ids]


def compiled_name(t: torch.Tensor) -> str | None:
    """The parameter name of ``t`` in a model passed to dpfx.compile, else None."""
    entry = _COMPILED.get(t)
    return entry[1] if entry is not None and entry[0]() is not None else None


def warn_at_caller(message: str, category: type) -> None:
    """Warn at the first frame outside torch and dpfx (the user's line that led here)."""
    level, f = 2, sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_LIBRARY_DIRS):
        level, f = level + 1, f.f_back
    warnings.warn(message, category, stacklevel=level if f is not None else 3)


_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(dpfx.__file__))


def _user_line() -> str:
    """The first line outside torch and dpfx on the stack, as file:line."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_LIBRARY_DIRS):
        f = f.f_back
    return "line unknown" if f is None else f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


class ReleaseGate:
    """The release state of one compiled model (module docstring)."""

    def __init__(self, on_unaccounted_release: Callable[[], None] | None = None):
        self._on_unaccounted_release = on_unaccounted_release
        self._graph_ran = False    # this call ran dpfx's compiled forward
        self._proven = 0             # > 0 while a loss dpfx proved runs its backward
        self._sign = 1.0             # the sign of that backward's release
        self._accumulates = True     # and whether autograd accumulates it into p.grad
        self._admitted: tuple | None = None   # the parameters that backward's graph releases into
        self._hooked = False         # this forward's release hook ran just before its graph
        self._graph_task = -1        # the autograd graph task of the last backward graph
        self._guards = None          # a weakref to the model's GradientGuards (grad_guards.py)
        self._releases = 0
        self._stepper = None         # a weakref to the DPOptimizer counting this model's steps
        self._noise = "graph"
        self._unstepped = False      # a release since the last closed step
        self._pending = 0            # examples of the forward whose backward has not run yet
        self._examples = 0           # examples in the clipped sums
        self._sums: dict[str, torch.Tensor] = {}
        self._left: str | None = None   # what took the last captured loss out of the release
        self._public_phases = 0      # > 0 inside ``dpfx.public`` (Note [The model passed to
                                     # dpfx.compile])
        self._warned_plain = False   # PlainGradientWarning said once
        self._owned: set[int] = set()   # ids of the model's trainable parameters
        self.graph_params: set[str] | None = None   # those the last compiled graph reads
        self.ledger = GradientLedger()

    def own(self, named_params) -> None:
        """The trainable parameters of this gate's model (Note [The model passed to
        dpfx.compile])."""
        for name, p in named_params:
            _COMPILED[p] = (weakref.ref(self), name)
            self._owned.add(id(p))
        _GATES.add(self)

    def _elsewhere(self) -> bool:
        """This backward ran the graph of another module compiled over the same parameters."""
        task = torch._C._current_graph_task_id()
        return any(g is not self and g._graph_task == task for g in _GATES)

    @contextlib.contextmanager
    def public(self):
        """A deliberate public phase: plain backwards on the model are expected."""
        self._public_phases += 1
        try:
            yield
        finally:
            self._public_phases -= 1

    # -- what others read --------------------------------------------------------------------
    @property
    def releases(self) -> int:
        """Backward passes of dpfx's graph run so far (Note [One release per accounted step])."""
        return self._releases

    @property
    def unstepped(self) -> bool:
        """A backward ran since the optimizer last closed a step."""
        return self._unstepped

    @property
    def clipped_sums(self) -> dict[str, torch.Tensor]:
        """noise="optimizer": each parameter's sum of clipped gradients since the last reset."""
        return self._sums

    @property
    def examples(self) -> int:
        """The examples whose clipped gradients are in ``clipped_sums``."""
        return self._examples

    @property
    def pending(self) -> int:
        """The examples of the forward whose backward is about to run."""
        return self._pending

    def reset_sums(self) -> None:
        self._sums.clear()
        self._examples = 0

    # -- forward -----------------------------------------------------------------------------
    def begin_forward(self) -> None:
        self._graph_ran = False
        self._left = None

    def left_capture(self, what: str) -> None:
        """The captured loss of this forward went into arithmetic that is not a nonzero
        constant multiple plus a constant (Note [Arithmetic that keeps the captured loss] in
        loss/captured.py): named if its backward reaches the graph."""
        self._left = what

    def graph_forward(self) -> None:
        """dpfx's compiled forward ran (called by its runner)."""
        self._graph_ran = True

    def end_forward(self, training: bool, batch: int) -> None:
        if not training:
            return
        if not self._graph_ran:
            raise PrivacyError(
                "the forward did not run through dpfx's compiled graph (torch.compile fell back "
                "to eager); the gradients would not be private")
        self._pending = batch

    def track(self, outputs: list, inputs: list) -> dict:
        """Hook the backward of this forward's dpfx graph (Note [One release per forward]).
        Returns the forward's release record: ``record["released"]`` once its backward ran."""
        stop = {t.grad_fn for t in inputs if t.grad_fn is not None}
        nodes = compiled_nodes([t.grad_fn for t in outputs if isinstance(t, torch.Tensor)], stop)
        for node in nodes:
            # Note [Every gradient a parameter receives is dpfx's] in grad_guards.py: what flows
            # into the graph's inputs that are not leaves must reach no parameter of the model
            if not set(map(type, map(_FIRST, node.next_functions))) <= _LEAF_KINDS:
                self._check_upstream(node)
        record = {"released": False}
        hook = _release_hook(weakref.ref(self), record)
        for node in nodes:
            node.register_prehook(hook)
        return record

    def _check_upstream(self, node) -> None:
        """Refuses a parameter of this model that the autograd graph below ``node`` (dpfx's
        compiled function) reaches other than as the graph's own leaf input: an input computed
        from it outside the forward (with ``allow_input_grads``), whose gradient autograd would
        add to the private one."""
        todo = [n for n, _ in node.next_functions if n is not None and type(n) not in _LEAF_KINDS]
        seen = set()
        while todo:
            n = todo.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            if type(n) is _ACCUMULATE_GRAD:
                if id(n.variable) in self._owned:
                    raise PrivacyError(
                        f"parameter '{compiled_name(n.variable)}' reaches dpfx's compiled module "
                        f"through one of its inputs too ({_user_line()}), computed from the "
                        f"parameter outside the module's forward: autograd would add that "
                        f"plain gradient to the clipped, noised one the graph releases for it. "
                        f"Compute that input inside the compiled module's forward, or detach "
                        f"it. Nothing was released.")
                continue
            todo.extend(next_node for next_node, _ in n.next_functions)

    # -- the backward ------------------------------------------------------------------------
    def proven(self, sign: float = 1.0, accumulates: bool = True) -> "_Proven":
        """While a loss dpfx proved runs its backward: dpfx's backward graph may release (a
        plain class: every step enters it, Note [The steady-state call] in compiled_call.py).
        ``sign`` -1: the backward graph's runner negates what it releases
        (Note [A negative multiple of the captured loss] in loss/captured.py).
        ``accumulates`` False: ``torch.autograd.grad``, which leaves every p.grad as it was."""
        if sign != 1.0 and sign != -1.0:
            raise ValueError(f"a release's sign is 1 or -1, not {sign}")
        return _Proven(self, sign, accumulates)

    @property
    def sign(self) -> float:
        """The sign of the release the running backward makes (``proven``)."""
        return self._sign

    def open_release(self) -> None:
        """The release hook of one forward, before its backward graph runs."""
        stepper = self._stepper() if self._stepper is not None else None
        if stepper is not None:
            if self._unstepped:
                raise second_backward_error(self._noise)
        elif not self._releases and self._on_unaccounted_release is not None:
            self._on_unaccounted_release()
        self._unstepped = True
        self._releases += 1
        self._hooked = True

    def admit_backward(self, names: tuple = ()) -> None:
        """Run by the backward graph's runner before it writes anything: the loss was proven
        (loss/track.py), this forward's release hook ran (Note [One release per forward]), no
        other forward's graph ran in this backward (Note [One forward per backward]), and no
        parameter of ``names`` (those the graph releases into) holds a gradient that is not
        dpfx's release (Note [Only dpfx's gradients reach a private step])."""
        if not self._proven and self._left is not None:
            raise PrivacyError(
                f"the backward reached dpfx's graph from a loss dpfx did not check: {self._left}. "
                f"dpfx's graph has written no gradient; zero the gradients before the next step.")
        if not self._proven:
            raise PrivacyError(
                "the backward reached dpfx's graph from a loss dpfx did not check: the model's "
                "output left dpfx's tracking (a custom autograd.Function, .data, a NumPy round "
                "trip, a tensor rebuilt from its values), so dpfx cannot prove that the loss "
                "keeps examples apart. Compute the loss with torch ops on the output dpfx "
                "returned. dpfx's graph has written no gradient.")
        if not self._hooked:
            raise PrivacyError(
                "dpfx's backward graph ran without its release check (Note [One release per "
                "forward] in loss/gate.py): dpfx could not find its compiled function among the "
                "autograd nodes of the forward's outputs. Return the model's outputs as tensors "
                "(or tuples, lists, dicts of them). This backward has written nothing.")
        self._hooked = False
        task = torch._C._current_graph_task_id()
        if task != -1 and task == self._graph_task:
            raise PrivacyError(TWO_FORWARDS + " Zero the gradients before retrying: the first "
                               "forward's have been written.")
        self._graph_task = task
        guards = self._guards() if self._guards is not None else None
        if guards is not None and self._accumulates:
            guards.check_held(names, self.ledger)
            self._admitted = names

    def watch(self, guards) -> None:
        """The model's gradient guards (grad_guards.py), which read the parameters' p.grad for
        ``admit_backward``; held weakly (they belong to the compiled module)."""
        self._guards = weakref.ref(guards)

    # Note [A parameter's hook is one frame]
    # Every trainable parameter carries a post-accumulate-grad hook (Note [Only dpfx's gradients
    # reach a private step]), and autograd calls it on every backward: on a small model its
    # Python is a large share of dpfx's time over torch.compile's (28 parameters on the tiny HF
    # GPT-2). The hook is therefore the gate's own method bound with ``functools.partial`` (no
    # wrapper frame between autograd and the record), and its common case, dpfx's release with
    # noise="graph", returns from that frame after one comparison: the ledger's entries of that
    # backward are written together when it returns (``_settle``, the p.grad read in C). The
    # hooks hold the gate, not the backend: the DPModule takes them off when it is collected
    # (grad_guards.py).
    def reads(self, graph_params: set[str]) -> None:
        """The trainable parameters the last compiled graph reads (the backend, per capture)."""
        self.graph_params = graph_params

    def accumulated(self, name: str, noise: str, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook of parameter ``name``, after autograd accumulated into
        p.grad (Note [Clipped sums stay out of p.grad]); ``noise``: the compile's setting."""
        if _graph_task_id() == self._graph_task:
            if noise == "graph":
                return      # recorded when the backward returns (``_settle``)
            grad = p.grad
            if grad is None:
                return
            acc = self._sums.get(name)
            if acc is None:
                self._sums[name] = grad
            else:
                acc.add_(grad)
            self._examples += self._pending
            self._pending = 0
            p.grad = None
            return
        grad = p.grad
        if grad is None:
            return
        self.ledger.accumulated_plain(name, p)
        if not self._public_phases and not self._warned_plain and not self._elsewhere():
            self._warned_plain = True
            warn_at_caller(_PLAIN_GRADIENT.format(name=name), PlainGradientWarning)

    def _settle(self) -> None:
        """The proven backward returned: the p.grad of the parameters its graph released into
        hold dpfx's release (``admit_backward`` saw them None, all zero or dpfx's, and Note
        [Every gradient a parameter receives is dpfx's] in grad_guards.py says nothing else
        reached them), recorded in the ledger at once."""
        names, self._admitted = self._admitted, None
        guards = self._guards() if self._guards is not None else None
        if guards is not None:
            guards.record_released(names, self.ledger)

    # -- the step ----------------------------------------------------------------------------
    def attach(self, optimizer, noise: str) -> None:
        """A DPOptimizer counts this model's steps from now on."""
        self._stepper = weakref.ref(optimizer)
        self._noise = noise
        self._unstepped = False     # releases before it are not its to step

    def close_step(self) -> None:
        """The optimizer took, skipped or discarded the step of the releases so far."""
        self._unstepped = False


_PLAIN_GRADIENT = (
    "parameter '{name}' received a gradient from a backward that did not run through dpfx: "
    "the model given to dpfx.compile was trained directly, so its gradients are neither clipped "
    "nor noised and a torch optimizer would step them without privacy. Call the model "
    "dpfx.compile returned (dp_model = dpfx.compile(model, ...); loss = fn(dp_model(x), y)). For "
    "a deliberate public phase (pre-training on public data), run it inside `with "
    "dpfx.public(model):`, which silences this warning. Said once per compiled model.")


SECOND_BACKWARD = (
    "a second backward of one dpfx forward (loss.backward() twice, with or without "
    "retain_graph=True, or torch.autograd.grad then backward): every example of that batch would "
    "be released again with fresh noise, 2*max_grad_norm in all, while one release is accounted. "
    "Run a new forward for each backward. This backward has written nothing.")


RETAINED_GRAPH = (
    "backward(retain_graph=True) or create_graph=True: this model's compiled backward reuses the "
    "memory of the tensors its forward saved, so its graph cannot be kept for another backward. "
    "dpfx releases one forward by one backward anyway (a second is refused): call "
    "loss.backward() without retain_graph, and run a new forward for each backward.")


class _Proven:
    """``ReleaseGate.proven(sign, accumulates)``."""

    __slots__ = ("_gate", "_sign", "_accumulates", "_before")

    def __init__(self, gate: ReleaseGate, sign: float, accumulates: bool):
        self._gate, self._sign, self._accumulates = gate, sign, accumulates

    def __enter__(self):
        gate = self._gate
        gate._proven += 1
        self._before = gate._sign, gate._accumulates
        gate._sign, gate._accumulates = self._sign, self._accumulates

    def __exit__(self, kind, error, traceback):
        gate = self._gate
        gate._proven -= 1
        gate._sign, gate._accumulates = self._before
        if gate._admitted is not None:
            if error is None:
                gate._settle()
            else:
                gate._admitted = None   # what it wrote stays unvouched: DPOptimizer refuses it
        if isinstance(error, RuntimeError) and "donated buffers" in str(error):
            raise RuntimeError(RETAINED_GRAPH) from None
        return False


def _release_hook(gate_ref, state: dict):
    def hook(grad_outputs):
        if state["released"]:
            raise PrivacyError(SECOND_BACKWARD)
        gate = gate_ref()
        if gate is not None:
            gate.open_release()
        state["released"] = True
    return hook


def compiled_nodes(roots: list, stop: set = frozenset()) -> list:
    """The autograd nodes of dpfx's compiled functions reachable from ``roots`` (autograd
    nodes), not walking below them or into ``stop``."""
    todo, seen, nodes = list(roots), set(), []
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        if type(node).__name__ == COMPILED_NODE:
            nodes.append(node)
            continue
        todo.extend(next_node for next_node, _ in node.next_functions)
    return nodes


def second_use(name: str | None, gate: "ReleaseGate", where: str) -> str:
    """Why a backward that would accumulate into parameter ``name`` outside dpfx's graph is
    refused (Note [Every gradient a parameter receives is dpfx's] in grad_guards.py); ``where``:
    the user's line."""
    if gate.graph_params is not None and name not in gate.graph_params:
        return (f"parameter '{name}' received a gradient, but dpfx's compiled graph does not read "
                f"it: it is used outside the dpfx-compiled module ({where}: by the loss or another "
                f"module), so that gradient would be neither clipped nor noised. Use every "
                f"trainable parameter inside the compiled module's forward, or freeze it "
                f"(requires_grad=False). Nothing was released.")
    return (f"parameter '{name}' received a gradient beyond the private one dpfx's graph "
            f"produces: it is also used outside the dpfx-compiled module in this backward "
            f"({where}: a regularizer on the weight in the loss, another module sharing it, or the "
            f"model given to dpfx.compile called directly), and autograd would add that plain "
            f"gradient to the clipped, noised one. For a weight penalty lam * ||p||^2 use the "
            f"optimizer's weight_decay = 2 * lam instead (torch.optim.SGD and Adam add "
            f"weight_decay * p to the released gradient); otherwise move that use into the "
            f"compiled module's forward, or detach it. Nothing was released.")


def second_backward_error(noise: str) -> PrivacyError:
    summed = ("add a second noisy release to p.grad" if noise == "graph" else
              "sum two sampled batches' clipped gradients under one noise draw")
    return PrivacyError(
        f"a second backward before DPOptimizer.step(): it would {summed}, and the accountant "
        f"counts one step per step(). Call step() after every backward; to accumulate "
        f"micro-batches into one step use virtual batches (make_private(..., "
        f"max_physical_batch_size=...) or dpfx.VirtualBatches), which noise the sum once and "
        f"account it as one logical batch. This backward has written nothing.")


class MissingZeroGradWarning(DPFXWarning):
    """A release added to the gradient of an earlier optimizer step (no zero_grad() between)."""


class GradientLedger:
    """Which tensor each parameter's p.grad was after autograd last accumulated into it, and
    whether it then held dpfx's release or a plain gradient (Note [Only dpfx's gradients reach a
    private step])."""

    def __init__(self):
        # name -> (p.grad, dpfx's?, the optimizer steps taken before it was written)
        self._grads: dict[str, tuple[weakref.ref, bool, int]] = {}
        self._steps = 0
        self._warned_kept = False

    def released(self, name: str, p: torch.Tensor) -> None:
        """dpfx's backward accumulated its release into p.grad, or DPOptimizer wrote it."""
        self._grads[name] = (weakref.ref(p.grad), True, self._steps)

    def accumulated_plain(self, name: str, p: torch.Tensor) -> None:
        """A backward that did not run dpfx's graph accumulated into p.grad."""
        self._grads[name] = (weakref.ref(p.grad), False, self._steps)

    @property
    def steps(self) -> int:
        """Inner optimizer steps so far (Note [Gradients kept across steps])."""
        return self._steps

    def record(self, entries) -> None:
        """Many ``released`` entries at once: (name, (weakref to p.grad, True, steps)) pairs,
        built by the caller in C (grad_guards.py's ``record_released``)."""
        self._grads.update(entries)

    def stepped(self) -> None:
        """DPOptimizer's inner optimizer stepped the gradients (Note [Gradients kept across
        steps])."""
        self._steps += 1

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
            if p.grad is not None and not self._warned_kept:
                self._check_kept(name, p.grad)
            return
        raise PrivacyError(
            f"parameter '{name}' already holds a gradient that is not dpfx's release: {held}; "
            f"dpfx's private gradient would be added to it. Call zero_grad() before the "
            f"private forward and backward. dpfx's backward has written nothing.")

    # Note [Gradients kept across steps]
    # Without zero_grad() between DPOptimizer.step() and the next backward, dpfx's release is
    # added to the one already stepped, and every step applies the sum of all releases so far.
    # That is post-processing of private releases (nothing leaks), but it is not DP-SGD's
    # training, and nothing else would say so. The ledger knows which release p.grad holds and
    # how many steps the inner optimizer has taken since it was written: a release written before
    # the last step, not all zero, about to receive another, warns once. A p.grad set to None by
    # zero_grad() is never read. (tests/loop/test_mis_setups.py)
    def _check_kept(self, name: str, grad: torch.Tensor) -> None:
        entry = self._grads.get(name)
        if entry is None or entry[2] == self._steps or entry[0]() is not grad \
                or not bool(grad.any()):
            return
        self._warned_kept = True
        warn_at_caller(
            f"parameter '{name}' still holds the gradient of the last optimizer step, and this "
            f"backward adds to it: there was no zero_grad() between optimizer.step() and this "
            f"backward, so gradients accumulate across steps and every step applies the sum of "
            f"all releases so far. Call optimizer.zero_grad() before each forward (to sum "
            f"micro-batches into one step, use virtual batches). Said once per compiled model.",
            MissingZeroGradWarning)

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
