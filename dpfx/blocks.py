"""Per-block private graphs: a repeated block of the model compiled once, called as one op.

A deep model is mostly the same block many times (a decoder layer). ``compile_block`` captures
one instance with a symbolic batch, proves its forward keeps examples apart, rewrites its
backward per sample and splits it at the clip coefficient (``passes/block.py``), lowers the
three graphs with Inductor and registers them under a key (``ops/blocks.py``). Every block with
the same class, parameter and buffer shapes and the same non-tensor call arguments shares that
key: the capture, the rewrite, the proof and the lowering run once per distinct block, not once
per layer. ``install`` makes each instance's ``forward`` call ``dpfx::block_fwd`` with its own
tensors, so a graph captured around the blocks holds one op per block, not its layers. Only
the compiling model's private forward takes that path; any other call of the block runs its own
forward (Note [Only dpfx's own forward calls a compiled block]).

    dpfx.compile(model, ..., blocks="auto")   # prepare() at the first call, then as ever

# Note [Per-block private graphs]
The model's own graph (embeddings, head, loss) is captured, rewritten, proven and self-checked
as before; each block call in it is one ``dpfx::block_fwd`` in the forward and, in the backward,
one ``dpfx::block_bwd`` (input gradients, the block parameters' squared per-sample norms, the
book-keeping operands) and one ``dpfx::block_grad`` per call. The per-sample rewrite treats
``block_grad`` as the frontier of the block's parameters (rules/block.py): their norms join
the model's norm sum, the model's one clip factor (per group) scales them through
``dpfx::block_clip``, and the noise is added once, by the model's graph, as for any other
parameter. The proof is in two parts: the block's (passes/block.verify_block: each of its
clipped sums is scaled by its coefficient input and masked by its finite input, over operands
its norm is taken over) and the model's (passes/verify.py, Note [A block's clipped sums]:
those inputs are this graph's clip coefficient and mask for the parameter's group, the operands
are one block call's, and that call's norm row is in the factor's norm).

Which tensors carry the batch: the model runs eagerly twice first, at 2 and at 3 examples (the
user's rows repeated), under ``torch.compiler.is_compiling()`` so that its code takes the path it
takes under dynamo; a block argument whose dim 0 follows (2, 3) carries the batch, one whose
shape stays is shared by every example (and may not need a gradient), anything else is refused.

Book-keeping, not a second backward: part A keeps each block's operands (its layers' inputs and
output gradients, or a materialized per-sample gradient) until the model's factor is known, then
part B forms the clipped sums. Opacus's alternative for sharded models (a second backward with
the loss reweighted by the factors) recomputes every block's backward; book-keeping costs the
operands' memory until the end of the backward instead. Measured figures are in BENCHMARKS.md.

A block that is an FSDP2 unit keeps its parameters sharded outside its ops and hands its
clipped sums to a reduce-scatter (Note [Sharded blocks] in loop/fsdp.py).

Not yet: blocks that draw random numbers in training (dropout), arguments other than tensors
and constants in the private forward (a key/value cache that already holds positions; an empty
one is dropped: Note [An empty cache is no argument]), a block used more than once (Note [A
block used more than once is refused]).
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import unittest.mock
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._inductor.compile_fx import compile_fx

from dpfx.backend import DPBackend, _descs, _input_index
from dpfx.capture.entry import BatchMarked, DynamoSettings, HeapFrozen
from dpfx.capture.traceable import Captured
from dpfx.config import DPConfig
from dpfx.errors import CaptureError, DPFXError
from dpfx.lower.cpu_builds import finish_builds
from dpfx.lower.fast import optimization_hints_once
from dpfx.lower.inductor import inductor_patches, lower
from dpfx.lower.selfcheck import _has_random_ops
from dpfx.ops.blocks import KERNELS, PLACES, Kernels, kernels
from dpfx.passes import compile_forward
from dpfx.passes.block import block_backward, norm_rows

_CAPTURES = itertools.count()


def block_signature(block: torch.nn.Module, args: tuple, kwargs: dict, batched: set[int]
                    ) -> tuple:
    """What two blocks must share to share one compiled graph."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    shapes = tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                   for n, p in block.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers())
    call = tuple((tuple(x.shape[1:]) if i in batched else tuple(x.shape), x.dtype,
                  x.requires_grad, i in batched) if isinstance(x, torch.Tensor) else ("const", x)
                 for i, x in enumerate(leaves))
    return (type(block), str(spec), shapes, buffers, call)


