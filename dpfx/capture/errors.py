"""What dynamo raised while capturing, as the error a user can act on: a graph break, a refusal
raised inside a traceable stand-in, or a question torch could not decide about the symbolic batch;
each with the lines of the model's code that led to it (read by one parser of dynamo's
"from user code:" text)."""
from __future__ import annotations

import os

import sympy
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from dpfx.errors import CaptureError, DPFXError

_OWN = f"{os.sep}dpfx{os.sep}"


def user_code(message: str) -> list[str]:
    """The frames of a dynamo error message's "from user code:" block, one line each
    (``File "...", line N, in f: the code``), dpfx's own frames left out."""
    lines = message.splitlines()
    if "from user code:" not in lines:
        return []
    frames, own = [], False
    for line in lines[lines.index("from user code:") + 1:]:
        text = line.strip()
        if not text:
            break
        if text.startswith("File "):
            own = _OWN in text
            if not own:
                frames.append(text)
        elif frames and not own and not set(text) <= {"^", "~"}:
            frames[-1] += ": " + text
    return frames


def _in_the_models_code(frames: list[str]) -> str:
    return "\n  in the model's code:\n" + "\n".join(f"    {f}" for f in frames) if frames else ""


def graph_break_error(e: Exception) -> CaptureError:
    """The graph break as the user needs it: what dynamo could not trace, why (for an exception
    raised while tracing, the exception itself), and where in the user's code."""
    lines = str(e).splitlines()

    def field(name: str) -> str:
        return next((line.split(":", 1)[1].strip() for line in lines
                     if line.strip().startswith(name + ":")), "")

    what = lines[0].strip() if lines else type(e).__name__
    why = field("Developer debug context") if what == "Observed exception" else field("Explanation")
    where = _in_the_models_code(user_code(str(e)))
    hint = ""
    if what.startswith("Attempted to call function marked as skipped") and (
            "pack_padded_sequence" in why or "pad_packed_sequence" in why):
        hint = (" Call nn.utils.rnn.pack_padded_sequence / pad_packed_sequence through the module "
                "(a name imported with `from torch.nn.utils.rnn import ...` is torch's own, which "
                "dynamo cannot trace; dpfx swaps the module's attribute during capture).")
    return CaptureError(
        f"the model's forward could not be captured as one graph (a graph break): {what}"
        + (f": {why.rstrip('.')}" if why else "") + "."
        + (where + "\n" if where else " ")
        + "dpfx never runs part of a model outside its private graph; rewrite that construct."
        + hint)


# Note [Refusals raised while capturing]
# A stand-in of capture/traceable.py that finds an op mixing examples (torch.roll over the batch) raises a
# PrivacyError while dynamo runs it on fake tensors; dynamo wraps it in a TorchRuntimeError (the
# PrivacyError is in its exception chain). The PrivacyError is raised again, with the model's
# lines that led to it.
# (tests/loop/test_loop_privacy.py::test_batch_mixing_norms_and_roll)
def refusal_while_capturing(e: Exception) -> DPFXError | None:
    todo, seen = [e], set()
    while todo:
        cause = todo.pop()
        if cause is None or id(cause) in seen:
            continue
        seen.add(id(cause))
        if isinstance(cause, DPFXError):
            return type(cause)(str(cause) + _in_the_models_code(user_code(str(e))))
        todo += [cause.__cause__, cause.__context__]
    return None


def symbolic_batch_error(e: Exception) -> CaptureError:
    """What torch could not decide about the symbolic batch, where in the model's code, and the
    fix that applies (Note [Deciding a branch on the batch size] in capture/batch_branches.py says
    which comparisons dpfx decides itself)."""
    chain, seen = [], e
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = getattr(seen, "inner_exception", None) or seen.__cause__ or seen.__context__
    guard = next((x for x in chain if hasattr(x, "dpfx_expr")), None)
    expr = str(guard.dpfx_expr) if guard is not None else \
        next((str(x).splitlines()[0] for x in chain
              if isinstance(x, GuardOnDataDependentSymNode)), str(e).splitlines()[0])
    stack = guard.dpfx_model_stack if guard is not None else []
    if not stack:
        stack = next((frames for x in chain if (frames := user_code(str(x)))), [])
    if "Could not extract specialized integer" in expr or (
            guard is not None and not _is_condition(guard.dpfx_expr)):
        why = (f"the model's code needs the batch size as a Python number ({expr}): a loop over "
               f"the examples, a list with one entry per example, int(x.shape[0]). dpfx keeps "
               f"the batch symbolic so that one graph serves every batch size. Compute over the "
               f"whole batch with tensor ops instead.")
        if any("range(" in str(frame) for frame in stack):
            why += (" For an index over the rows, write torch.arange(len(y)) where the line "
                    "has range(len(y)): it stays one tensor op of the batch size.")
    elif getattr(guard, "dpfx_on_data", False):
        # Note [A branch on the data is not a branch on the batch size]
        # A Python ``if`` on a tensor's value (``if torch.any(var < 0): raise``, ``.item()`` in
        # a condition) makes an unbacked symbol of the data, not of the batch: no batch size
        # decides it, and one graph cannot hold both branches. It is named as what it is, with
        # the way out that keeps the computation private: outside the compiled code (a loss
        # computed in the training loop is checked there, loss/check.py).
        # (tests/loss/test_loss_graph.py::test_captured_loss_branching_on_data_is_named)
        why = (f"the code branches on a value computed from the data ({expr}: a Python `if` on "
               f"a tensor, `.item()` or `bool()` of one, such as torch's own check "
               f"`if torch.any(var < 0)` in F.gaussian_nll_loss), at the line below. One graph "
               f"serves every batch, so nothing in it may branch on the data. Move that code "
               f"out of the compiled module; for a loss, compute it in the training loop "
               f"(`loss = fn(dp_model(x), y); loss.backward()`, which dpfx checks there) "
               f"rather than with dpfx.compile(..., loss=fn).")
    else:
        why = (f"torch could not decide {expr} for a symbolic batch size. dpfx decides a "
               f"comparison of the batch size alone, at each call's size; this one also involves "
               f"a value computed from the data or another dynamic size. Make the condition "
               f"independent of the batch size, or file an issue with the expression and line.")
    head = ("the model cannot be captured as one graph" if getattr(guard, "dpfx_on_data", False)
            else "the model cannot be captured with a symbolic batch size")
    return CaptureError(f"{head}: {why}{_in_the_models_code(stack)}")


def _is_condition(expr) -> bool:
    return bool(expr.is_Relational) or isinstance(expr, sympy.logic.boolalg.BooleanFunction)
