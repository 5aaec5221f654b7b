"""A block compiled once: captured with a symbolic batch, proven, split and lowered.

    key = compile_block(block, args, kwargs, batched={0}, config=config)
    torch.ops.dpfx.block_fwd(key, tensors + params + frozen + buffers)

``compile_block`` hands the block's call to dynamo with ``BlockBackend`` as its backend:
aot_autograd's forward is proven to keep examples apart and lowered; its backward is rewritten
per sample and split at the clip coefficient into parts A and B (passes/block.py), both
lowered. The three graphs become the ``Kernels`` of the block's ops (blocks/kernels.py), are
checked (blocks/selfcheck.py) and registered under a key that names them (Note [A block's key
names its graphs]).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import itertools
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._inductor.compile_fx import compile_fx

from dpfx.backend import dump_stage
from dpfx.backend.inputs import (gradient_outputs, input_index, output_descs, tangent_outputs,
                                 trainable)
from dpfx.blocks.kernels import make_kernels
from dpfx.blocks.selfcheck import check_block
from dpfx.blocks.sizes import size_expr
from dpfx.capture.entry import BatchMarked, DynamoSettings, HeapFrozen
from dpfx.capture.swaps import Captured
from dpfx.config import DPConfig
from dpfx.errors import CaptureError, DPFXError
from dpfx.lower.codegen_patches import optimization_hints_once
from dpfx.lower.inductor import inductor_patches, lower
from dpfx.lower.selfcheck.reference import has_random_ops
from dpfx.ops.blocks import KERNELS
from dpfx.passes import Stages, compile_forward
from dpfx.passes.block import block_backward, norm_rows

_CAPTURES = itertools.count()


class BlockBackend:
    """The torch.compile backend for one block: the block's forward proven and lowered, its
    backward rewritten per sample and split at the clip coefficient (passes/block.py) instead of
    clipped and noised; no loss. What each graph input is and which backward output is which
    gradient come from the backend's helpers (backend/inputs.py)."""

    def __init__(self, block, config, args: list[torch.Tensor], batched: set[int],
                 params: list[str], rows: list[int] | None):
        self.config = config
        self.param_names = trainable(block)
        self.stages = Stages(on_stage=functools.partial(dump_stage, 0))
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
        self.kinds = kinds
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
            idx = input_index(node)
            kind, pos = self.dynamo_inputs[idx] if idx is not None else ("size", None)
            if kind == "size":
                pos = size_expr(node.meta["val"])
            spec.append((kind, pos))
            if kind == "arg" and pos in self.batched:
                batch_inputs[node.name] = 0
        self.fw_info = compile_forward(gm, batch_inputs, self.stages)
        if has_random_ops(gm):
            raise CaptureError(
                f"dpfx: block {self.name} draws random numbers in its forward (dropout while "
                f"training); a compiled block cannot yet, since the self-check would compare "
                f"two draws. Set its dropout to 0, or compile without blocks")
        self.fw_spec = spec
        self.fw_names = {n.name: s for n, s in zip(gm.graph.find_nodes(op="placeholder"), spec)}
        output = gm.graph.find_nodes(op="output")[0]
        outs = list(output.args[0])
        descs = output_descs(output, len(outs))
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
                self.saved_names[o.name] = ("size", size_expr(o.meta["val"]))
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
        for i, idx in gradient_outputs(gm).items():
            kind = self.kinds[idx]
            if kind.startswith("param:"):
                param_outputs[i] = kind[len("param:"):]
            else:
                arg_of_output[i] = self.dynamo_inputs[idx][1]
        tangents = tangent_outputs(gm)
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
    capture = BlockBackend(block, config, op_args, batched_args, params,
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
    kernels = make_kernels(capture, type(block).__name__, params, len(call_tensors),
                       sorted(batched_args))
    if config.backend == "inductor" and config.self_check is not False:
        check_block(kernels, call_tensors, batched_args, op_args[len(call_tensors):],
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