class _Capture(DPBackend):
    """DPBackend for one block: no loss, the block's backward split instead of clip and noise."""

    def __init__(self, block, config, args: list[torch.Tensor], batched: set[int],
                 params: list[str], rows: list[int] | None):
        from dpfx.loss.gate import ReleaseGate
        super().__init__(block, config, ReleaseGate())
        self.position = {id(t): i for i, t in enumerate(args)}
        self.batched = batched
        self.params = params
        self.rows = rows
        self.name = type(block).__name__
        self.result = None

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Any:
        self.dynamo_inputs = []
        kinds = []
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                if id(x) not in self.position:
                    raise CaptureError(f"the block reads a tensor that is neither an argument, a "
                                       f"parameter nor a buffer of it (shape {tuple(x.shape)})")
                pos = self.position[id(x)]
                self.dynamo_inputs.append(("arg", pos))
                kinds.append("input" if pos in self.batched else
                             "param:" + self.param_names[id(x)] if id(x) in self.param_names
                             else "constant")
            else:
                self.dynamo_inputs.append(("size", None))
                kinds.append("symint")
        self._input_kinds = kinds
        self._targets = set()
        with torch._functorch.config.patch(enable_autograd_cache=False,
                                           force_non_lazy_backward_lowering=True,
                                           ban_recompute_reductions=True), \
                optimization_hints_once():
            return compile_fx(gm, example_inputs, inner_compile=self._inner_block,
                              config_patches=inductor_patches(example_inputs))

    def _inner_block(self, gm: fx.GraphModule, example_inputs: list, **kwargs) -> Any:
        if kwargs.get("is_backward"):
            return self._block_backward(gm, example_inputs, kwargs)
        return self._block_forward(gm, example_inputs, kwargs)

    def _block_forward(self, gm, example_inputs, kwargs):
        batch_inputs = {}
        spec = []
        for node in gm.graph.find_nodes(op="placeholder"):
            idx = _input_index(node)
            kind, pos = self.dynamo_inputs[idx] if idx is not None else ("size", None)
            if kind == "size":
                pos = _size_expr(node.meta["val"])
            spec.append((kind, pos))
            if kind == "arg" and pos in self.batched:
                batch_inputs[node.name] = 0
        self.fw_info = compile_forward(gm, batch_inputs, self.stages)
        if _has_random_ops(gm):
            raise CaptureError(
                f"dpfx: block {self.name} draws random numbers in its forward (dropout while "
                f"training); a compiled block cannot yet, since the self-check would compare "
                f"two draws. Set its dropout to 0, or compile without blocks")
        self.fw_spec = spec
        self.fw_names = {n.name: s for n, s in zip(gm.graph.find_nodes(op="placeholder"), spec)}
        output = gm.graph.find_nodes(op="output")[0]
        outs = list(output.args[0])
        descs = _descs(output, len(outs))
        self.num_outputs = sum(1 for d in descs if "SavedForBackwards" not in type(d).__name__)
        self.saved = []          # block_fwd's outputs after the user's: (fw output index)
        self.saved_names = {}    # fw output node name -> ("arg", pos) | ("saved", k) | ("size",)
        for i, o in enumerate(outs[self.num_outputs:], self.num_outputs):
            if not isinstance(o, fx.Node):
                continue
            if o.op == "placeholder":
                self.saved_names[o.name] = self.fw_names[o.name]
            elif isinstance(o.meta.get("val"), torch.Tensor):
                self.saved_names[o.name] = ("saved", len(self.saved))
                self.saved.append(i)
            else:
                self.saved_names[o.name] = ("size", _size_expr(o.meta["val"]))
        self.fw_layouts = [self.fw_info.layouts.get(o.name) for o in outs[:self.num_outputs]] + \
            [self.fw_info.layouts.get(outs[i].name) for i in self.saved]
        self.fw_fake = copy.deepcopy(gm)
        compiled = lower(gm, example_inputs, kwargs, self.config.backend)
        self.fw_compiled = compiled
        return compiled

    def _block_backward(self, gm, example_inputs, kwargs):
        output = gm.graph.find_nodes(op="output")[0]
        param_outputs = {}
        arg_of_output = {}
        for i, desc in enumerate(_descs(output, len(output.args[0]))):
            idx = getattr(getattr(desc, "grad_of", None), "idx", None)
            if idx is None or output.args[0][i] is None:
                continue
            kind = self._input_kinds[idx]
            if kind.startswith("param:"):
                param_outputs[i] = kind[len("param:"):]
            else:
                arg_of_output[i] = self.dynamo_inputs[idx][1]
        tangents = {}
        for node in gm.graph.find_nodes(op="placeholder"):
            desc = node.meta.get("desc")
            out_idx = getattr(getattr(desc, "output", None), "idx", None)
            if type(desc).__name__ == "TangentAOTInput" and out_idx is not None:
                tangents[node.name] = out_idx
        reads = []
        for node in gm.graph.find_nodes(op="placeholder"):
            if node.name in tangents:
                reads.append(("grad", tangents[node.name]))
            elif node.name in self.saved_names:
                reads.append(self.saved_names[node.name])
            elif node.name in self.fw_names:
                reads.append(self.fw_names[node.name])
            else:
                raise CaptureError(f"the block's backward reads {node.name}, which its forward "
                                   f"does not save")
        self.param_dtypes = {name: output.args[0][i].meta["val"].dtype
                             for i, name in param_outputs.items()}
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        result = block_backward(gm, self.fw_info, param_outputs, tangents, self.params,
                                self.config, fake_mode, self.rows)
        a_inputs = [n.meta["val"] for n in result.part_a.graph.find_nodes(op="placeholder")]
        b_inputs = [n.meta["val"] for n in result.part_b.graph.find_nodes(op="placeholder")]
        self.part_a_fake = copy.deepcopy(result.part_a)
        self.part_b_fake = copy.deepcopy(result.part_b)
        with _no_donated_inputs():
            self.part_a = lower(result.part_a, a_inputs, dict(kwargs), self.config.backend)
            b_kwargs = {k: v for k, v in kwargs.items() if k != "static_input_idxs"}
            self.part_b = lower(result.part_b, b_inputs, b_kwargs, self.config.backend)
        self.result = result
        self.reads = reads
        self.grad_inputs = [arg_of_output[i] for i in result.input_grads]

        def unused(args):
            raise RuntimeError("dpfx: a block's backward runs through dpfx::block_bwd")

        unused._boxed_call = True
        return unused


# Note [A block's backward donates no input]
# aot_autograd marks the backward's saved tensors that nothing reads after the backward as
# donated (``bw_donated_idxs``, by placeholder index), and Inductor then writes later buffers
# into them. Parts A and B are not that backward: their placeholders are another list (a donated
# index names some other tensor of part A), and part B and the self-check read what part A read
# (a saved activation is an operand of a clipped sum). With the donation kept, part A wrote a
# LayerNorm block's tanh gradient into the saved pre-activation, which part B would have read
# had a rule taken it as an operand: a clipped sum of values the norm never saw. Both parts are
# lowered with no input donated. (tests/loss/test_loss_corpus.py::
# test_per_example_losses_through_blocks; tests/test_blocks.py::
# test_a_blocks_backward_writes_into_none_of_its_inputs)
@contextlib.contextmanager
def _no_donated_inputs():
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is None:
        yield
        return
    kept = meta.bw_donated_idxs
    meta.bw_donated_idxs = []
    try:
        yield
    finally:
        meta.bw_donated_idxs = kept


def _size_expr(val) -> Any:
    import sympy

    return sympy.sympify(val.node.expr) if isinstance(val, torch.SymInt) else sympy.Integer(val)


def _evaluate(expr, batch) -> Any:
    """``expr``, a polynomial in the one batch symbol (or a max or min of them), at ``batch``
    (an int or a SymInt)."""
    import sympy
    from torch.utils._sympy.functions import Max, Min

    if expr.is_Integer:
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        return batch
    parts = [_evaluate(a, batch) for a in expr.args]
    if isinstance(expr, sympy.Mul):
        out = parts[0]
        for p in parts[1:]:
            out = out * p
        return out
    if isinstance(expr, sympy.Add):
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and expr.exp > 0:
        return parts[0] ** int(expr.exp)
    if isinstance(expr, (Max, Min)):     # a stride of a dim that may be empty
        pick = torch.sym_max if isinstance(expr, Max) else torch.sym_min
        out = parts[0]
        for p in parts[1:]:
            out = pick(out, p)
        return out
    raise CaptureError(f"a dpfx block's graph needs the size {expr}, which is not a polynomial "
                       f"in the batch size")


