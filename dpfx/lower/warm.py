"""A warm start without aot_autograd's joint trace: dpfx's graphs, code and verdicts in
AOTAutogradCache's entries, and the rebuild of a graph from its entry.

Which entries run their code as it is, without the rebuild, is lower/trust.py's.

# Note [A warm start without the joint trace]
A user's second run of a script finds Inductor's code in its cache, but tracing the joint graph
on the unbacked batch and partitioning it (aot_autograd) would still be about half of its warm
first step; torch.compile skips both through AOTAutogradCache. That cache hands back the
inner compiler's results without calling it (Note [No caches that skip the inner compiler] in
backend/__init__.py), so dpfx takes part in it this way, on CPU:

- The inner compiler returns a ``DPOutputCode``: dpfx's runner for the graph, and the graph as
  aot_autograd handed it over, before any of dpfx's passes, serialized with torch's
  ``GraphPickler``. AOTAutogradCache runs in its bundled mode, which stores the inner compiler's
  results whole with aot_autograd's runtime metadata; when it saves an entry, the runner (which
  holds compiled code and live state) is dropped and only the graph is kept.
- The cache's key carries dpfx's identity: dpfx's custom post-grad pass, whose uuid hashes dpfx's
  sources (``lowering._CacheKey``), is in Inductor's configuration for the whole compile, so no
  entry of a plain torch.compile (or of another dpfx version) has a dpfx key. The uuid also
  names the batch-size decisions the graph was captured under (Note [Deciding a branch on the
  batch size]): the same dynamo code captured for B = 1 and for other sizes is two graphs.
- On a hit, AOTAutogradCache rebuilds the runtime wrappers from its entry and calls each output
  code's ``post_compile`` with the call's inputs, the forward's first. There ``DPOutputCode``
  runs the code it holds (Note [A trusted warm start] in lower/trust.py) or, where that is not
  trusted, loads its graph and runs dpfx's inner compiler on it, exactly as on a miss: batch
  analysis, rewrite, proof, lowering (Inductor's FX-graph cache hits: the same rewritten graph)
  and the self-check. Nothing the proof reads comes from the file but the graph itself: every
  node's fake value is computed again from the call's inputs (the forward's) and from the
  rebuilt forward's outputs (the backward's); the entry holds the graph's inputs' values only,
  which must agree with those in shape and dtype. The backward's inputs keep the entry's traced
  layouts, restrided where the compiled forward lays an output out otherwise (what aot_autograd
  does before compiling a backward): its code asserts them.
- Every compile counts the graphs dpfx's inner compiler compiled (``compiled``) and
  AOTAutogradCache's hits: a hit after which dpfx compiled nothing (an entry whose code was not
  dpfx's) is refused by the backend.
- Any failure while rebuilding (a graph that no longer loads, a proof that refuses) makes
  AOTAutogradCache fall back to the full compile, which then runs dpfx's passes on a fresh trace.
  A graph ``GraphPickler`` cannot write (its metadata names a class defined inside a function)
  is compiled as before, without an entry.

The rebuild costs loading the graphs, propagating fake values through them and the cache's key,
about half of the joint trace it replaces (BENCHMARKS.md, "Warm start").
(tests/lower/test_warm_start.py)
"""
from __future__ import annotations

import contextlib
import copy
import threading
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._inductor.output_code import OutputCode

from dpfx.lower import trust

# compile_fx_inner's arguments kept with a graph: what the inner compiler reads and what enters
# Inductor's FX-graph cache key (``boxed_forward_device_index`` and ``cudagraphs`` are made anew)
_KEPT = ("is_backward", "graph_id", "is_inference", "static_input_idxs", "get_decomp_fn",
         "compile_region_name")


class _State(threading.local):
    backend: Any = None                # the DPBackend compiling now
    compiled: int = 0                  # graphs its inner compiler compiled in this compile
    forward_outputs: list | None = None   # the rebuilt forward's output values
    forward_strides: list | None = None   # the strides its compiled code gives them
    serial: int = 0                    # compiles so far: a rebuilt pair's own graph id
    device_index: Any = None


state = _State()


class compiling:
    """While a DPBackend compiles: the backend rebuilds read, and the count of graphs that went
    through dpfx's inner compiler."""

    def __init__(self, backend):
        self.backend = backend

    def __enter__(self):
        from torch._dynamo.utils import counters

        self._hits = counters["aot_autograd"]["autograd_cache_hit"]
        self.outer = (state.backend, state.compiled, state.forward_outputs, state.device_index,
                      state.forward_strides)
        state.backend, state.compiled, state.forward_outputs, state.device_index, \
            state.forward_strides = self.backend, 0, None, None, None
        state.serial += 1
        trust.state.trusted_forward = None
        return self

    def __exit__(self, *exc):
        from torch._dynamo.utils import counters

        self.hits = counters["aot_autograd"]["autograd_cache_hit"] - self._hits
        self.compiled = state.compiled
        state.backend, state.compiled, state.forward_outputs, state.device_index, \
            state.forward_strides = self.outer
        return False


