"""The loss captured with the model: proven at capture, its gradient in the graph, no check per
step.

    dp = dpfx.compile(model, loss=F.cross_entropy, max_grad_norm=1.0, noise_multiplier=1.1)
    loss = dp.loss(x, y)       # fn(model(x), y), one compiled graph
    loss.backward()            # every trainable p.grad is the DP-SGD gradient

# Note [The loss inside the graph]
The plain loop computes the loss outside dpfx's graph, so loss/track.py follows it call by call
and proves it at every backward: about 0.15 ms a step on the benchmark MLP, Python paid right
after the kernels. With ``dpfx.compile(model, loss=fn)``, dynamo captures ``fn(model(*inputs),
*targets)`` as one graph, the targets marked with the batch symbol like every input, so
``len(y)``, ``y.shape`` and ``y.size(0)`` are symbols, and every other Python value ``fn`` reads
is a constant dynamo guards on (a new value captures again, and the new graph is proven again).
The model's outputs pass through ``dpfx::model_output``, an identity that marks where the model
ends. Before Inductor's aot_autograd sees the graph, ``capture_loss``:

1. cuts the tail: what the loss computes outside the model (from the marked outputs, the
   targets, sizes of the batch); a tail that reads a parameter or another value of the model
   is refused (a regularizer's gradient would reach p.grad unclipped: Note [A weight penalty is
   the optimizer's]);
2. replays it under ``make_fx`` with Inductor's decompositions on fake tensors with one batch
   symbol, each Python number that multiplies or divides a tensor as a scalar input (as the
   plain loop's check does), and proves it with the loss check's own proof
   (``loss_check.analyze``): no op mixes examples, and ``loss = sum_k c_k sum_i t_k(z_i)``,
   ``c_k = s_k w_k B^p prod_j N_j^q``;
3. builds the loss whose gradient is the per-example term's (Note [The per-example term] in
   loss/check.py, the plain loop's semantics): each term times ``f_k = target / (B^p prod_j
   N_j^q max_j |w_j|)`` (target 1/B for loss_reduction "mean", which the backward graph
   undoes, else 1), in graph nodes computed from the normalizers and the batch symbol; where
   every term has the same batch-dependent part, dynamo's own tail times one factor, else the
   replayed tail with each term scaled. Its value stays ``fn``'s (``L_g + detach(L - L_g)``);
4. traces that loss's *gradient program* with make_fx and autograd's own formulas: the value
   and ``G_j = d L_g / d out_j`` (softmax cross-entropy rewritten into the form Inductor
   streams best: Note [The cross-entropy form] in loss/form.py), and puts it in place of
   dynamo's tail, returning ``value + sum_j dpfx::loss_gradient(out_j, G_j)``: an op whose value
   is 0 (Inductor's decomposition makes it the constant, so nothing is read for it) and whose
   gradient with respect to ``out_j`` is ``tangent * G_j``. The value is ``fn``'s and the
   gradient reaching the model's outputs is exactly G. Where G is computed is aot_autograd's
   partitioner's choice: it saves the logits and each row's statistics and recomputes G in the
   backward, written over the logits, as torch.compile does for a loss that is not private.
   The normalizers' reductions over the batch stay in the forward (dpfx compiles with
   functorch's ``ban_recompute_reductions``: the partitioner never recomputes one), so the
   backward sees only their values, batch-free saved scalars proven in step 2 (a token count
   N enters G as ``f / N`` with ``f`` carrying N: per example, but not visibly so to the
   rules); a reduction over the batch in the backward is refused by its per-sample rules.
   Each of its nodes is tagged ``dpfx_loss`` in its ``custom`` metadata, which aot_autograd
   carries onto the ATen nodes it makes from them: the forward check exempts exactly the
   tagged nodes from its mixing rules (proven in step 2), the self-check exempts the loss's
   batch-free outputs from its independence check, and the backward graph reads the loss's
   tangent as the constant 1 (the only gradient the release lets reach it).

An empty batch takes the model's own graph (Note [An empty batch and the captured loss]).

``dp.loss`` returns a ``CapturedLoss``. Its backward (``loss.backward()``,
``torch.autograd.backward``, ``torch.autograd.grad``) sets the release flag the backward graph
requires; a nonzero constant multiple of it plus a constant (``loss / accum_steps``,
Trainer's ``loss *= k``, ``loss + 1.0``, ``-loss`` for gradient ascent) is released the same, up
to the multiple's sign (Note [Arithmetic that keeps the
captured loss]); any other use of it yields plain tensors, whose backward reaches dpfx's graph
unreleased and is refused there, naming what the loss went through. What runs per step beyond
the graph: one type change of the loss and the flag.
(tests/loss/test_loss_graph.py)
"""
from __future__ import annotations

import itertools
import operator
import traceback

import sympy
import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from dpfx.loss.gate import BACKWARD_CALLS, BACKWARD_KWARGS, BACKWARD_SIGNATURES
from dpfx.ops.loss import model_output
from dpfx.loss import check as loss_check, replay as loss_replay, scale as loss_scale
from dpfx.loss.form import cross_entropy_form
from dpfx.errors import PrivacyError
from dpfx.graph import tags
from dpfx.graph.batch import sym_expr

