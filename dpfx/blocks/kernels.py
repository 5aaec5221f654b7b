"""A compiled block's three graphs as the ``Kernels`` its ops call.

    k = make_kernels(backend, name, params, num_inputs, batched)
    outs = k.forward(args)                # the user's outputs, then the saved activations
    part_a = k.backward(reads)            # input gradients, norm rows, operands
    sums = k.clip(coefs, keeps, operands) # the clipped sums

Each kernel runs a compiled graph (or, for the self-check, its FX graph: ``fake_*``) at the
call's batch size: sizes the graph reads are evaluated from it, inputs are laid out as the graph
was compiled for them (Note [A block's inputs in the layouts it was compiled for]), both once
per batch size (Note [A block call's sizes, once per batch size]), outputs that alias a buffer
of the model's graph are copied (a custom op's outputs are new tensors; Note [What a held tensor
may share]), and a fake call's outputs are read from the graph's metadata (Note [A block op's
shapes come from its graphs' metadata]).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpfx.blocks.sizes import batch_of, batch_of_reads, evaluate, size_expr
from dpfx.ops.blocks import Kernels


def _unaliased(outs, inputs, returned: int | None = None, held_inputs=()) -> list:
    """``outs`` with every output that shares memory with an input or an earlier output copied:
    a custom op's outputs are new tensors (a saved view of the block's input, two views of one
    activation). The outputs after the first ``returned`` are held by the op (Note [A block's own
    tensors stay out of the model's graph] in ops/blocks.py): they may share memory with each
    other and with the inputs at ``held_inputs`` (tensors the op held too), whose buffers no
    graph reuses (Note [What a held tensor may share])."""
    graph = {_storage(t) for i, t in enumerate(inputs)
             if isinstance(t, torch.Tensor) and i not in held_inputs}
    held = {_storage(inputs[i]) for i in held_inputs}
    returned = len(outs) if returned is None else returned
    result = []
    for n, o in enumerate(outs):
        key = _storage(o)
        if key in graph or (n < returned and key in held):
            o = _laid_out(o, o.stride())    # the same strides: the graphs that read it were
            key = _storage(o)               # compiled so
        (graph if n < returned else held).add(key)
        result.append(o)
    return result


# Note [What a held tensor may share]
# A tensor a block op holds must not share memory with a buffer of the model's graph: Inductor
# reuses a buffer once the graph reads it no more (an argument of the call, an output
# gradient, an output the op returned), and the op's later readers would see its new contents.
# Memory the block's own compiled graphs made and the op holds (its saved activations, part B's
# operands) is read by the block's ops alone: views of it, and views of each other, are held as
# they are, with no copy (a decoder layer's forward saves several views of one activation, and
# its part A passes some of them on to part B). A parameter is a graph input like the others:
# a view of it is copied, so that no value held for the backward bypasses autograd's check of
# a parameter changed in place, and a sharded block frees its gathered parameters after the op.
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
    return [([size_expr(x) for x in o.meta["val"].shape],
             [size_expr(x) for x in o.meta["val"].stride()], o.meta["val"].dtype)
            for o in outs[:count]]


def _empty_at(metadata: list, batch, device) -> list:
    return [torch.empty_strided([evaluate(e, batch) for e in shape],
                                [evaluate(e, batch) for e in stride], dtype=dtype, device=device)
            for shape, stride, dtype in metadata]


def make_kernels(c, name: str, params: list[str], num_inputs: int,
             batched: list[int]) -> Kernels:
    num_outputs = c.num_outputs
    result = c.result
    op_reads = [r for r in c.reads if r[0] != "size"]
    a_names = [n.name for n in c.part_a_fake.graph.find_nodes(op="placeholder")]
    op_index = {name: k for k, name in enumerate(
        n for n, r in zip(a_names, c.reads) if r[0] != "size")}
    sources = [("out", k) if kind == "out" else ("in", op_index[k])
               for kind, k in result.operands]

    fw_sizes = _AtBatch(lambda batch: [None if kind == "arg" else evaluate(pos, batch)
                                       for kind, pos in c.fw_spec])

    def fw_inputs(args, batch):
        return [args[pos] if kind == "arg" else size
                for (kind, pos), size in zip(c.fw_spec, fw_sizes(batch))]

    def split_fw(outs):
        return list(outs[:num_outputs]) + [outs[i] for i in c.saved]

    fw_strides = _strides_at(c.fw_fake)
    a_strides = _strides_at(c.part_a_fake)
    b_strides = _strides_at(c.part_b_fake)

    def forward(args):
        batch = batch_of(args, batched)
        inputs = _conformed(fw_inputs(args, batch), fw_strides(batch), batch)
        return _unaliased(split_fw(c.fw_compiled(inputs)), args, num_outputs)

    def fake_forward(args):
        batch = batch_of(args, batched)
        inputs = _conformed(fw_inputs(args, batch), fw_strides(batch), batch)
        return _unaliased(split_fw(c.fw_fake(*inputs)), args, num_outputs)

    def a_batch(reads):
        for r, t in zip(op_reads, reads):
            if r[0] == "grad" and t.dim():
                return t.shape[0]
        return None

    a_sizes = _AtBatch(lambda batch: [evaluate(r[1], batch) if r[0] == "size" else None
                                      for r in c.reads])

    def a_inputs(reads, batch):
        it = iter(reads)
        return [next(it) if size is None else size for size in a_sizes(batch)]

    a_returned = len(result.input_grads) + 1        # the input gradients and the norms
    a_held = frozenset(i for i, r in enumerate(op_reads) if r[0] == "saved")

    def backward(reads):
        batch = a_batch(reads)
        inputs = _conformed(a_inputs(reads, batch), a_strides(batch), batch)
        return _unaliased(c.part_a(inputs), reads, a_returned, a_held)

    def fake_backward(reads):
        batch = a_batch(reads)
        inputs = _conformed(a_inputs(reads, batch), a_strides(batch), batch)
        return _unaliased(c.part_a_fake(*inputs), reads, a_returned, a_held)

    def b_inputs(coefs, keeps, operands):
        batch = coefs[0].shape[0]
        pairs = [t for pair in zip(coefs, keeps) for t in pair]
        return list(operands) + [batch] * result.num_sizes + pairs

    def cast(outs):
        return [o.to(c.param_dtypes[n]) for o, n in zip(outs, params)]

    def clip(coefs, keeps, operands):
        batch = coefs[0].shape[0]
        inputs = _conformed(b_inputs(coefs, keeps, operands), b_strides(batch), batch)
        return _unaliased(c.part_b(inputs), operands)

    def fake_clip(coefs, keeps, operands):
        batch = coefs[0].shape[0]
        inputs = _conformed(b_inputs(coefs, keeps, operands), b_strides(batch), batch)
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
        return _empty_at(fw_meta, batch_of(args, batched), args[0].device)

    grad_meta = [(shape, stride, c.param_dtypes[n])
                 for (shape, stride, _), n in zip(b_meta, params)]

    def shapes_backward(reads, device):
        return _empty_at(a_meta, batch_of_reads(graph_kinds, reads, batched), device)

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
        out.append([size_expr(x) for x in val.stride()]
                   if isinstance(val, torch.Tensor) else None)
    return out


def _strides_at(gm: fx.GraphModule) -> "_AtBatch":
    """``gm``'s placeholders' strides at a batch size: a tuple of numbers per tensor (None: not
    a tensor, or strides that need the batch size where the call has none)."""
    strides = [(want, want is not None and any(e.free_symbols for e in want))
               for want in _strides_of(gm)]
    return _AtBatch(lambda batch: [
        None if want is None or (batch is None and free) else
        tuple(evaluate(e, batch) for e in want) for want, free in strides])


def _conformed(inputs: list, wants: list, batch) -> list:
    plain = type(batch) is int      # a real call: every stride is a number
    out = []
    for t, want in zip(inputs, wants):
        if want is not None and isinstance(t, torch.Tensor) and t.dim():
            have = t.stride()
            if plain and have == want:
                out.append(t)
                continue
            # symbolic strides (a fake call's, through the batch) are compared where they are
            # plain numbers on both sides
            if any(_known(n) and _known(s) and _known(w) and n > 1 and s != w
                   for n, s, w in zip(t.shape, have, want)):
                t = _laid_out(t, want)
        out.append(t)
    return out


# Note [A block call's sizes, once per batch size]
# A block's graphs read sizes, and were compiled for strides, that are polynomials in the batch
# size (sizes.py); a decoder layer's three ops evaluate about a hundred of them a call. A step
# calls each op once per layer at one batch size, so each list is evaluated at the first call
# of a batch size and looked up after: the ops' own time per call is that of the compiled
# graphs' calls, not of walking expressions. A symbolic batch (a trace) is evaluated each time.
class _AtBatch:
    """``fn(batch)``, kept for each integer batch size."""

    __slots__ = ("fn", "kept")
    LIMIT = 4096        # distinct batch sizes kept (Poisson sampling draws many)

    def __init__(self, fn):
        self.fn = fn
        self.kept: dict[int, list] = {}

    def __call__(self, batch) -> list:
        if type(batch) is not int:
            return self.fn(batch)
        found = self.kept.get(batch)
        if found is None:
            if len(self.kept) >= self.LIMIT:
                self.kept.clear()
            found = self.kept[batch] = self.fn(batch)
        return found


def _known(x) -> bool:
    return isinstance(x, int) or \
        (isinstance(x, torch.SymInt) and x.node.maybe_as_int() is not None)


def _laid_out(t: torch.Tensor, strides) -> torch.Tensor:
    """A copy of ``t`` with ``strides``; a dim of stride 0 is a broadcast, read at its first
    entry (what code compiled for that layout reads)."""
    small = t[tuple(slice(0, 1) if s == 0 else slice(None) for s in strides)]
    out = torch.empty_strided(small.shape, strides, dtype=t.dtype, device=t.device)
    return out.copy_(small).expand(t.shape)
