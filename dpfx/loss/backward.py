"""The check at backward: a tracked loss verified, then its backward run inside the gate.

    loss = F.cross_entropy(dp_model(x), y)
    loss.backward()      # TrackedTensor hands the call to release(): verified, then run

``release`` checks each tracked loss (its autograd graph, its program's verdict, its scale),
divides the scalars applied after the batch reduction out of the starting gradient, and runs
the backward inside each involved model's ``gate.proven()`` (Note [The loss inside the proof]
in loss/track.py).
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from dpfx.errors import PrivacyError
from dpfx.loss import (arranged, check as loss_check, scale as loss_scale,
                       verdict_key as loss_verdict_key)
from dpfx.loss.arranged import LossScaleWarning, arranged_scale, scale_message
from dpfx.loss.gate import (BACKWARD_CALLS, BACKWARD_KWARGS, BACKWARD_SIGNATURES,
                            SECOND_BACKWARD, COMPILED_NODE, compiled_name,
                            compiled_nodes, second_use)
from dpfx.loss.program import build_program
from dpfx.loss.trace import (WRITTEN, Output, Trace, Tracked, caller_text, origin, site_text,
                             was_written)
from dpfx.loss.verdicts import analyze, lookup, store


def release(func, args, kwargs):
    if func is torch.Tensor.backward and len(args) == 1 and kwargs.get("gradient") is None \
            and kwargs.keys() <= BACKWARD_KWARGS:
        # loss.backward(): the common call, without inspect's binding (Tensor.backward hands
        # its defaults on as keywords, so a test for no keywords never held)
        bound, single, losses, grads = None, True, [args[0]], [None]
        rest = dict(kwargs)
        rest.pop("gradient", None)
    else:
        bound = BACKWARD_SIGNATURES[func].bind(*args, **kwargs)
        params = bound.arguments
        loss_name, grad_name = BACKWARD_CALLS[func]
        losses = params[loss_name]
        single = isinstance(losses, torch.Tensor)
        losses = [losses] if single else list(losses)
        grads = params.get(grad_name)
        grads = [None] * len(losses) if grads is None else [grads] if isinstance(
            grads, torch.Tensor) else list(grads)
    backends, traces, others = [], [], []
    for i, loss in enumerate(losses):
        if isinstance(loss, Tracked):
            factor = _verify(loss)
            if isinstance(factor, tuple):
                # Note [Terms on their own scales]: the backward starts at the outputs
                if func is torch.autograd.grad or len(losses) > 1 or (
                        grads[i] is not None and float(grads[i]) != 1.0):
                    raise PrivacyError(
                        "a loss whose terms' batch-dependent scales differ (a token mean plus "
                        "a mean over examples) is released with loss.backward() alone: call "
                        "backward on it, or put its terms on one scale (each per example).")
                edges, start = factor
                with loss._dpfx[0].backend.gate.proven(), \
                        torch._C.DisableTorchFunctionSubclass():
                    keep = {k: v for k, v in (bound.arguments if bound else rest).items()
                            if k in ("retain_graph", "create_graph", "inputs")}
                    return torch.autograd.backward(edges, start, **keep)
            if factor != 1.0:
                with torch._C.DisableTorchFunctionSubclass():
                    grads[i] = (torch.full((), factor, dtype=loss.dtype, device=loss.device)
                                if grads[i] is None else grads[i] * factor)
            backends.append(loss._dpfx[0].backend)
            traces.append(loss._dpfx[0])
        elif isinstance(loss, torch.Tensor):
            others.append(loss)
    if others and traces:
        _check_other_roots(others, traces)
    with contextlib.ExitStack() as proven:
        for b in backends:
            proven.enter_context(b.gate.proven(accumulates=func is not torch.autograd.grad))
        if bound is None:
            with torch._C.DisableTorchFunctionSubclass():
                return func(args[0], grads[0], **rest)
        if any(g is not None for g in grads):
            params[grad_name] = grads[0] if single else grads
        with torch._C.DisableTorchFunctionSubclass():
            return func(*bound.args, **bound.kwargs)


def _per_term_release(verdict, inputs: list, scale) -> tuple:
    """The autograd edges of the outputs and the gradients that start the backward there, from
    the loss's checked program with each term on its own scale (Note [Terms on their own
    scales] in loss/scale.py)."""
    values, edges, leaves = [], [], []
    with torch._C.DisableTorchFunctionSubclass():
        for v in inputs:
            if isinstance(v, Output):
                value, edge = v.trace.outputs[v.record]
                if edge is not None:
                    value = value.detach().requires_grad_()
                    leaves.append(value)
                    edges.append(edge)
                values.append(value)
            elif isinstance(v, bool) or not isinstance(v, (int, float)):
                values.append(v.as_subclass(torch.Tensor) if isinstance(v, Tracked) else v)
            else:
                values.append(torch.tensor(v, dtype=torch.int64 if isinstance(v, int)
                                           else torch.float64))
        with torch.enable_grad():
            loss = loss_scale.scaled_terms(verdict, values, scale.ratios)
            grads = torch.autograd.grad(loss * scale.factor, leaves, allow_unused=True)
    kept = [(e, g) for e, g in zip(edges, grads) if g is not None]
    return [e for e, _ in kept], [g for _, g in kept]


def _verify(loss: Tracked) -> float | tuple:
    trace, index, leaf = loss._dpfx
    if trace.release is not None and trace.release["released"]:
        raise PrivacyError(SECOND_BACKWARD)     # Note [One release per forward] in loss/gate.py
    if trace.poison:
        raise PrivacyError(trace.poison)
    _check_autograd(loss, trace)
    trace.released = True
    if trace.batch == 0:
        # No example, nothing to couple or to scale: the release is the noise alone (the graph's
        # clipped sums are empty), whatever the loss computes from the empty outputs.
        return 1.0
    reduction = trace.backend.config.loss_reduction
    # Note [The steady-state key] in loss/verdict_key.py
    steady = None if WRITTEN else loss_verdict_key.key(trace, index, leaf,
                                                   [origin(t) for t in trace.externals])
    found = steady and loss_verdict_key.lookup(steady, trace)
    if found:
        scale = loss_scale.eval_scale(found[0], trace.batch, found[1], reduction)
        if type(scale) is tuple and not (scale[1] and not getattr(found[0], "warned", False)):
            return scale[0]
    program, key, inputs = build_program(trace, index, leaf, full=False)
    if WRITTEN and any(was_written(v) for v in inputs):
        last = build_program(trace, index, leaf)[0]["lines"][-1]
        raise PrivacyError(
            f"the loss ({site_text(last)}) reads a tensor "
            f"into which a value computed from dpfx's outputs was written in place (`buf += "
            f"out.detach()`): it may carry other examples' outputs into this loss unchecked. "
            f"Compute the loss from the outputs and the batch's own tensors.")
    verdict = lookup(key, program["candidates"])
    if verdict is None:
        program = build_program(trace, index, leaf)[0]
        verdict, choice = analyze(program, trace.batch)
        store(key, choice, verdict)
    if isinstance(verdict, loss_check.LossRefused):
        raise _refusal(verdict, build_program(trace, index, leaf)[0])
    values = loss_scale.normalizer_values(verdict, trace.batch, inputs)
    scale = loss_scale.eval_scale(verdict, trace.batch, values, reduction)
    if isinstance(scale, str):
        program = build_program(trace, index, leaf)[0]
        raise PrivacyError(f"the loss ({site_text(program['lines'][-1])}) cannot be made a sum of "
                           f"per-example terms: {scale}. Compute one per-example loss and take "
                           f"its mean or sum over dim 0.")
    if isinstance(scale, loss_scale.PerTerm):
        return _per_term_release(verdict, inputs, scale)
    factor, changed = scale
    if changed and not getattr(verdict, "warned", False):
        verdict.warned = True
        program = build_program(trace, index, leaf)[0]
        message = scale_message(verdict, reduction, program)
        if message not in arranged.WARNED and \
                not arranged_scale(verdict, program["lines"], values, trace.batch, reduction):
            arranged.WARNED.add(message)
            warnings.warn(message, LossScaleWarning, stacklevel=4)
    if steady:
        loss_verdict_key.store(steady, verdict, program, values, trace)
    return factor


def _check_autograd(loss: Tracked, trace: Trace) -> None:
    # The walk stops at the tracked outputs' own autograd edges (node, output number): an
    # output retyped in place has the compiled function's node as its grad_fn, and another
    # output of that node (a weight the forward stored on a module) must still be found.
    stops = {(edge.node, edge.output_nr) for _, edge in trace.outputs.values()
             if edge is not None}
    with torch._C.DisableTorchFunctionSubclass():
        stack, seen = [(loss.grad_fn, loss.output_nr)], set()
    while stack:
        node, nr = stack.pop()
        if node is None or (node, nr) in stops or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction) and \
                node in compiled_nodes(trace.stop_nodes):
            raise PrivacyError(
                f"the loss ({caller_text()}) reads a tensor that dpfx's compiled forward produced "
                f"but did not return (a module attribute set during the forward, such as the "
                f"weight the deprecated nn.utils.weight_norm hook stores on its module): its "
                f"gradient enters dpfx's backward outside the checked outputs and may belong to "
                f"no example or to all of them. Compute the loss from the compiled module's "
                f"outputs only.")
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            raise PrivacyError(_unseen_backward(type(node).__name__))
        if type(node).__name__ == "AccumulateGrad":
            if id(node.variable) in trace.param_ids:
                # Note [Every gradient a parameter receives is dpfx's] in grad_guards.py
                raise PrivacyError(second_use(compiled_name(node.variable), trace.backend.gate,
                                              f"the loss at {caller_text()}"))
            else:
                name = compiled_name(node.variable)
                if name is not None:
                    # Note [The model passed to dpfx.compile] in loss/gate.py
                    raise PrivacyError(
                        f"the loss ({caller_text()}) uses parameter '{name}' of the model given to "
                        f"dpfx.compile directly: the model itself was called, not the module "
                        f"dpfx.compile (or make_private) returned, so its gradient would be "
                        f"neither clipped nor noised. Call the returned model: dp_model, "
                        f"optimizer, loader, accountant = dpfx.make_private(model, ...); "
                        f"loss = fn(dp_model(x), y). Nothing was released.")
                raise PrivacyError(
                    f"the loss ({caller_text()}) uses a tensor that requires grad and is not a "
                    f"parameter of the dpfx-compiled model: its gradient would be neither "
                    f"clipped nor noised. Detach it, or make it a parameter of the model.")
            continue
        stack.extend(node.next_functions)


def _check_other_roots(roots: list, traces: list) -> None:
    """A backward call on several roots, some not computed from dpfx's outputs: their autograd
    graphs reach neither a parameter of the model nor dpfx's compiled function (Note [Every
    gradient a parameter receives is dpfx's] in grad_guards.py)."""
    with torch._C.DisableTorchFunctionSubclass():
        stack = [(r.grad_fn, None) for r in roots]
    params = set().union(*(t.param_ids for t in traces))
    graphs = {n for t in traces for n in compiled_nodes(t.stop_nodes)}
    seen = set()
    while stack:
        node, through = stack.pop()     # through: a compiled function above it, by its kind
        if node is None or node in seen:
            continue
        seen.add(node)
        if node in graphs:
            raise PrivacyError(
                f"a backward call ({caller_text()}) on several tensors, one of which reaches "
                f"dpfx's compiled module without being computed from its outputs by torch ops "
                f"dpfx follows: its gradient would enter dpfx's backward unchecked. Add the terms "
                f"into one loss, computed from the outputs with torch ops. Nothing was released.")
        kind = type(node).__name__
        if kind == "AccumulateGrad":
            if id(node.variable) in params:
                name = compiled_name(node.variable)
                if through is not None:
                    raise PrivacyError(
                        f"a backward call ({caller_text()}) on several tensors, one of which "
                        f"reaches parameter '{name}' through a compiled function ({through}) "
                        f"that dpfx did not check: another forward of the dpfx-compiled module "
                        f"whose outputs dpfx could not find in what it returned (a tensor kept "
                        f"in a custom object), or a torch.compile'd function. Return the model's "
                        f"outputs as tensors (or tuples, lists, dicts of them) and compute each "
                        f"loss from them. Nothing was released.")
                raise PrivacyError(second_use(name, traces[0].backend.gate,
                                              f"a backward call at {caller_text()}"))
            continue
        if kind == COMPILED_NODE:
            through = kind
        stack.extend((n, through) for n, _ in node.next_functions)