aten = torch.ops.aten
TARGETS = "dpfx_targets"


_ENTRIES = itertools.count()


def loss_entry(model: torch.nn.Module, fn):
    """dpfx's entry for a captured loss, with a code object of its own (Note [dpfx's own entry
    frame] in capture/entry.py): the targets come in ``kwargs[TARGETS]``."""
    def dpfx_loss(*args, **kwargs):
        targets = kwargs.pop(TARGETS)
        out = model(*args, **kwargs)
        return fn(_mark(out), *targets)

    dpfx_loss.__code__ = dpfx_loss.__code__.replace(co_name=f"dpfx_loss_{next(_ENTRIES)}")
    return dpfx_loss


def _mark(out):
    if isinstance(out, torch.Tensor):
        return model_output(out)
    if isinstance(out, dict):
        for k in list(out.keys()):
            if isinstance(out[k], torch.Tensor):
                out[k] = model_output(out[k])
        return out
    if isinstance(out, (tuple, list)):
        return type(out)(_mark(o) for o in out)
    return out


def capture_loss(gm: fx.GraphModule, reduction: str, batch_symbol) -> bool:
    """Note [The loss inside the graph], steps 1-4, on dynamo's graph in place; whether it had a
    loss (a plain dpfx forward has none). ``batch_symbol``: dynamo's symbol of the batch."""
    graph = gm.graph
    marks = list(graph.find_nodes(op="call_function", target=torch.ops.dpfx.model_output.default))
    if not marks:
        return False
    output = graph.find_nodes(op="output")[0]
    outs = output.args[0]
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    model = set(marks).union(*(loss_check.ancestors(m) for m in marks))
    if len(outs) != 1 or not isinstance(outs[0], fx.Node) or outs[0] in model or \
            not _is_tensor(outs[0]):
        raise PrivacyError(
            "the loss function given to dpfx.compile(loss=...) must return one tensor, the "
            "loss: the mean or sum over the batch of per-example losses")
    loss = outs[0]
    # step 1: the tail, and what it reads from outside
    tail = [n for n in graph.nodes if n in loss_check.ancestors(loss) | {loss} and n not in model
            and n.op in ("call_function", "call_method", "call_module", "get_attr")]
    inputs: list[fx.Node] = []
    for node in tail:
        for a in node.all_input_nodes:
            if a not in tail and a not in inputs:
                inputs.append(a)
    inputs.sort(key=lambda n: (n not in marks, list(graph.nodes).index(n)))
    # step 2
    program = _Program(graph, tail, loss, inputs, marks, batch_symbol)
    try:
        verdict = loss_check.analyze(program.replayed, program.placeholders, program.lines,
                                     program.factors)
    except loss_check.LossRefused as e:
        where = f" ({e.record})" if e.record else ""
        raise PrivacyError(
            f"the loss given to dpfx.compile(loss=...) is not a sum of per-example terms: op "
            f"{e.op}{where} {e.reason}. Compute one loss per example from its own output "
            f"and targets, and take the mean or sum over dim 0.") from None
    # step 3: the scaled loss, and its gradient with respect to the outputs
    scaled = _Scaling(verdict, program, reduction).graph(gm, tail, loss)
    marked = [m for m in marks if m in inputs]
    gradient = program.gradient(scaled, len(marked))
    # step 4: in place of dynamo's tail
    env = {ph: (n.args[0] if n in marks else n)
           for ph, n in zip(gradient.graph.find_nodes(op="placeholder"), inputs)}
    with graph.inserting_before(output):
        before = set(graph.nodes)
        for node in gradient.graph.nodes:
            if node.op in ("call_function", "get_attr"):
                env[node] = _copy(gm, gradient, node, env)
        value, *grads = [env[n] for n in gradient.graph.find_nodes(op="output")[0].args[0]]
        dtype = _value(loss).dtype
        shown = value
        for mark, g in zip(marked, grads):
            shown = graph.call_function(aten.add.Tensor, (shown, graph.call_function(
                torch.ops.dpfx.loss_gradient.default, (mark.args[0], g, dtype))))
        for node in graph.nodes:
            if node not in before:
                for key in ("val", "tensor_meta", "example_value", "unbacked_bindings"):
                    node.meta.pop(key, None)
                custom = dict(node.meta.get("custom") or {})
                custom[tags.LOSS] = True
                node.meta["custom"] = custom
    output.args = ((shown,) if isinstance(output.args[0], (tuple, list)) else shown,)
    for mark in marks:
        mark.replace_all_uses_with(mark.args[0])
    graph.eliminate_dead_code()     # the marks and dynamo's tail
    graph.lint()
    gm.recompile()
    return True


