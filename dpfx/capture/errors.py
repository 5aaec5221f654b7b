"""What dynamo raised while capturing, as the error a user can act on: a graph break, a refusal
raised inside a traceable stand-in, or a question torch could not decide about the symbolic batch;
each with the lines of the model's code that led to it (read by one parser of dynamo's
"from user code:" text)."""
from __future__ import annotations

import logging
import os

import sympy
import torch
import torch.utils._pytree as pytree
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
# A stand-in of capture/swaps.py that finds an op mixing examples (torch.roll over the batch)
# raises a PrivacyError while dynamo runs it on fake tensors; dynamo wraps it in a TorchRuntimeError (the
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


# Note [An op that fails on the fake inputs]
# An op that cannot run on the captured inputs (a Linear(20, 64) fed [B, 21]) fails in its meta
# kernel while dynamo traces; torch's fake-tensor mode logs the traceback at ERROR level (about
# 20 lines) before dynamo raises it again as a TorchRuntimeError. The error is raised anyway, and
# dpfx names it (``input_shape_error``): the log lines are dropped while dpfx captures
# (capture/entry.py's DynamoSettings) and while it finds the layer, and only they.
# (tests/capture/test_inputs.py::test_wrong_feature_size_is_named)
class _NoMetaTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


FAKE_TENSOR_LOG = logging.getLogger("torch._subclasses.fake_tensor")
NO_META_TRACEBACK = _NoMetaTraceback()


# Note [Naming the layer an input does not fit]
# An input of the wrong size (a Linear(20, 64) fed [B, 21]) fails while dynamo traces the model
# on fake inputs, as a TorchRuntimeError about symbolic shapes (``[u0, 21] X [20, 64]``) inside
# dpfx's entry. Only in that failure, the model runs once more, eagerly in torch's fake-tensor
# mode (shapes only, no data, no gradient) on fake copies of the inputs, with a forward pre-hook
# and hook on every module that keep the stack of modules entered and not left: when an op
# raises, the innermost one is the layer. The error names it (path and type), what it expects
# (its input size, where its type has one) and the shapes it got. If the fake run passes, or
# fails on what fake tensors cannot do (a value read from the data, an op without a fake
# kernel), dynamo's error stands. (tests/capture/test_inputs.py::
# test_wrong_feature_size_is_named)
def input_shape_error(model: torch.nn.Module, args: tuple, kwargs: dict,
                      e: Exception) -> CaptureError | None:
    if "when making fake tensor call" not in str(e):
        return None
    names = {m: n for n, m in model.named_modules()}
    entered: list = []

    def enter(module, inputs):
        entered.append((module, [tuple(t.shape) for t in pytree.tree_leaves(inputs)
                                 if isinstance(t, torch.Tensor)]))

    def leave(module, inputs, output):
        entered.pop()

    hooks = (torch.nn.modules.module.register_module_forward_pre_hook(enter),
             torch.nn.modules.module.register_module_forward_hook(leave))
    FAKE_TENSOR_LOG.addFilter(NO_META_TRACEBACK)
    try:
        with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True) as mode, \
                torch.no_grad():
            fake = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
            model(*fake[0], **fake[1])
        return None
    except _NOT_A_SHAPE:        # the fake run's own limits, not the input's size
        return None
    except RuntimeError as failure:
        layer = next(((m, shapes) for m, shapes in reversed(entered) if m in names), None)
        if layer is None:
            return None
        module, shapes = layer
        given = ", ".join(_shape(s) for s in shapes) or "no tensor"
        name = f"layer '{names[module]}'" if names[module] else "the model"
        expects = _expected_input(module)
        return CaptureError(
            f"the input of {name} ({type(module).__name__}) does not fit it: "
            + (f"it expects {expects} and got {given}" if expects else f"it got {given}")
            + f" ({str(failure).splitlines()[0].rstrip('.')}). Check the inputs' sizes against "
            f"the model's ({module!r}).")
    except Exception:
        return None
    finally:
        for hook in hooks:
            hook.remove()
        FAKE_TENSOR_LOG.removeFilter(NO_META_TRACEBACK)


_NOT_A_SHAPE = (torch._subclasses.fake_tensor.DataDependentOutputException,
                torch._subclasses.fake_tensor.DynamicOutputShapeException,
                torch._subclasses.fake_tensor.UnsupportedOperatorException,
                torch._subclasses.fake_tensor.UnsupportedFakeTensorException,
                GuardOnDataDependentSymNode)


def _shape(shape: tuple) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _expected_input(module: torch.nn.Module) -> str | None:
    """The input shape a layer's own settings fix, where its type has them."""
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return f"[B, {module.in_channels}, ...] ({module.in_channels} channels)"
    if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
        return f"[..., {', '.join(str(d) for d in module.normalized_shape)}]"
    if isinstance(module, torch.nn.GroupNorm):
        return f"[B, {module.num_channels}, ...]"
    if isinstance(module, torch.nn.MultiheadAttention):
        return f"[..., {module.embed_dim}]"
    for size in ("in_features", "input_size", "in1_features"):
        if isinstance(getattr(module, size, None), int):
            return f"[..., {getattr(module, size)}]"
    return None