def _unseen_backward(kind: str) -> str:
    """Why a loss through a function whose backward dpfx cannot see is refused, and the fix. A
    torch.compile'd function captured with the model is traced through by dynamo and proven
    once (loss/captured.py); a custom autograd.Function is not (its own backward would be
    replaced by autograd's formulas of its forward), so only the torch ops are named for it."""
    if kind == "CompiledFunctionBackward":
        return (f"the loss ({caller_text()}) goes through a torch.compile'd function ({kind}): "
                f"dpfx cannot check what its backward does to each example's gradient. Capture "
                f"the loss with the model instead, where dpfx proves it once: dp = "
                f"dpfx.compile(model, ..., loss=fn), then loss = dp.loss(x, y) (fn may be the "
                f"compiled function itself; dynamo traces it with the model); or write the loss "
                f"with torch ops outside torch.compile.")
    return (f"the loss ({caller_text()}) goes through a custom autograd.Function ({kind}): dpfx "
            f"cannot check what its backward does to each example's gradient. Write the loss "
            f"with torch ops outside torch.compile.")


def _refusal(e: loss_check.LossRefused, program: dict) -> PrivacyError:
    line = program["lines"][e.record] if e.record is not None else program["lines"][-1]
    if e.at_replay and e.reason.startswith("could not be replayed"):
        return PrivacyError(
            f"dpfx cannot check the loss: op {e.op} ({site_text(line)}) {e.reason}. Nothing was "
            f"released.")
    return PrivacyError(
        f"the loss couples examples: op {e.op} ({site_text(line)}) {e.reason}. dpfx clips each "
        f"example's gradient of its own loss; a loss that mixes examples lets one example move "
        f"every other example's gradient. Compute one loss per example (reduction='none', "
        f"nothing that compares examples) and take its mean or sum over dim 0.")