def _batch_of(tensors: list, positions) -> Any:
    for pos in positions:
        return tensors[pos].shape[0]
    raise CaptureError("a dpfx block needs at least one argument with the batch in dim 0")


def _batch_of_reads(kinds: list, reads: list, batched) -> Any:
    """The batch size of part A's reads ``reads`` (of kinds ``kinds``): an output gradient's
    dim 0, else a batched argument's."""
    for (kind, _), t in zip(kinds, reads):
        if kind == "grad" and t.dim():
            return t.shape[0]
    for (kind, i), t in zip(kinds, reads):
        if kind == "arg" and i in batched:
            return t.shape[0]
    raise CaptureError("a dpfx block's backward reads no tensor with the batch in dim 0")


def compile_block(block: torch.nn.Module, args: tuple, kwargs: dict, batched: set[int],
                  config: DPConfig, groups: list[str] | None = None) -> str:
    """Capture, prove and lower ``block`` called as ``block(*args, **kwargs)``; returns the key
    of its ``dpfx::block_*`` ops. ``batched``: positions, among the call's flattened leaves,
    of the tensors whose dim 0 is the batch; ``groups``: each trainable parameter's clipping
    group, in ``named_parameters`` order (its norm rows: Note [One norm row per clipping
    group] in passes/block.py; None: a row per parameter)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensor_of = {i: k for k, i in enumerate(positions)}
    call_tensors = [leaves[i] for i in positions]
    trainable = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
    constants = [t for _, t in block.named_parameters() if not t.requires_grad] + \
        [b for _, b in block.named_buffers()]
    params = [n for n, _ in trainable]
    # op argument order: call tensors, trainable parameters, frozen parameters and buffers
    op_args = call_tensors + [p for _, p in trainable] + constants
    batched_args = {tensor_of[i] for i in batched}
    capture = _Capture(block, config, op_args, batched_args, params,
                       norm_rows(groups, len(params)) if groups is not None else None)

    # the example call: detached copies, so nothing of the capture reaches the user's tensors.
    # Every floating batched argument asks for its gradient: the key serves the first block
    # (whose input may be data) and the later ones alike. An argument without the batch that
    # wants a gradient (a learned table passed to every block) would get one summed over the
    # examples, which no clip bounds: refused.
    for k, t in enumerate(call_tensors):
        if k not in batched_args and t.requires_grad:
            raise CaptureError(
                f"dpfx: block {type(block).__name__} is called with a tensor of shape "
                f"{tuple(t.shape)} that has no batch dim and requires grad; its gradient would "
                f"sum every example's. Compute it inside the block from its parameters, or "
                f"detach it.")
    example = [t.detach().clone().requires_grad_(k in batched_args and t.is_floating_point())
               for k, t in enumerate(call_tensors)]

    def call(*tensors):
        filled = list(leaves)
        for i, t in zip(positions, tensors):
            filled[i] = t
        a, kw = pytree.tree_unflatten(filled, spec)
        return block(*a, **kw)

    capture.position.update({id(t): k for k, t in enumerate(example)})
    # its own code object, so that dynamo consults no cache entry of another block's capture
    # (Note [dpfx's own entry frame] in capture/entry.py)
    call.__code__ = call.__code__.replace(co_name=f"dpfx_block_{next(_CAPTURES)}")
    fn = torch.compile(call, backend=capture, fullgraph=True, dynamic=False)
    with HeapFrozen(), DynamoSettings(), Captured(), \
            BatchMarked([example[k] for k in sorted(batched_args)]):
        try:
            fn(*example)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if isinstance(e.inner_exception, DPFXError):
                raise e.inner_exception.with_traceback(None) from None
            raise CaptureError(
                f"dpfx: block {type(block).__name__} could not be compiled "
                f"({type(e.inner_exception).__name__}: {_first_line(e.inner_exception)}); "
                f"compile without blocks") from e
        except torch._dynamo.exc.Unsupported as e:
            raise CaptureError(
                f"dpfx: block {type(block).__name__} could not be captured as one graph "
                f"({_first_line(e)}); compile without blocks") from e
    if getattr(capture, "result", None) is None:
        raise CaptureError(f"dpfx: dynamo did not hand block {type(block).__name__} to dpfx's "
                           f"compiler (a graph break or a cache entry of another compile); "
                           f"compile without blocks")

    # Note [A block's key names its graphs]: the same block compiled in another process (a
    # warm start) gets the same key, and the model graph cached with it calls the same graphs
    digest = hashlib.sha256("\n".join(
        [config.backend, capture.fw_fake.code, capture.part_a_fake.code,
         capture.part_b_fake.code, repr(params)]).encode()).hexdigest()[:16]
    key = f"{type(block).__name__}_{digest}"
    kernels = _kernels(capture, type(block).__name__, params, len(call_tensors),
                       sorted(batched_args))
    if config.backend == "inductor" and config.self_check is not False:
        _self_check(kernels, call_tensors, batched_args, op_args[len(call_tensors):],
                    capture.fw_info.batch_symbols)
    KERNELS[key] = kernels
    return key


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# Note [A block's key names its graphs]
# A model graph holds its blocks' keys as strings, and torch's caches (AOTAutogradCache,
# Inductor's FX-graph cache) key the model graph on them. A key is therefore the hash of what
# the block's ops run: its three graphs' code, its parameters' names and the backend. A second
# process compiling the same block registers the same key before its model graph is looked up,
# so a warm start finds it; a block whose graphs differ (another strategy, another dpfx) gets
# another key, so no cached model graph calls graphs other than those it was proven with.


# Note [A block's self-check]
# The model graph's self-check (lower/selfcheck.py) runs the block ops' compiled kernels on both
# of its sides, so it cannot see a block's own lowering. Each block's three compiled graphs are
# therefore checked when it is compiled, at 2 and 3 examples (the probe's rows repeated, floating
# inputs random): each against its FX graph (the graph the proof read), the forward and part A
# for independence (example 0's inputs and output gradient changed, every other example's rows
# of every batched output unchanged), and part B for the mask (example 0 with coefficient 0 and
# mask off, its operands changed: the clipped sums unchanged).
def _self_check(k: Kernels, call_tensors: list, batched: set[int], rest: list,
                batch_symbols: set) -> None:
    from dpfx.errors import PrivacyError
    from dpfx.graph.batch import BatchDim
    from dpfx.lower.selfcheck import _close, _compare, _other_examples
    from dpfx.ops.blocks import operands

    finish_builds()     # Note [A graph's C++ builds run while the next graph lowers]
    g = torch.Generator().manual_seed(0)

    def changed(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[0] = t[1] if not t.is_floating_point() else t[0] + torch.randn(
            t[0].shape, generator=g).to(t)
        return t

    def changed_at(t: torch.Tensor, lay, b: int) -> torch.Tensor:
        """``t`` with example 0's entries changed, its dim ``lay.dim`` (outer, B, inner)."""
        sizes = {s: b for s in batch_symbols}
        from dpfx.lower.selfcheck import _concrete
        outer, inner = _concrete(lay.outer, sizes), _concrete(lay.inner, sizes)
        t = t.clone()
        split = t.view(*t.shape[:lay.dim], outer, b, inner, *t.shape[lay.dim + 1:])
        row = split.select(lay.dim + 1, 0)
        if t.is_floating_point():
            row.add_(torch.randn(row.shape, generator=g).to(row))
        else:
            row.copy_(split.select(lay.dim + 1, 1))
        return t

    # each of part B's operands' layout: a part A output's, or that of what part A read
    def read_layout(kind, i):
        if kind == "arg":
            return BatchDim(0) if i in batched else None
        return k.forward_layouts[k.num_outputs + i] if kind == "saved" else k.forward_layouts[i]

    operand_layouts = [k.backward_layouts[i] if kind == "out" else read_layout(*k.backward_reads[i])
                       for kind, i in k.operands]

    def independent(which, b, layouts, before, after):
        sizes = {s: b for s in batch_symbols}
        for i, (lay, x, y) in enumerate(zip(layouts, before, after)):
            if isinstance(lay, BatchDim) and not _close(_other_examples(x, lay, b, sizes),
                                                        _other_examples(y, lay, b, sizes), 1e-5):
                raise PrivacyError(
                    f"dpfx's self-check of block {k.name}: changing example 0 changed other "
                    f"examples of {which} output {i} at batch size {b}. The code Inductor "
                    f"generated mixes examples (a torch bug); dpfx refuses to train with it. "
                    f"Use backend='eager', or compile without blocks, and report this with "
                    f"your torch version.")

    with torch.no_grad():
        for b in (2, 3):
            args = [(_resized(t, b) if i in batched else t) for i, t in enumerate(call_tensors)]
            args = [torch.randn(a.shape, generator=g).to(a) if i in batched
                    and a.is_floating_point() else a for i, a in enumerate(args)] + list(rest)
            got = k.forward(args)
            names = [f"{k.name} forward output {i}" for i in range(len(got))]
            _compare(f"block {k.name} forward", b, names, got, k.fake_forward(args))
            again = k.forward([changed(a) if i in batched else a for i, a in enumerate(args)])
            independent("forward", b, k.forward_layouts, got, again)

            grads = [torch.randn(o.shape, generator=g).to(o) for o in got[:k.num_outputs]]

            def reads_of(args, got, grads):
                return [args[i] if kind == "arg" else got[k.num_outputs + i] if kind == "saved"
                        else grads[i] for kind, i in k.backward_reads]

            reads = reads_of(args, got, grads)
            part_a = k.backward(reads)
            names = [f"{k.name} part A output {i}" for i in range(len(part_a))]
            _compare(f"block {k.name} backward (part A)", b, names, part_a,
                     k.fake_backward(reads))
            args2 = [changed(a) if i in batched else a for i, a in enumerate(args)]
            again = k.backward(reads_of(args2, k.forward(args2), [changed(t) for t in grads]))
            independent("part A", b, k.backward_layouts, part_a, again)

            ops = operands(k, reads, part_a)
            coefs = [torch.rand(b, generator=g) + 0.5 for _ in k.params]
            keeps = [torch.ones(b, dtype=torch.bool) for _ in k.params]
            part_b = k.clip(coefs, keeps, ops)
            names = [f"{k.name} clipped sum {p}" for p in k.params]
            _compare(f"block {k.name} clipped sums (part B)", b, names, part_b,
                     k.fake_clip(coefs, keeps, ops))
            for c, m in zip(coefs, keeps):
                c[0], m[0] = 0.0, False
            masked = k.clip(coefs, keeps, ops)
            rows = [changed_at(t, lay, b) if isinstance(lay, BatchDim) else t
                    for t, lay in zip(ops, operand_layouts)]
            for name, x, y in zip(k.params, masked, k.clip(coefs, keeps, rows)):
                if not _close(x, y, 1e-5):
                    raise PrivacyError(
                        f"dpfx's self-check of block {k.name}: the clipped sum of {name} moved "
                        f"with example 0's operands although its coefficient was 0 and its mask "
                        f"off, at batch size {b}. dpfx refuses to train with this code; use "
                        f"backend='eager', or compile without blocks, and report this with your "
                        f"torch version.")