# what FakeTensorProp computes for a node; an entry holds it for the graph's inputs only
_DERIVED = ("val", "tensor_meta", "example_value")


def snapshot(gm: fx.GraphModule) -> bytes | None:
    """The graph as aot_autograd handed it over, serialized without the fake values a rebuild
    computes again (its inputs' kept); None if it cannot be."""
    from torch.fx._graph_pickler import GraphPickler, Options

    # Note [An entry holds no fake value it would not read]
    # A rebuild computes every node's fake value again from the graph's inputs, so the entry
    # keeps only the inputs' (the backward's tangents take their traced layouts from them).
    # Pickling a fake tensor writes its sizes, strides and symbolic expressions, and loading it
    # builds a tensor in the fake mode, which about doubles both the writing and the loading
    # (BENCHMARKS.md, "Levers in the code").
    set_aside = {node: {k: node.meta.pop(k) for k in _DERIVED if k in node.meta}
                 for node in gm.graph.nodes if node.op != "placeholder"}
    try:
        with pytree_registry_kept():
            return GraphPickler.dumps(gm, Options(ops_filter=None))
    except Exception:       # a graph GraphPickler cannot write is compiled, just not cached
        return None
    finally:
        for node, meta in set_aside.items():
            node.meta.update(meta)


# Note [The pickler leaves pytree's registry as it was]
# GraphPickler registers ``slice`` as a pytree node while it writes or reads a graph and removes
# it after. Dynamo guards code that flattens a pytree (a block call's arguments, a Hugging Face
# output) on the version of pytree's registry dict, which any change bumps: every snapshot and
# every warm load would make every other compiled model in the process fail its guards, and two
# models with blocks would recompile each other at every step, each recompile's load failing the
# other's guard again (tests/test_blocks.py::test_two_models_with_blocks_do_not_recompile_each_
# other). The pickler therefore works on copies of the registry, and the registry objects dynamo
# reads are put back unchanged.
_REGISTRIES = ("SUPPORTED_NODES", "SUPPORTED_SERIALIZED_TYPES",
               "SERIALIZED_TYPE_TO_PYTHON_TYPE", "CONSTANT_NODES")


@contextlib.contextmanager
def pytree_registry_kept():
    import torch.utils._pytree as pytree

    saved = {name: getattr(pytree, name) for name in _REGISTRIES if hasattr(pytree, name)}
    with pytree._NODE_REGISTRY_LOCK:
        for name, registry in saved.items():
            setattr(pytree, name, copy.copy(registry))
    try:
        yield
    finally:
        with pytree._NODE_REGISTRY_LOCK:
            for name, registry in saved.items():
                setattr(pytree, name, registry)


class DPOutputCode(OutputCode):
    """dpfx's compiled graph for AOTAutogradCache: the runner, and what rebuilds it."""

    def __init__(self, runner: Callable, graph: bytes | None, kwargs: dict):
        self._runner = runner
        self.graph = graph
        self._kwargs = {k: v for k, v in kwargs.items() if k in _KEPT}
        self._boxed_call = True
        # Note [A trusted warm start] in lower/trust.py: the rewritten graph's code, what runs
        # it, and their digest once written
        self.lowered = None
        self.plan: dict | None = None
        self.digest: str | None = None

    def __call__(self, inputs):
        return self._runner(inputs)

    def prepare_for_serialization(self) -> None:
        from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

        if self.graph is None:
            raise BypassAOTAutogradCache("dpfx: the graph could not be serialized")
        self._runner = None
        if self.lowered is not None and self.plan is not None and \
                (self.plan["kind"] == "backward" or "pair" in self.plan):
            lowered = copy.copy(self.lowered)
            lowered.prepare_for_serialization()
            self.lowered = lowered
            self.digest = trust.digest(self.plan, lowered, self.graph)
        else:
            self.lowered = self.plan = None

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass

    def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
        if self._runner is not None:
            return
        backend = state.backend
        if backend is None:
            raise RuntimeError("dpfx: a cached graph loaded outside a dpfx compile")
        from torch._inductor.cudagraph_utils import BoxedDeviceIndex
        from torch._inductor.utils import BoxedBool

        if state.device_index is None:
            state.device_index = BoxedDeviceIndex(None)
        # the pair's graph id, under which the backend pairs a backward with its forward, made
        # unique in this process (the entry's was given by another process's counter)
        kwargs = {**self._kwargs, "boxed_forward_device_index": state.device_index,
                  "cudagraphs": BoxedBool(False),
                  "graph_id": ("cached", state.serial, self._kwargs.get("graph_id"))}
        runner = trust.load(self, backend, example_inputs, constants, kwargs)
        if runner is not None:
            self._runner = runner
            state.compiled += 1
            return
        gm, inputs = _rebuild(self.graph, self._kwargs, example_inputs)
        if kwargs.get("is_backward"):
            self._runner = backend.compile_graph(gm, inputs, kwargs)
            return
        # the strides Inductor's forward gives its outputs, which the backward is compiled for
        # (aot_autograd records them so too)
        with torch._guards.TracingContext.report_output_strides() as strides:
            self._runner = backend.compile_graph(gm, inputs, kwargs)
        state.forward_strides = list(strides) if strides is not None else None