def _value(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


# In dynamo's graph, the calls whose Python-number operand scales a tensor (loss_replay.SCALING
# as dynamo records them): the number is replayed as a scalar input, as the plain loop's check
# does (Note [Python numbers in the loss] in loss/replay.py), so the proof tells a number the
# loss is scaled by from a constant inside a term (label smoothing's) the same way.
_SCALING_CALLS = {operator.mul, operator.truediv, operator.imul, operator.itruediv, torch.mul,
                  torch.div, torch.true_divide, torch.multiply, torch.divide}
_SCALING_METHODS = {"mul", "div", "true_divide", "multiply", "divide", "mul_", "div_",
                    "__mul__", "__rmul__", "__truediv__"}


class _Program:
    """The tail as a graph of its own, replayed under make_fx with Inductor's decompositions on
    fake tensors whose batch dim is one symbol (Note [The loss inside the graph], steps 1-2)."""

    def __init__(self, graph: fx.Graph, tail: list, loss: fx.Node, inputs: list, marks: list,
                 batch_symbol):
        from torch._inductor.decomposition import select_decomp_table

        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for i, node in enumerate(inputs):
            env[node] = sub.placeholder(f"in_{i}")
        self.numbers: list = []        # the Python numbers lifted to scalar inputs, in order
        lifted: dict[tuple, fx.Node] = {}
        for node in tail:
            if _scales(node):
                for i, a in enumerate(node.args[:2]):
                    if loss_replay.is_number(a):
                        self.numbers.append(a)
                        lifted[node, i] = sub.placeholder(f"number_{len(self.numbers) - 1}")
        for node in tail:
            copy = sub.node_copy(node, lambda a: env[a])
            if _scales(node):
                copy.args = tuple(lifted.get((node, i), a) for i, a in enumerate(copy.args))
            env[node] = copy
        sub.output(env[loss])
        module = fx.GraphModule(graph.owning_module, sub)

        shape_env = ShapeEnv()
        mode = FakeTensorMode(shape_env=shape_env)
        symbol = shape_env.create_symbol(loss_replay.BATCH_HINT,
                                         ConstantSource("dpfx_loss_batch"), DimDynamic.DYNAMIC)
        sym_batch = shape_env.create_symintnode(symbol, hint=loss_replay.BATCH_HINT)
        self.placeholders, self.factors, fakes = [], [], []
        for node in inputs:
            ph, factor, fake = _stand_in(node, node in marks, batch_symbol, sym_batch, mode)
            self.placeholders.append(ph)
            self.factors.append(factor)
            fakes.append(fake)
        for value in self.numbers:
            self.placeholders.append(loss_replay.Placeholder.scalar(value))
            self.factors.append(None)
            with mode:
                fakes.append(torch.empty((), dtype=self.placeholders[-1].dtype))
        with mode, torch.fx.traceback.preserve_node_meta():
            self.replayed = make_fx(lambda *xs: fx.Interpreter(module).run(*xs),
                                    decomposition_table=select_decomp_table(),
                                    tracing_mode="real")(*fakes)
        self.replayed.graph.eliminate_dead_code()
        self.lines = {n: _line(n) for n in self.replayed.graph.nodes}
        self.inputs, self.mode, self.fakes = inputs, mode, fakes[:len(inputs)]

    def gradient(self, scaled: fx.GraphModule, outputs: int) -> fx.GraphModule:
        """The program (value, d scaled / d output_j for the first ``outputs`` inputs), traced
        in ATen ops with autograd's own backward formulas."""
        def program(*xs):
            with torch.enable_grad():
                xs = [x.detach().requires_grad_() if i < outputs else x
                      for i, x in enumerate(xs)]
                value = scaled(*xs)[0]
                grads = torch.autograd.grad(value, xs[:outputs], allow_unused=True)
            return (value.detach(), *[torch.zeros_like(x) if g is None else g.detach()
                                      for x, g in zip(xs, grads)])

        with self.mode:
            gm = make_fx(program, tracing_mode="real")(*self.fakes)
        cross_entropy_form(gm)
        return gm

    def value_of(self, placeholder_index: int):
        """The Python number a scalar placeholder stands for (None for another input)."""
        k = placeholder_index - len(self.inputs)
        return self.numbers[k] if k >= 0 else None


def _scales(node: fx.Node) -> bool:
    """A product or quotient of a tensor and a Python number (not of sizes)."""
    return ((node.op == "call_function" and node.target in _SCALING_CALLS) or (
        node.op == "call_method" and node.target in _SCALING_METHODS)) and any(
        isinstance(a, fx.Node) and _is_tensor(a) for a in node.args[:2])


# Note [A captured loss's other sizes are fixed]
# The loss's tail is replayed on fake tensors with one symbol, the batch, and proven for every
# value of it; its other sizes are the numbers of the call that captured it. When a later call
# changes a size after the batch (a target of (B, T) with another T), dynamo captures again with
# that dim symbolic, and a proof at one T would not be one for every T: the loss is refused,
# naming the fixed-length padding or the plain loop, which checks each call's sizes. (A replay
# with a symbol per such dim would lift this; tests/loss/test_refusals.py pins the refusal.)
def _stand_in(node: fx.Node, is_mark: bool, batch_symbol, sym_batch, mode):
    """The placeholder, batch factor and fake value that stand for ``node`` in the replay."""
    val = node.meta.get("example_value", node.meta.get("val"))
    src = node.args[0] if is_mark else node
    if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
        k = _multiple(sym_expr(val), batch_symbol)
        if k is None:
            raise PrivacyError(
                f"the loss given to dpfx.compile(loss=...) reads a size ({val}) that is not a "
                f"multiple of the batch size; compute it from the loss's own tensors")
        return (loss_replay.Placeholder((), torch.int64, torch.device("cpu"), False), None,
                k * sym_batch if k else int(val))
    if not isinstance(val, torch.Tensor):
        raise PrivacyError(f"the loss given to dpfx.compile(loss=...) reads {src.name}, which "
                           f"is not a tensor or a size")
    if not is_mark and node.op != "placeholder":
        raise PrivacyError(
            f"the loss given to dpfx.compile(loss=...) reads a value computed inside the model "
            f"({node.name}) besides the model's outputs; return it from the model")
    if not is_mark and _reads_a_parameter(node):
        if _of_a_module(node) or val.requires_grad:
            raise PrivacyError(
                f"the loss given to dpfx.compile(loss=...) reads the model's parameter or buffer "
                f"{_source(node)}: a regularizer on the weights would reach p.grad unclipped. "
                f"For lam * ||p||^2 use the optimizer's weight_decay = 2 * lam instead "
                f"(torch.optim.SGD and Adam add weight_decay * p to the released gradient).")
        raise PrivacyError(
            f"the loss given to dpfx.compile(loss=...) reads the tensor {_source(node)} from "
            f"outside its arguments (a global or a closure, such as class weights): dpfx cannot "
            f"tell a constant of the training set from a statistic of the batch written there "
            f"before the call (class weights from the batch's labels couple its examples). "
            f"Compute this loss in the training loop instead (loss = fn(dp_model(x), y); "
            f"loss.backward()), which takes such a tensor as a constant.")
    shape = [sym_expr(s) for s in val.shape]
    if not shape or shape[0] != batch_symbol or any(
            batch_symbol in s.free_symbols for s in shape[1:]):
        raise PrivacyError(
            f"the loss given to dpfx.compile(loss=...) reads {_source(node)} of shape "
            f"{tuple(val.shape)}: every tensor it reads must carry the batch in dim 0 and only "
            f"there (targets, masks and weights one row per example)")
    if any(s.free_symbols for s in shape[1:]):
        # See Note [A captured loss's other sizes are fixed]
        raise PrivacyError(
            f"the loss given to dpfx.compile(loss=...) reads {_source(node)} of shape "
            f"{tuple(val.shape)}, whose dims after the batch changed between calls (a sequence "
            f"length that varies from batch to batch): a captured loss is proven for fixed "
            f"sizes after the batch. Pad the batches to a fixed length (the padding ignored "
            f"with ignore_index=-100 or a mask), or compute the loss in the training loop "
            f"(loss = fn(dp_model(x), y); loss.backward()), which is checked at each size.")
    rest = [int(s) for s in shape[1:]]
    with mode:
        fake = torch.empty((sym_batch, *rest), dtype=val.dtype, device=val.device)
    return (loss_replay.Placeholder((None, *rest), val.dtype, val.device, is_output=is_mark,
                                   is_data=not is_mark), 1, fake)


def _is_tensor(node: fx.Node) -> bool:
    val = node.meta.get("example_value", node.meta.get("val"))
    return isinstance(val, torch.Tensor)


def _multiple(expr, symbol) -> int | None:
    """k where ``expr`` is k times the batch symbol (0 where it is a constant)."""
    if not expr.free_symbols:
        return 0
    k = sympy.simplify(expr / symbol)
    return int(k) if k.is_Integer else None


def _of_a_module(node: fx.Node) -> bool:
    """Whether ``node``'s source is an attribute of a module (a parameter or a buffer)."""
    name = _source(node)
    return name.startswith("L['self']") or any(
        part in name for part in ("_modules", "_parameters", "_buffers", "._orig_mod"))


def _reads_a_parameter(node: fx.Node) -> bool:
    name = _source(node)
    return not (name.startswith("L['args']") or name.startswith("L['kwargs']"))


def _source(node: fx.Node) -> str:
    source = getattr(node.meta.get("grapharg"), "source", None)
    try:
        return source.name if isinstance(source.name, str) else source.name()
    except AttributeError:
        return node.name


def _line(node: fx.Node) -> str | None:
    """The user's line of a replayed node: the last frame of its stack trace."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [ln.strip() for ln in trace.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{lines[i][len('File '):]}: {code}"
    return None


class _Scaling:
    """Step 3 in graph nodes: for each term, ``f_k = target / (b_k max_j |w_j|)``, b_k = B^p
    prod N^q over the normalizers computed from the inputs, w_k = prod v^q over the Python
    numbers (compile-time constants, guarded by dynamo), target 1/B for loss_reduction "mean";
    1 where f_k is not finite or b_k is 0 (loss_scale.eval_scale's rule)."""

    def __init__(self, verdict, program: _Program, reduction: str):
        self.verdict, self.program, self.reduction = verdict, program, reduction
        extracted = None if verdict.evaluate_normalizers is None else \
            verdict.evaluate_normalizers.__self__.graph
        self.extracted = extracted
        outs = [] if extracted is None else extracted.find_nodes(op="output")[0].args[0]
        phs = [] if extracted is None else list(extracted.find_nodes(op="placeholder"))
        # normalizer index -> its Python number, for those that are one
        self.numbers = {i: program.value_of(phs.index(n)) for i, n in enumerate(outs)
                        if i in verdict.scalar_normalizers}
        weights = [self.weight(t) for t in verdict.terms]
        self.top = max((abs(w) for w in weights), default=1.0) or 1.0

    def batch_part(self, term) -> tuple:
        return term.weight_power, tuple((i, q) for i, q in term.normalizers
                                        if i not in self.numbers)

    def weight(self, term) -> float:
        w = 1.0
        for i, q in term.normalizers:
            if i in self.numbers:
                w *= float(self.numbers[i]) ** q
        return w

    def factors(self, graph: fx.Graph, batch: fx.Node, normalizers: list, dtype,
                terms: list) -> list[fx.Node]:
        def call(target, *args, **kwargs):
            return graph.call_function(target, args, kwargs)

        one = call(aten.scalar_tensor.default, 1.0, dtype=torch.float64)
        target = call(aten.reciprocal.default, batch) if self.reduction == "mean" else one
        out = []
        for term in terms:
            power, norms = self.batch_part(term)
            b = call(aten.pow.Tensor_Scalar, batch, power)
            for i, q in norms:
                n = call(aten._to_copy.default, normalizers[i], dtype=torch.float64)
                b = call(aten.mul.Tensor, b, call(aten.pow.Tensor_Scalar, n, q))
            f = call(aten.div.Tensor, target, call(aten.mul.Tensor, b, self.top))
            ok = call(aten.logical_and.default, call(aten.isfinite.default, f),
                      call(aten.ne.Scalar, b, 0))
            out.append(call(aten._to_copy.default, call(aten.where.self, ok, f, one),
                            dtype=dtype))
        return out

    def graph(self, dynamo: fx.GraphModule, tail: list, loss: fx.Node) -> fx.GraphModule:
        """The loss's graph on placeholders for the program's inputs (the marked outputs
        first): its value is ``fn``'s, its gradient each example's own term's."""
        gm = fx.GraphModule(dynamo, fx.Graph())
        graph = gm.graph
        inputs = self.program.inputs
        env = {}
        for i, node in enumerate(inputs):
            env[node] = graph.placeholder(f"in_{i}")
            env[node].meta.update(example_value=_value(node))
        by_position = {i: env[n] for i, n in enumerate(inputs)}
        for i in range(len(inputs), len(self.program.placeholders)):
            by_position[i] = graph.call_function(
                aten.scalar_tensor.default, (self.program.value_of(i),), {"dtype": torch.float64})
        batch = graph.call_function(aten.scalar_tensor.default, (graph.call_function(
            aten.sym_size.int, (by_position[0], 0)),), {"dtype": torch.float64})
        normalizers = self._normalizers(gm, by_position)
        if len({self.batch_part(t) for t in self.verdict.terms}) <= 1:
            # one batch-dependent part for the whole loss: dynamo's own tail (its ops keep
            # their own backward formulas) times one factor
            for node in tail:
                env[node] = graph.node_copy(node, lambda a: env[a])
            value = env[loss]
            f, = self.factors(graph, batch, normalizers, _value(loss).dtype,
                              self.verdict.terms[:1] or [loss_scale.Term(0, ())])
            scaled = graph.call_function(aten.mul.Tensor, (value, f))
        else:
            # Note [Terms on their own scales] in loss/scale.py: the replayed tail, each term
            # times its own factor, the linear part above the terms computed again
            replayed = self.program.replayed
            renv = {ph: by_position[i]
                    for i, ph in enumerate(replayed.graph.find_nodes(op="placeholder"))}
            for node in replayed.graph.nodes:
                if node.op in ("call_function", "get_attr"):
                    renv[node] = _copy(gm, replayed, node, renv)
            value = renv[replayed.graph.find_nodes(op="output")[0].args[0]]
            by_name = {n.name: renv[n] for n in replayed.graph.nodes if n in renv}
            terms = [by_name[name] for name in self.verdict.term_nodes]
            factors = self.factors(graph, batch, normalizers, _value_of(value), self.verdict.terms)
            copies = {t: graph.call_function(aten.mul.Tensor, (t, f))
                      for t, f in zip(terms, factors)}
            copied = set(renv.values())
            above: set = set()
            for node in list(graph.nodes):
                if node in copied and any(a in above or a in copies
                                          for a in node.all_input_nodes):
                    above.add(node)
            for node in list(graph.nodes):
                if node in above:
                    copies[node] = graph.node_copy(node, lambda a: copies.get(a, a))
            scaled = copies.get(value, value)
        graph.output((_shown(graph, value, scaled),))
        for node in graph.nodes:
            if node.op != "placeholder":   # aot_autograd traces the graph again on its own
                for key in ("val", "tensor_meta", "example_value", "unbacked_bindings"):
                    node.meta.pop(key, None)
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
        return gm

    def _normalizers(self, gm: fx.GraphModule, by_position: dict) -> list:
        """The extracted normalizer graph's nodes copied into ``gm`` (its placeholders, by
        position, are ``by_position``)."""
        if self.extracted is None:
            return []
        phs = list(self.extracted.find_nodes(op="placeholder"))
        env = {ph: by_position[i] for i, ph in enumerate(phs)}
        for node in self.extracted.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                return [env[n] for n in node.args[0]]
            env[node] = _copy(gm, self.extracted.owning_module, node, env)
        return []


def _value_of(node: fx.Node) -> torch.dtype:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else torch.float32


def _copy(gm: fx.GraphModule, source: fx.GraphModule, node: fx.Node, env: dict) -> fx.Node:
    """``node`` of ``source`` copied into ``gm``, a constant it reads copied along."""
    if node.op == "get_attr":
        name = f"dpfx_loss_constant_{next(_CONSTANTS)}"
        setattr(gm, name, getattr(source, node.target))
        return gm.graph.get_attr(name)
    return gm.graph.node_copy(node, lambda a: env[a])


_CONSTANTS = itertools.count()


def _shown(graph: fx.Graph, loss: fx.Node, scaled: fx.Node) -> fx.Node:
    """The value of ``loss`` with the gradient of ``scaled``."""
    return graph.call_function(aten.add.Tensor, (scaled, graph.call_function(
        aten.detach.default, (graph.call_function(aten.sub.Tensor, (loss, scaled)),))))


# Note [An empty batch and the captured loss]
# With no example there is nothing to prove or scale: the release is the noise alone, whatever the
# loss computes. A loss's own checks on the batch size can also make dynamo decide a comparison
# (``numel() > 0`` inside F.cross_entropy on a (B, V, T) input) and capture a graph for B = 0,
# which Inductor then fails to lower. So ``DPModule.loss`` runs an empty batch through the
# model's own graph (the plain forward's entry, compiled once, the first time an empty batch
# comes), computes ``fn`` on its empty outputs for the value shown, and releases a zero
# gradient through the outputs: the backward graph adds the noise.
# (tests/loss/test_loss_graph.py::test_batch_sizes_compile_once_and_match_through_inductor_cold_and_warm)


# -- the release --------------------------------------------------------------------------------
class CapturedLoss(torch.Tensor):
    """The loss ``DPModule.loss`` returns: ``_dpfx_loss`` is (backend, the multiple of the
    captured loss it is)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in BACKWARD_CALLS:
            return _release(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            if func is _T.__repr__:
                return func(args[0].as_subclass(torch.Tensor), *args[1:], **kwargs)
            result = func(*args, **kwargs)
        if not isinstance(result, torch.Tensor) or not result.requires_grad:
            return result
        loss = next((a for a in args[:2] if isinstance(a, CapturedLoss)), None)
        if loss is None or (result is loss and not _in_place(func)):
            return result                           # .float(), .to(): the loss itself
        backend, multiple = loss._dpfx_loss
        k = _combined(func, args, kwargs, loss)
        if isinstance(k, float):
            result.__class__ = CapturedLoss         # fresh, or the loss itself (in place)
            result._dpfx_loss = (backend, multiple * k)
        else:
            backend.gate.left_capture(f"{k} ({_user_line()})")
            if result is loss:                      # changed in place: no longer the loss
                result.__class__ = torch.Tensor
        return result


# Note [Arithmetic that keeps the captured loss]
# The release is each example's gradient of its own term with every scalar after the batch
# reduction removed (Note [The per-example term] in loss/check.py), so a constant the loss is
# multiplied by (``loss / accum``, ``loss * torch.tensor(2.)``, Trainer's ``loss *= k``) changes
# nothing released, as in the plain loop; a constant added (``loss + 1.0``, ``loss - c``) has no
# gradient at all. The result of either stays a ``CapturedLoss`` whose multiple is the product
# of the scales (a shift keeps it; ``c - loss`` negates it), and its backward releases exactly
# what ``loss.backward()`` does, its sign kept (``_release`` refuses a zero multiple; See
# Note [A negative multiple of the captured loss]). A constant is a Python number or a 0-d
# tensor that needs no gradient (a negative one is refused), read with ``float`` when it is
# applied. Anything else (a tensor that needs a gradient, a weight per
# example, another op on the loss, in place or not) gives a plain tensor whose backward reaches
# dpfx's graph unproven; what happened is told to the gate (``ReleaseGate.left_capture``),
# which names it in its refusal. A term on the weights (``+ lam * sum(p.pow(2).sum() ...)``) is named with its fix,
# the optimizer's ``weight_decay = 2 * lam`` (Note [A weight penalty is the optimizer's]).
# (tests/loss/test_captured_arithmetic.py)
_T = torch.Tensor
_NEGATIONS = {_T.__neg__, _T.neg, _T.neg_, torch.neg}
_DIVISIONS = {_T.__truediv__, _T.__itruediv__, _T.div, _T.div_, torch.div}
_SCALING = {_T.__mul__, _T.__rmul__, _T.__imul__, _T.mul, _T.mul_, torch.mul} | _DIVISIONS
_ADDITIONS = {_T.__add__, _T.__radd__, _T.__iadd__, _T.add, _T.add_, torch.add}
_SUBTRACTIONS = {_T.__sub__, _T.__isub__, _T.sub, _T.sub_, torch.sub, torch.subtract}
_REVERSED = {_T.__rsub__, torch.rsub}      # args[1] - alpha * args[0]
_SAME = {_T.mean, _T.sum, torch.mean, torch.sum}


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or (
        name.startswith("__i") and name.endswith("__"))


def _combined(func, args, kwargs, loss) -> float | str:
    """The multiple of the captured ``loss`` that ``func(*args, **kwargs)`` is (Note [Arithmetic
    that keeps the captured loss]), or what it did to the loss instead."""
    name = getattr(func, "__name__", str(func))
    if func in _NEGATIONS:
        return -1.0
    if func in _SAME and len(args) == 1 and not kwargs and loss.dim() == 0:
        return 1.0       # Trainer's loss.mean() over devices, of the one loss
    shift = func in _ADDITIONS | _SUBTRACTIONS | _REVERSED
    if not (shift or func in _SCALING) or len(args) != 2:
        return (f"`{name}` of the captured loss: only a constant multiple of it plus a constant "
                f"is released. Build the whole objective inside the loss function")
    first = args[0] is loss
    other = args[1] if first else args[0]
    if other is loss:
        return (f"`{name}` of the captured loss with itself: write the objective inside the loss "
                f"function")
    c = _constant(other, name)
    if isinstance(c, str):
        return c
    if shift:
        alpha = kwargs.get("alpha", 1)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            return f"`{name}` with alpha={alpha!r}: use a Python number"
        if func in _ADDITIONS:
            return 1.0 if first else float(alpha)
        if func in _SUBTRACTIONS:
            return 1.0 if first else -float(alpha)
        return -float(alpha) if first else 1.0
    if isinstance(other, torch.Tensor) and c < 0:
        return f"`{name}` of the captured loss with a tensor of value {c}: {NEGATIVE_TENSOR}"
    if func in _DIVISIONS:
        if not first:
            return "a constant divided by the captured loss: only a multiple of it is released"
        if c == 0 or kwargs.get("rounding_mode") is not None:
            return f"the captured loss divided by {c} (rounding {kwargs.get('rounding_mode')})"
        return 1.0 / c
    return c


# See Note [A negative multiple of the captured loss]
NEGATIVE_TENSOR = (
    "dpfx cannot tell a negative constant in a tensor from a statistic of the batch, whose sign "
    "would flip every example's gradient. Write the sign as a Python number or a negation "
    "(`-loss`, `-0.5 * loss`)")


def _constant(other, name: str) -> float | str:
    """``other`` as the constant it is, or why it is not one."""
    if isinstance(other, (int, float)) and not isinstance(other, bool):
        return float(other)
    if not isinstance(other, torch.Tensor) or other.is_complex() or other.dtype == torch.bool:
        return f"`{name}` of the captured loss with {type(other).__name__} {other!r}"
    if other.requires_grad:
        return _needs_grad(other, name)
    if other.dim() != 0:
        return (f"`{name}` of the captured loss with a tensor of shape {tuple(other.shape)}: a "
                f"weight per example (or per row) changes each example's term; weight the "
                f"examples inside the loss function, which dpfx proves")
    return float(other.detach())


# Note [A weight penalty is the optimizer's]
# ``loss + lam * sum(p.pow(2).sum() ...)``: the penalty's gradient 2 lam p reads no example, but
# autograd would accumulate it into p.grad beside the release, where the gate cannot tell it from
# a gradient of the data (a penalty scaled by a statistic of the batch reads one, invisibly: the
# statistic is a constant of the autograd graph). So the penalty is refused, in the captured
# loss at its backward (``_needs_grad`` finds parameters and no dpfx forward in its autograd
# graph), in the loss function at capture (``_stand_in``) and in the plain loop by the walk of
# the loss's autograd graph at its backward (loss/backward.py), each naming the optimizer's
# weight decay, which is post-processing of the release: SGD and Adam add ``weight_decay * p``
# to the gradient they step on, the gradient of
# weight_decay / 2 * ||p||^2, so weight_decay = 2 lam gives the release plus exactly 2 lam p.
# (tests/loss/test_captured_arithmetic.py::test_weight_decay_is_the_penalty)
def _needs_grad(other: torch.Tensor, name: str) -> str:
    """Why a term that needs a gradient cannot join the captured loss: the graph it reaches."""
    seen, todo, leaves, forwards = set(), [other.grad_fn], 0, 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kind = type(node).__name__
        leaves += kind == "AccumulateGrad"
        forwards += kind == "CompiledFunctionBackward"
        todo.extend(n for n, _ in node.next_functions)
    if leaves and not forwards:
        return (f"`{name}` of the captured loss with a term computed from trainable tensors "
                f"outside dpfx's forward (the model called directly, or a weight penalty such as "
                f"lam * sum(p.pow(2).sum() for p in model.parameters())): its gradient would "
                f"reach p.grad unclipped. For lam * "
                f"||p||^2 use the optimizer's weight_decay = 2 * lam (torch.optim.SGD and Adam "
                f"add weight_decay * p to the released gradient, the gradient of weight_decay / "
                f"2 * ||p||^2); AdamW's decoupled decay is another rule")
    return (f"`{name}` of the captured loss with a tensor that needs a gradient (another "
            f"forward's output or loss, a tensor of yours): each forward is clipped on its own. "
            f"Build the whole objective inside the loss function, from one forward")


def _user_line() -> str:
    """The caller's line outside dpfx and torch, for the refusal."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/dpfx/" not in frame.filename and "/torch/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return "line unknown"


def captured(loss: torch.Tensor, backend) -> CapturedLoss:
    """The compiled graph's fresh loss tensor, retyped in place (``as_subclass`` would put an
    alias node into every backward)."""
    loss.__class__ = CapturedLoss
    loss._dpfx_loss = (backend, 1.0)
    return loss


def _release(func, args, kwargs):
    if func is _T.backward and len(args) == 1 and kwargs.get("gradient") is None and \
            args[0]._dpfx_loss[1] == 1.0 and kwargs.keys() <= BACKWARD_KWARGS:
        # loss.backward(): the common call, without inspect's binding (Tensor.backward hands
        # its defaults on as keywords). The implicit gradient of a scalar is the 1 given below.
        with args[0]._dpfx_loss[0].gate.proven(), torch._C.DisableTorchFunctionSubclass():
            return func(args[0], **kwargs)
    bound = BACKWARD_SIGNATURES[func].bind(*args, **kwargs)
    params = bound.arguments
    loss_name, grad_name = BACKWARD_CALLS[func]
    roots = params[loss_name]
    roots = [roots] if isinstance(roots, torch.Tensor) else list(roots)
    if len(roots) != 1 or not isinstance(roots[0], CapturedLoss):
        raise PrivacyError("backward of a loss captured with dpfx.compile(loss=...) takes that "
                           "loss alone: build the whole objective inside the loss function")
    root = roots[0]
    backend, k = root._dpfx_loss
    given = params.get(grad_name)
    if given is not None:
        given = given[0] if isinstance(given, (tuple, list)) else given
        if float(given) < 0:
            raise PrivacyError(
                f"backward of the captured loss with gradient={float(given)}: {NEGATIVE_TENSOR}. "
                f"Nothing was released.")
        k = k * float(given)
    if not (k > 0 or k < 0):
        raise PrivacyError(
            f"the captured loss was multiplied by {k} before its backward: its gradient is "
            f"zero, and the captured graph computes the loss's gradient itself, so it has no "
            f"zero to release. Skip the step (the plain loop's `0 * loss` releases the noise "
            f"alone), or multiply by a nonzero constant. Nothing was released.")
    with torch._C.DisableTorchFunctionSubclass():
        # the gradient that reaches the captured loss is exactly 1, which the backward graph
        # reads as the constant it is (Note [The loss inside the graph], step 4); a negative
        # multiple's sign is the release's (Note [A negative multiple of the captured loss])
        params[grad_name] = torch.full((), 1.0 / root._dpfx_loss[1], dtype=root.dtype,
                                       device=root.device)
        with backend.gate.proven(sign=1.0 if k > 0 else -1.0,
                                 accumulates=func is not torch.autograd.grad):
            return func(*bound.args, **bound.kwargs)


# Note [A negative multiple of the captured loss]
# ``(-dp.loss(x, y)).backward()``, ``(-0.5 * loss / accum).backward()``: gradient ascent, a
# log-likelihood or a reward maximized. The magnitude of the multiple is removed as every
# constant is (Note [Arithmetic that keeps the captured loss]); its sign stays, as it stays in
# the plain loop, where ``-loss`` starts the backward at -1 and each example's gradient is
# -g_i, clipped to -clip(g_i). The captured graph reads its loss's tangent as the constant 1
# (Note [The loss inside the graph], step 4), so the sign cannot enter there: the backward runs
# inside ``gate.proven(sign=-1)`` and the backward graph's runner (backend/runtime.py) negates
# the gradients the graph released before autograd accumulates them. The release is then
# -(sum_i clip(g_i) + N(0, sigma^2 C^2 I)) / D: noise drawn once, of the same distribution
# (the Gaussian is symmetric), sensitivity C, what the plain loop releases. With
# noise="optimizer" the runner negates the clipped sum, and the optimizer adds the noise and
# divides by D as for any release. The sign must be a constant: one that depends on the batch
# would let one example flip every example's gradient (a release that moves by 2BC). It comes
# from the loss's arithmetic (``-loss``, ``c - loss``) or a Python number; a negative tensor
# (``loss * torch.tensor(-1.)``, ``backward(gradient=...)``) is refused, as dpfx cannot tell it
# from a statistic of the batch, while a positive one is removed whatever it is. A Python number
# taken out of the batch's tensors (``float(y.float().mean() - 0.5)``) is taken as the constant
# it is on that step, as everywhere (docs/losses.md). A zero multiple is refused: the graph
# cannot release the zero gradient it has (the plain loop's ``0 * loss`` releases the noise
# alone).
# (tests/loss/test_loss_sign.py)