def _unaliased(outs, inputs) -> list:
    """``outs`` with every output that shares memory with an input or an earlier output
    copied: a custom op's outputs are new tensors (a saved view of the block's input, two views
    of one activation)."""
    seen = {_storage(t) for t in inputs if isinstance(t, torch.Tensor)}
    result = []
    for o in outs:
        key = _storage(o)
        if key in seen:     # the same strides: the graphs that read it were compiled so
            o = _laid_out(o, o.stride())
            key = _storage(o)
        seen.add(key)
        result.append(o)
    return result


def _storage(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (views share it, empty ones too)."""
    return t.untyped_storage()._cdata


# Note [A block op's shapes come from its graphs' metadata]
# A block op's fake implementation is asked for its outputs by dynamo, the joint trace and
# Inductor's lowering at every block call. Running the block's graph on fake tensors there would
# make the model's lowering grow with its depth, several times over; and the ops' fake calls
# have no saved activations to run part A's graph on (Note [A block's own tensors stay out of
# the model's graph] in ops/blocks.py). Each output's shape and strides are polynomials in the
# block's batch symbol, read from its graph once, so a fake call evaluates them at the call's
# batch size and returns empty tensors laid out alike: what the graph run would return.
def _output_metadata(gm: fx.GraphModule, count: int | None = None) -> list:
    """(shape, strides, dtype) of ``gm``'s first ``count`` outputs, sizes as polynomials in the
    batch symbol."""
    outs = gm.graph.find_nodes(op="output")[0].args[0]
    return [([_size_expr(x) for x in o.meta["val"].shape],
             [_size_expr(x) for x in o.meta["val"].stride()], o.meta["val"].dtype)
            for o in outs[:count]]


def _empty_at(metadata: list, batch, device) -> list:
    return [torch.empty_strided([_evaluate(e, batch) for e in shape],
                                [_evaluate(e, batch) for e in stride], dtype=dtype, device=device)
            for shape, stride, dtype in metadata]


def _kernels(c: _Capture, name: str, params: list[str], num_inputs: int,
             batched: list[int]) -> Kernels:
    num_outputs = c.num_outputs
    result = c.result
    op_reads = [r for r in c.reads if r[0] != "size"]
    a_names = [n.name for n in c.part_a_fake.graph.find_nodes(op="placeholder")]
    op_index = {name: k for k, name in enumerate(
        n for n, r in zip(a_names, c.reads) if r[0] != "size")}
    sources = [("out", k) if kind == "out" else ("in", op_index[k])
               for kind, k in result.operands]

    def fw_inputs(args):
        batch = _batch_of(args, batched)
        return [args[pos] if kind == "arg" else _evaluate(pos, batch) for kind, pos in c.fw_spec]

    def split_fw(outs):
        return list(outs[:num_outputs]) + [outs[i] for i in c.saved]

    fw_strides = _strides_of(c.fw_fake)
    a_strides = _strides_of(c.part_a_fake)
    b_strides = _strides_of(c.part_b_fake)

    def forward(args):
        inputs = _conformed(fw_inputs(args), fw_strides, _batch_of(args, batched))
        return _unaliased(split_fw(c.fw_compiled(inputs)), args)

    def fake_forward(args):
        inputs = _conformed(fw_inputs(args), fw_strides, _batch_of(args, batched))
        return _unaliased(split_fw(c.fw_fake(*inputs)), args)

    def a_batch(reads):
        for r, t in zip(op_reads, reads):
            if r[0] == "grad" and t.dim():
                return t.shape[0]
        return None

    def a_inputs(reads):
        batch = a_batch(reads)
        it = iter(reads)
        return [_evaluate(r[1], batch) if r[0] == "size" else next(it) for r in c.reads]

    def backward(reads):
        inputs = _conformed(a_inputs(reads), a_strides, a_batch(reads))
        return _unaliased(c.part_a(inputs), reads)

    def fake_backward(reads):
        inputs = _conformed(a_inputs(reads), a_strides, a_batch(reads))
        return _unaliased(c.part_a_fake(*inputs), reads)

    def b_inputs(coefs, keeps, operands):
        batch = coefs[0].shape[0]
        pairs = [t for pair in zip(coefs, keeps) for t in pair]
        return list(operands) + [batch] * result.num_sizes + pairs

    def cast(outs):
        return [o.to(c.param_dtypes[n]) for o, n in zip(outs, params)]

    def clip(coefs, keeps, operands):
        inputs = _conformed(b_inputs(coefs, keeps, operands), b_strides, coefs[0].shape[0])
        return _unaliased(c.part_b(inputs), operands)

    def fake_clip(coefs, keeps, operands):
        inputs = _conformed(b_inputs(coefs, keeps, operands), b_strides, coefs[0].shape[0])
        return _unaliased(c.part_b_fake(*inputs), operands)

    def _ones(norms):
        batch, device = norms.shape[1], norms.device
        coefs = [torch.ones(batch, dtype=torch.float32, device=device)] * len(params)
        keeps = [torch.ones(batch, dtype=torch.bool, device=device)] * len(params)
        return coefs, keeps

    def grad(args):     # [norms, *operands]: the plain sums, every coefficient 1
        return cast(clip(*_ones(args[0]), args[1:]))

    def fake_grad(args):
        return cast(fake_clip(*_ones(args[0]), args[1:]))

    fw_meta = _output_metadata(c.fw_fake, num_outputs)
    a_meta = _output_metadata(c.part_a_fake, len(result.input_grads) + 1)
    b_meta = _output_metadata(c.part_b_fake)
    graph_kinds = [r for r in op_reads if r[0] != "saved"]

    def shapes_forward(args):
        return _empty_at(fw_meta, _batch_of(args, batched), args[0].device)

    grad_meta = [(shape, stride, c.param_dtypes[n])
                 for (shape, stride, _), n in zip(b_meta, params)]

    def shapes_backward(reads, device):
        return _empty_at(a_meta, _batch_of_reads(graph_kinds, reads, batched), device)

    def shapes_grad(device):
        return _empty_at(grad_meta, None, device)

    def shapes_clip(device):
        return _empty_at(b_meta, None, device)

    return Kernels(name=name, params=params, num_inputs=num_inputs, num_outputs=num_outputs,
                   grad_inputs=c.grad_inputs, forward=forward, backward=backward, grad=grad,
                   clip=clip, backward_reads=op_reads, fake_forward=fake_forward,
                   fake_backward=fake_backward, fake_grad=fake_grad, fake_clip=fake_clip,
                   shapes_forward=shapes_forward, shapes_backward=shapes_backward,
                   shapes_grad=shapes_grad, shapes_clip=shapes_clip, operands=sources,
                   norms=len(result.input_grads), rows=result.rows,
                   operands_read_params=any(
                       kind == "in" and op_reads[i][0] == "arg" and op_reads[i][1] >= num_inputs
                       for kind, i in sources),
                   forward_layouts=c.fw_layouts, backward_layouts=result.layouts)


# Note [A block's inputs in the layouts it was compiled for]
# Inductor compiles each of a block's graphs for its inputs' strides and asserts them on every
# call. What reaches a block op at run time need not have them: the model's graph may hand over
# a view (GPT-J's rotary table, a slice of a wider tensor) or a gradient in another layout than
# the capture's example. Each tensor input whose strides differ (in a dim of size > 1) from those
# of its graph's placeholder, evaluated at the call's batch size, is copied into them first.
def _strides_of(gm: fx.GraphModule) -> list:
    """Each placeholder's strides as polynomials in the batch symbol (None: not a tensor)."""
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        out.append([_size_expr(x) for x in val.stride()]
                   if isinstance(val, torch.Tensor) else None)
    return out


def _conformed(inputs: list, strides: list, batch) -> list:
    out = []
    for t, want in zip(inputs, strides):
        if want is not None and isinstance(t, torch.Tensor) and t.dim() and \
                (batch is not None or not any(e.free_symbols for e in want)):
            want = [_evaluate(e, batch) for e in want]
            # symbolic strides (a fake call's, through the batch) are compared where they are
            # plain numbers on both sides
            if any(_known(n) and _known(s) and _known(w) and n > 1 and s != w
                   for n, s, w in zip(t.shape, t.stride(), want)):
                t = _laid_out(t, want)
        out.append(t)
    return out


def _known(x) -> bool:
    return isinstance(x, int) or \
        (isinstance(x, torch.SymInt) and x.node.maybe_as_int() is not None)


def _laid_out(t: torch.Tensor, strides) -> torch.Tensor:
    """A copy of ``t`` with ``strides``; a dim of stride 0 is a broadcast, read at its first
    entry (what code compiled for that layout reads)."""
    small = t[tuple(slice(0, 1) if s == 0 else slice(None) for s in strides)]
    out = torch.empty_strided(small.shape, strides, dtype=t.dtype, device=t.device)
    return out.copy_(small).expand(t.shape)


# Note [Only dpfx's own forward calls a compiled block]
# A block's ``forward`` is replaced for good, but only the private forward of the dpfx model
# that compiled it may take the compiled path: any other call of the module (the user's
# ``model(...)``, ``generate()`` with a key/value cache, a public step, a reference copy's
# capture, a second ``dpfx.compile`` capturing or probing the same model) runs the block's own
# forward, unchanged, with autograd's plain gradients. The route is chosen by the caller, not by
# the arguments: dpfx's forward names itself in ``_CALLER`` (``PrivateForward``, entered around
# its compiled call), and each ``BlockCall`` takes the compiled path only when its owner is the
# caller (a block installed with no owner: under any dpfx forward). Dynamo reads ``_CALLER``
# while it traces the block call, so the model's graph is guarded on its owner's token: the
# steady state pays one guard, and a graph traced under one caller is never run under another.
# A block compiled by two dpfx models keeps both calls in a chain: each hands a call it does not
# own to the forward it replaced.
_CALLER = [0]       # the token of the dpfx model whose private forward runs; 0: none
_OWNERS = itertools.count(1)


def new_owner() -> int:
    """A token for one dpfx model's blocks (``prepare``'s ``owner``, ``PrivateForward``'s)."""
    return next(_OWNERS)


class PrivateForward:
    """``with PrivateForward(token):`` dpfx's private forward of the model ``token`` names:
    its compiled blocks take their compiled path (Note [Only dpfx's own forward calls a
    compiled block])."""

    __slots__ = ("token", "_outer")

    def __init__(self, token: int):
        self.token = token
        self._outer: list[int] = []

    def __enter__(self):
        self._outer.append(_CALLER[0])
        _CALLER[0] = self.token

    def __exit__(self, *exc):
        _CALLER[0] = self._outer.pop()
        return False


class BlockCall:
    """``block.forward`` replaced: under its owner's private forward, the call's tensors, the
    block's parameters and constants go to ``dpfx::block_fwd`` (the non-tensor arguments must
    be those the key was compiled with); any other call runs the forward it replaced."""

    def __init__(self, block: torch.nn.Module, key: str, signature: tuple, owner: int = 0):
        self.key = key
        self.owner = owner
        # the forward this call replaced: an instance attribute (another dpfx model's call, a
        # hook's wrapper) or None for the class's own
        self.replaced = block.__dict__.get("forward")
        self.signature = signature
        self.block = block      # a reference cycle the module's own collection frees
        self.flat = None        # Note [A block call's flattening]
        self.spec = None
        self.num_outputs = kernels(key).num_outputs
        # Where each parameter and buffer lives, in named_parameters()'s order, found once: the
        # model's capture traces this call once per layer, and a walk of the module tree per
        # call is what dynamo spends its time on.
        named = list(block.named_parameters())
        self.trainable = [_slot(block, n) for n, p in named if p.requires_grad]
        self.frozen = [_slot(block, n) for n, p in named if not p.requires_grad]
        self.buffers = [_slot(block, n) for n, _ in block.named_buffers()]

    def __call__(self, *args, **kwargs):
        block = self.block
        caller = _CALLER[0]
        if caller == 0 or (self.owner and caller != self.owner):
            if self.replaced is not None:
                return self.replaced(*args, **kwargs)
            return type(block).forward(block, *args, **kwargs)
        # See Note [A block call's flattening]
        leaves = None
        if self.flat is not None and len(args) == self.flat[0] and tuple(kwargs) == self.flat[1]:
            leaves = [*args, *kwargs.values()]
            if not all(_is_leaf(x) for x in leaves):
                leaves = None
        same_structure = True
        if leaves is None:
            leaves, spec = pytree.tree_flatten((args, kwargs))
            same_structure = self.spec is None or spec == self.spec
        leaves = _without_empty_caches(leaves, block)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        constants = tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
        if constants != self.constants or not same_structure:
            raise CaptureError(
                f"dpfx: block {type(block).__name__} is called with arguments other than those "
                f"it was compiled for ({_describe(leaves)}; compiled for "
                f"{_describe(self.constants)}); compile without blocks")
        params = [getattr(m, a) for m, a in self.trainable]
        frozen = [getattr(m, a) for m, a in self.frozen]
        if not all(p.requires_grad for p in params) or any(p.requires_grad for p in frozen):
            raise CaptureError(
                f"dpfx: a parameter of block {type(block).__name__} changed requires_grad since "
                f"the block was compiled; compile the model again")
        buffers = [getattr(m, a) for m, a in self.buffers]
        outs = torch.ops.dpfx.block_fwd(self.key, tensors + params + frozen + buffers)
        if self.out_spec.is_leaf():
            return outs[0]
        it = iter(outs[:self.num_outputs])
        return pytree.tree_unflatten(
            [next(it) if x is _TENSOR else x for x in self.out_constants], self.out_spec)


def _slot(block: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """(the module that holds ``name``, its attribute name)."""
    path, _, attr = name.rpartition(".")
    return block.get_submodule(path), attr


def install(block: torch.nn.Module, key: str, out, leaves: list, spec=None, owner: int = 0
            ) -> None:
    """``block(...)`` calls the compiled block ``key`` from now on, under the private forward
    of the dpfx model ``owner`` names (0: of any; Note [Only dpfx's own forward calls a compiled
    block]); ``uninstall`` undoes it.
    ``leaves``: an example call's flattened arguments (its tensors stand for any tensor), and
    ``spec`` the pytree spec of its ``(args, kwargs)`` (None: every call is flattened);
    ``out``: the example call's flattened outputs and their spec. An output that is not a
    tensor (``None`` for attention weights not asked for) is no output of the block's graph:
    it is returned as the example returned it."""
    out_leaves, out_spec = out
    call = BlockCall(block, key, (), owner)
    call.out_spec = out_spec
    call.out_constants = [_TENSOR if isinstance(x, torch.Tensor) else x for x in out_leaves]
    tensors = sum(1 for x in out_leaves if isinstance(x, torch.Tensor))
    if tensors != call.num_outputs:
        raise CaptureError(f"dpfx: block {type(block).__name__} returns {tensors} tensors, its "
                           f"compiled graph {call.num_outputs}; compile without blocks")
    call.constants = tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
    call.flat, call.spec = _flat_call(spec), spec
    block.forward = call


# Note [A block call's flattening]
# The model's capture traces each block call's Python once per layer, and dynamo's trace of
# pytree's flattening of the call's arguments costs about a quarter of its time on a deep model.
# A call whose positional arguments and keyword values are each a leaf (a tensor
# or a constant, no container) has those values, in that order, as its leaves: the example call
# the block was installed with tells whether it is such a call, and how many positional
# arguments and which keywords (in order) it had. A call with that count and those keywords
# takes the values as they are if each is a leaf (its structure is then the example's); any
# other call is flattened by pytree and must have the example's structure. Either way its leaves
# are then compared with the example's (tensors where it had tensors, the same constants
# elsewhere). A call that differs in structure alone (a mask in a tuple, the same values passed
# positionally) is refused: the compiled block computes what the example call computed.
def _is_leaf(x) -> bool:
    return isinstance(x, (torch.Tensor, bool, int, float, str, type(None))) or \
        pytree.tree_is_leaf(x)


def _flat_call(spec) -> tuple[int, tuple] | None:
    """(positional count, keywords in order) if the example call whose ``(args, kwargs)`` spec
    is ``spec`` had only leaves for arguments, else None."""
    if spec is None:
        return None
    args_spec, kwargs_spec = spec.children()
    if args_spec.type is not tuple or kwargs_spec.type is not dict or \
            not all(c.is_leaf() for c in [*args_spec.children(), *kwargs_spec.children()]):
        return None
    return args_spec.num_children, tuple(kwargs_spec.context)


_TENSOR = "<tensor>"     # a tensor argument's place in a call's constants


# Note [An empty cache is no argument]
# A Hugging Face model called without ``use_cache=False`` makes a fresh key/value cache in every
# forward and hands it to each decoder layer, which appends its keys and values and attends over
# what the cache holds: with the cache empty, exactly its own. In training nothing reads the
# cache afterwards. A block is therefore called with ``None`` in its place, which computes the
# same outputs (in the probes too, so that the cache stays empty for the next block); a cache
# that already holds positions (prefix tuning's past keys) changes what the block computes and
# is refused.
def _without_empty_caches(leaves: list, block) -> list:
    out = []
    for x in leaves:
        if x is not None and not isinstance(x, (torch.Tensor, bool, int, float, str)) and \
                hasattr(x, "get_seq_length") and hasattr(x, "update"):
            if x.get_seq_length() != 0:
                raise CaptureError(
                    f"dpfx: block {type(block).__name__} is called with a key/value cache that "
                    f"already holds {x.get_seq_length()} positions; a compiled block cannot read "
                    f"one. Compile without blocks")
            x = None
        out.append(x)
    return out


def _describe(leaves) -> str:
    return ", ".join(_TENSOR if isinstance(x, torch.Tensor) else repr(x) for x in leaves)


def uninstall(block: torch.nn.Module) -> None:
    call = block.__dict__.get("forward")
    if isinstance(call, BlockCall):
        PLACES.pop(call.key, None)
        if call.replaced is not None:
            block.forward = call.replaced
        else:
            del block.forward


# -- choosing the blocks and their example calls ---------------------------------------------

def select(model: torch.nn.Module, blocks) -> list[tuple[str, torch.nn.Module]]:
    """The blocks ``blocks`` names in ``model``: "auto" (a Hugging Face model's
    ``_no_split_modules`` classes, else the longest ModuleList of one class), module classes, or
    module names. Blocks inside other blocks are left to those."""
    from dpfx.errors import OptionError

    named = list(model.named_modules())
    if blocks in (True, "auto"):
        classes = set(_no_split_modules(model))
        # an FSDP unit's class is FSDP<its class>: its own class is the next in its MRO
        found = [(n, m) for n, m in named
                 if n and any(c.__name__ in classes for c in type(m).__mro__[:2])]
        if not found:
            found = [(n, m) for n, m in named if n and _is_fsdp_unit(m)]
        if not found:
            for n, m in named:
                if isinstance(m, torch.nn.ModuleList) and len(m) >= 1 \
                        and len({type(c) for c in m}) == 1 and len(m) > len(found) \
                        and any(True for _ in m[0].parameters()):
                    found = [(f"{n}.{i}" if n else str(i), c) for i, c in enumerate(m)]
        if not found:
            raise OptionError("blocks='auto' found no repeated block in the model (no Hugging "
                              "Face _no_split_modules, no ModuleList of one class): pass "
                              "blocks=[BlockClass] or the blocks' module names")
    elif isinstance(blocks, (list, tuple, set)) and blocks:
        classes = tuple(b for b in blocks if isinstance(b, type))
        names = {b for b in blocks if isinstance(b, str)}
        unknown = names - {n for n, _ in named}
        if unknown:
            raise OptionError(f"blocks: no module named {sorted(unknown)} in the model")
        if len(classes) + len(names) != len(blocks):
            raise OptionError("blocks: give module classes or module names")
        found = [(n, m) for n, m in named if n and (n in names or isinstance(m, classes))]
        if not found:
            raise OptionError(f"blocks: no module of {[c.__name__ for c in classes]} in the "
                              f"model")
    else:
        raise OptionError(f"blocks={blocks!r}: expected 'auto', or a list of module classes or "
                          f"names")
    outer = []
    for n, m in found:
        if not any(n.startswith(o + ".") for o, _ in outer):
            outer.append((n, m))
    return outer


def _no_split_modules(model: torch.nn.Module) -> list:
    """Hugging Face's repeated blocks, of the model or of the model a PEFT wrapper holds."""
    for m in model.modules():
        found = getattr(m, "_no_split_modules", None)
        if found:
            return list(found)
    return []


def _is_fsdp_unit(m: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(m, FSDPModule)


def _resized(t: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` rows of ``t`` (its rows repeated; zeros where it has none)."""
    if t.dim() == 0:
        return t
    if t.shape[0] == 0:
        return t.new_zeros((n, *t.shape[1:]))
    return t[torch.arange(n, device=t.device) % t.shape[0]]


def _probe(model, blocks, args, kwargs, n: int) -> dict[int, list]:
    """Each block's calls (flattened leaves and spec) in an eager forward at batch size n."""
    calls: dict[int, list] = {id(m): [] for _, m in blocks}

    def record(module, a, kw):
        leaves, spec = pytree.tree_flatten((a, kw))
        leaves = _without_empty_caches(leaves, module)
        calls[id(module)].append((leaves, spec))
        return pytree.tree_unflatten(leaves, spec)     # the block runs as its op will

    hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for _, m in blocks]
    a, kw = pytree.tree_map_only(torch.Tensor, lambda t: _resized(t, n), (args, kwargs))
    try:
        # the model's code takes the path it takes under dynamo (Hugging Face builds an explicit
        # attention mask where eager passes None), so the probe sees the calls the graph makes
        with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                unittest.mock.patch("torch.compiler.is_compiling", return_value=True):
            model(*a, **kw)
    finally:
        for h in hooks:
            h.remove()
    return calls


def prepare(model: torch.nn.Module, blocks, args: tuple, kwargs: dict, config: DPConfig,
            places=None, owner: int = 0) -> list[torch.nn.Module]:
    """Compile the blocks ``blocks`` names, each distinct one once, from two eager probes of
    ``model(*args, **kwargs)`` at batch sizes 2 and 3 (a tensor whose dim 0 follows them
    carries the batch), and install them. Returns the installed blocks. ``places(chosen)``:
    id(block) -> the ``Place`` of each block whose parameters live elsewhere (Note [A block
    whose parameters live elsewhere] in ops/blocks.py); ``owner``: the token of the dpfx model
    whose private forward calls them (Note [Only dpfx's own forward calls a compiled block])."""
    chosen = select(model, blocks)
    small, large = (_probe(model, chosen, args, kwargs, n) for n in (2, 3))
    _refuse_shared(chosen, large)
    placed = places(chosen) if places is not None else {}
    keys: dict[tuple, str] = {}
    installed = []
    try:
        for name, block in chosen:
            if not large[id(block)]:
                continue    # never called: nothing to compile
            (leaves2, spec2), (leaves3, spec3) = small[id(block)][0], large[id(block)][0]
            if str(spec2) != str(spec3):
                raise CaptureError(f"dpfx: block {name} ({type(block).__name__}) is called with "
                                   f"arguments whose structure depends on the batch size; "
                                   f"compile without blocks")
            batched = set()
            for i, (x2, x3) in enumerate(zip(leaves2, leaves3)):
                if not isinstance(x3, torch.Tensor):
                    if not isinstance(x3, (type(None), bool, int, float, str, torch.dtype)):
                        raise CaptureError(
                            f"dpfx: block {name} ({type(block).__name__}) is called with "
                            f"{type(x3).__name__} argument {x3!r}; a block's arguments must be "
                            f"tensors or constants ), or compile without blocks")
                    continue
                if x3.dim() and x2.shape[0] == 2 and x3.shape[0] == 3 \
                        and x2.shape[1:] == x3.shape[1:]:
                    batched.add(i)
                elif x2.shape != x3.shape:
                    raise CaptureError(
                        f"dpfx: block {name} ({type(block).__name__}) is called with a tensor "
                        f"whose shape follows the batch other than in dim 0 ({tuple(x2.shape)} "
                        f"at 2 examples, {tuple(x3.shape)} at 3); compile without blocks")
            a, kw = pytree.tree_unflatten(leaves3, spec3)
            # which of its parameters share a clipping group: one norm row each group (Note
            # [One norm row per clipping group] in passes/block.py)
            groups = [config.group_of(f"{name}.{n}") for n, p in block.named_parameters()
                      if p.requires_grad]
            signature = (block_signature(block, a, kw, batched),
                         tuple(norm_rows(groups, len(groups))))
            if signature not in keys:
                keys[signature] = compile_block(block, a, kw, batched, config, groups)
            with torch.no_grad():
                out_leaves, out_spec = pytree.tree_flatten(block(*a, **kw))
            key = keys[signature]
            place = placed.get(id(block))
            if place is not None:
                key = f"{key}#{place.name}"
                PLACES[key] = place
            install(block, key, (out_leaves, out_spec), leaves3, spec3, owner)
            installed.append(block)
    except BaseException:
        for block in installed:
            uninstall(block)
        raise
    return installed


# Note [A block used more than once is refused]
# A block's ops compute the squared per-sample norm of its parameters' gradient from one call's
# operands (passes/block.py), and the model's clip factor sums one norm row per call. A module
# called more than once in a forward (ALBERT's one layer group at every depth), or two blocks
# that share a parameter, would give the parameter one row per call: the norm of each use's
# gradient, not of their sum, which is the example's gradient and what must be clipped. Such a
# model is refused before anything is installed; the one-graph path clips the sum exactly.
def _refuse_shared(chosen: list, calls: dict[int, list]) -> None:
    owner_of: dict[int, str] = {}
    for name, block in chosen:
        count = len(calls[id(block)])
        if count > 1:
            raise CaptureError(
                f"dpfx: block {name} ({type(block).__name__}) is called {count} times in one "
                f"forward (a layer shared across depth); its parameters' per-example gradient "
                f"is the sum over its uses, which per-block graphs cannot clip. Compile without "
                f"blocks (blocks=False, the one graph clips it exactly)")
        for pname, p in block.named_parameters():
            other = owner_of.setdefault(id(p), f"{name}.{pname}")
            if other != f"{name}.{pname}":
                raise CaptureError(
                    f"dpfx: blocks share the parameter {other} (also {name}.{pname}); its "
                    f"per-example gradient is the sum over the blocks, which per-block graphs "
                    f"cannot clip. Compile without blocks (blocks=False, the one graph clips it "
                    f"exactly)")