def output_code(trusted: trust.Trust, gm: fx.GraphModule, kwargs: dict, stages,
                compile: Callable[[], Callable]) -> DPOutputCode:
    """``compile()``'s runner for AOTAutogradCache: with the graph as aot_autograd handed it
    over (taken before ``compile`` rewrites it) and, where the compile made it trustable
    (``trusted``, the backend's ``Trust``), its lowered code and plan. ``stages``: the backend's
    ``Stages``."""
    graph = snapshot(gm)     # before dpfx's passes rewrite it
    before = dict(stages.graphs)
    trusted.begin()
    code = DPOutputCode(compile(), graph, kwargs)
    made = trusted.made(kwargs, {k: v for k, v in stages.graphs.items() if before.get(k) != v})
    if made is not None:
        code.lowered, code.plan = made
    return code


def _rebuild(graph: bytes, kwargs: dict, example_inputs) -> tuple[fx.GraphModule, list]:
    """The stored graph with fake values computed from the call's inputs (the forward) or from
    the rebuilt forward's outputs (the backward), and the inputs to compile it with."""
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    with pytree_registry_kept():
        loaded = GraphPickler.loads(graph, fake_mode)
    gm = fx.GraphModule(loaded, loaded.graph)
    if "shape_env" not in gm.__dict__:
        gm.shape_env = None
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    cached = {node: node.meta.get("val") for node in placeholders}
    if not kwargs.get("is_backward"):
        inputs = [x.detach() if isinstance(x, torch.Tensor) else x for x in example_inputs]
        if len(inputs) != len(placeholders):
            raise RuntimeError("dpfx: the cached graph's inputs do not match the call's")
        for ph, value in zip(placeholders, inputs):
            _check_shape(ph, value, cached[ph])
    else:
        # Each input is the entry's traced value, checked against the rebuilt forward's (a saved
        # value by its name, a tangent by the output it is the gradient of), and laid out as
        # the compiled forward lays that output out (aot_autograd does the same).
        outputs = state.forward_outputs
        if outputs is None:
            raise RuntimeError("dpfx: a cached backward loaded before its forward")
        index = {name: k for k, (name, _) in enumerate(outputs) if name is not None}
        strides = state.forward_strides or []
        inputs = []
        for ph in placeholders:
            desc = ph.meta.get("desc")
            if ph.name in index:
                k = index[ph.name]
                value = outputs[k][1]
                if isinstance(value, torch.Tensor):
                    _check_shape(ph, value, cached[ph])
                    value = _strided(cached[ph], strides[k] if k < len(strides) else None)
            elif type(desc).__name__ == "TangentAOTInput":
                _check_shape(ph, outputs[desc.output.idx][1], cached[ph])
                value = cached[ph]
            else:
                raise RuntimeError(f"dpfx: no value for the cached backward's input {ph.name}")
            inputs.append(value)
    with fake_mode:
        FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*inputs)
    if not kwargs.get("is_backward"):
        out = gm.graph.find_nodes(op="output")[0].args[0]
        state.forward_outputs = [(o.name, o.meta["val"]) if isinstance(o, fx.Node) else (None, o)
                                 for o in out]
    return gm, inputs


def _strided(value, stride):
    """``value`` with the static strides the compiled forward gave it, where they differ."""
    if not isinstance(value, torch.Tensor) or stride is None or \
            not all(isinstance(x, int) for x in stride) or \
            all(isinstance(a, int) and a == b for a, b in zip(value.stride(), stride)):
        return value
    with value.fake_mode:
        return torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device)


def _expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _check_shape(node: fx.Node, value, cached) -> None:
    """``cached`` (the entry's value of ``node``) has the dtype and shape of ``value`` (computed
    from the call's inputs), compared as expressions: no guard on the batch."""
    if not isinstance(value, torch.Tensor):
        return
    if not isinstance(cached, torch.Tensor) or cached.dtype != value.dtype or \
            len(cached.shape) != len(value.shape) or \
            any(_expr(a) != _expr(b) for a, b in zip(cached.shape, value.shape)):
        raise RuntimeError(f"dpfx: the cached graph's {node.name} does not match what its inputs "
                           f"give")


def canonical_attributes(gm: fx.GraphModule) -> None:
    """Inductor's FX-graph cache key pickles the module's attributes in their insertion order,
    which differs between a module aot_autograd built and one rebuilt from a cached graph: both
    are put in one order (names sorted), so that the same graph has the same key."""
    items = sorted(gm.__dict__.items())
    gm.__dict__.clear()
    gm.__dict__.update(items)
