"""Rewritten backward graphs kept on disk, so that a second process skips dpfx's rewrite.

    key = graph_cache.key_of(gm, fw, param_outputs, tangents, config, device)
    body = graph_cache.read(key)            # None: absent, unreadable, or not dpfx's format
    loaded = graph_cache.rebuild(body, gm, fake_mode)   # a new GraphModule, or CacheEntryError
    ...                                      # the caller re-proves it (passes.load_backward)
    graph_cache.write(key, gm)

Only Inductor-backend compiles use it (``dpfx.explain`` compiles with backend="eager" and reads
each rewrite's rules and costs, which an entry does not keep), and not with ``track_norms`` (its
graph names a per-process sink) or under ``dpfx.validate``. Entries live under
``$DPFX_GRAPH_CACHE`` (``off`` turns the cache off), by default ``dpfx/graphs`` in Inductor's
cache directory, next to the compiled code they lead to. Counters:
``torch._dynamo.utils.counters["dpfx"]``: ``graph_cache_hit``, ``graph_cache_miss``,
``graph_cache_stored``, ``graph_cache_rejected`` (read but not used, logged with the reason).

# Note [The graph cache trusts nothing it reads]
An entry is JSON, never pickle (unpickling runs code). It holds the rewritten graph's nodes
(op name, arguments, dpfx's tags), nothing else that matters to privacy: the placeholders and
their fake values are the captured graph's own, every other node's value is recomputed by running
its op on fake tensors, ops resolve only to ``torch.ops`` overloads and a few ``operator``
functions, sizes are rebuilt from a small set of sympy node types over the captured graph's own
symbols. Which output is which parameter's gradient, the tangents that must be zero at run time
and the DP settings come from this process's capture and config, not from the file. The loaded
graph then passes the same proof as a freshly rewritten one (``verify_backward``: every
parameter's gradient clipped to its group's C and noised with sigma * C), and the self-check
then compares what Inductor compiled against it. An entry that fails to parse, to rebuild or
the proof is counted as rejected and the graph is rewritten from the capture: a cache entry can
only cost time, never privacy. One thing cannot be undone: an op run on fake tensors that
teaches the shape environment a fact about a size (a runtime assert, a narrowed range). A
rebuild that changed those facts raises ``ShapeFactsChanged`` rather than compile under them.
What the proof does not cover is exactness: an entry edited to compute other, still clipped and
noised, gradients would pass; the cache directory is trusted for correctness as Inductor's own
is (tests/test_warm_cache.py).

The key hashes the captured backward graph's code and placeholder values (shapes, strides,
dtypes, symbolic sizes), the forward's batch layouts, which outputs are which parameters'
gradients, the DP settings that shape the graph, the device type, torch's version and dpfx's
sources (``lowering.source_digest``): another dpfx, torch or config never reads this entry.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import operator
import os

import sympy
import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch.fx.experimental.sym_node import SymNode
from torch.utils._sympy import functions as sympy_functions

from .durable import write_atomically
from .errors import CaptureError

log = logging.getLogger(__name__)

FORMAT = 1
_OPERATORS = {name: getattr(operator, name) for name in (
    "getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow", "eq", "ne",
    "lt", "le", "gt", "ge")}
_SYMPY = {cls.__name__: cls for cls in (
    sympy.Add, sympy.Mul, sympy.Pow, sympy.Max, sympy.Min, sympy_functions.FloorDiv,
    sympy_functions.CeilDiv, sympy_functions.Mod, sympy_functions.PythonMod,
    sympy_functions.CleanDiv, sympy_functions.ModularIndexing)}
_TAGS = ("dpfx", "dpfx_output", "dpfx_emitted", "stack_trace")


class ShapeFactsChanged(CaptureError):
    """Rebuilding an entry's nodes changed what the shape environment knows: not undoable."""


class CacheEntryError(ValueError):
    """An entry that cannot be turned back into a graph (or a graph that cannot be stored)."""


def directory() -> str | None:
    """Where entries live; None when ``DPFX_GRAPH_CACHE`` is ``off``, ``0`` or empty."""
    chosen = os.environ.get("DPFX_GRAPH_CACHE")
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "0", "off") else chosen
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return os.path.join(cache_dir(), "dpfx", "graphs")


def key_of(gm: fx.GraphModule, fw, param_outputs: dict, tangents: dict, config,
           device: torch.device) -> str:
    from .lowering import _source_digest

    settings = {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config)
                if f.name not in ("seed", "self_check", "track_norms")}
    placeholders = [(n.name, _describe(n.meta.get("val")))
                    for n in gm.graph.find_nodes(op="placeholder")]
    parts = [FORMAT, torch.__version__, _source_digest(), device.type, settings,
             sorted((str(s) for s in fw.batch_symbols)),
             sorted((k, repr(v)) for k, v in fw.layouts.items()),
             [repr(v) for v in fw.output_layouts],
             sorted(param_outputs.items()), sorted(tangents.items()), placeholders, gm.code]
    return hashlib.sha256(json.dumps(parts, default=repr).encode()).hexdigest()


def _describe(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{val.dtype}{list(val.shape)}{list(val.stride())}{val.device.type}"
    return repr(val)


def read(key: str) -> dict | None:
    root = directory()
    if root is None:
        return None
    try:
        with open(os.path.join(root, key + ".json"), "rb") as f:
            body = json.loads(f.read())
    except FileNotFoundError:
        counters["dpfx"]["graph_cache_miss"] += 1
        return None
    except (OSError, ValueError) as e:
        rejected(key, e)
        return None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        rejected(key, CacheEntryError("not an entry of this format"))
        return None
    return body


def write(key: str, gm: fx.GraphModule) -> None:
    """Store the rewritten graph; a graph holding something this format cannot name is not
    stored (it is rewritten again next time)."""
    root = directory()
    if root is None:
        return
    try:
        nodes = [_encode_node(n) for n in gm.graph.nodes]
    except CacheEntryError:
        counters["dpfx"]["graph_cache_unstorable"] += 1
        return
    body = {"format": FORMAT, "nodes": nodes}
    try:
        data = json.dumps(body).encode()
        os.makedirs(root, exist_ok=True)
        write_atomically(os.path.join(root, key + ".json"), data)
    except (OSError, TypeError, ValueError):
        return   # a read-only or full cache directory costs the next process time only
    counters["dpfx"]["graph_cache_stored"] += 1


def rejected(key: str, why: BaseException) -> None:
    counters["dpfx"]["graph_cache_rejected"] += 1
    log.warning("dpfx graph cache: entry %s not used, the graph is rewritten instead: %s: %s",
                key, type(why).__name__, why)


def hit() -> None:
    counters["dpfx"]["graph_cache_hit"] += 1


# -- encoding ------------------------------------------------------------------------------------
def _encode_node(n: fx.Node) -> dict:
    tags = {k: n.meta[k] for k in _TAGS if isinstance(n.meta.get(k), (str, bool, int))}
    if n.op not in ("placeholder", "call_function", "output"):
        raise CacheEntryError(f"node kind {n.op}")
    target = _encode_target(n.target) if n.op == "call_function" else n.target
    return {"op": n.op, "name": n.name, "target": target, "args": _encode(n.args),
            "kwargs": _encode(dict(n.kwargs)), "tags": tags}


def _encode_target(target) -> list:
    if isinstance(target, torch._ops.OpOverload):
        return ["op", target.namespace, target._opname, target._overloadname]
    if isinstance(target, torch._ops.HigherOrderOperator):
        return ["hop", target.name()]
    if getattr(target, "__module__", None) in ("_operator", "operator") \
            and _OPERATORS.get(target.__name__) is target:
        return ["operator", target.__name__]
    raise CacheEntryError(f"target {target!r}")


def _encode(x):
    if isinstance(x, fx.Node):
        return {"node": x.name}
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, (int, float)):
        return x if not isinstance(x, float) or x == x and abs(x) != float("inf") \
            else {"float": repr(x)}
    if isinstance(x, (list, tuple)):
        return {"list" if isinstance(x, list) else "tuple": [_encode(v) for v in x]}
    if isinstance(x, dict):
        if not all(isinstance(k, str) for k in x):
            raise CacheEntryError("a dict with non-string keys")
        return {"dict": {k: _encode(v) for k, v in x.items()}}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, torch.layout):
        return {"layout": str(x).removeprefix("torch.")}
    if isinstance(x, torch.memory_format):
        return {"memory_format": str(x).removeprefix("torch.")}
    if isinstance(x, torch.SymInt):
        return {"symint": _encode_expr(x.node.expr)}
    if isinstance(x, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return {"target": _encode_target(x)}
    raise CacheEntryError(f"argument of type {type(x).__name__}")


def _encode_expr(e) -> list:
    if isinstance(e, sympy.Symbol):
        return ["Symbol", e.name]
    if isinstance(e, sympy.Integer):
        return ["Integer", int(e)]
    if type(e).__name__ in _SYMPY:
        return [type(e).__name__, *[_encode_expr(a) for a in e.args]]
    raise CacheEntryError(f"size expression {e}")


# -- decoding ------------------------------------------------------------------------------------
def rebuild(body: dict, captured: fx.GraphModule, fake_mode) -> fx.GraphModule:
    """A new GraphModule with ``captured``'s placeholders (and their fake values) and the
    entry's other nodes, each node's value recomputed on fake tensors. Raises CacheEntryError
    (or whatever the ops raise on arguments that do not fit) for an entry that does not fit."""
    placeholders = list(captured.graph.find_nodes(op="placeholder"))
    symbols = {}
    for ph in placeholders:
        _collect_symbols(ph.meta.get("val"), symbols)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    records = body["nodes"]
    if [r["name"] for r in records if r["op"] == "placeholder"] != [p.name for p in placeholders]:
        raise CacheEntryError("the entry's placeholders are not the captured graph's")
    by_name = {p.name: p for p in placeholders}
    decoder = _Decoder(env, symbols, fake_mode)
    facts = _facts(fake_mode.shape_env)
    try:
        _rebuild_nodes(graph, records, env, by_name, decoder, fake_mode)
    finally:
        if _facts(fake_mode.shape_env) != facts:
            raise ShapeFactsChanged(
                "a dpfx graph cache entry taught the shape environment new facts about the "
                "sizes while its nodes were rebuilt; dpfx cannot undo that, so it stops rather "
                "than compile under them. Delete the cache directory (DPFX_GRAPH_CACHE, default "
                "dpfx/graphs in Inductor's cache directory) or set DPFX_GRAPH_CACHE=off.")
    for node in graph.nodes:
        _check_symbols(node.meta.get("val"), symbols)
    graph.lint()
    return fx.GraphModule(captured, graph)


def _facts(shape_env) -> tuple:
    """What the shape environment knows about sizes (an entry's ops must not add to it:
    Note [The graph cache trusts nothing it reads])."""
    if shape_env is None:
        return ()
    return (dict(shape_env.replacements), dict(shape_env.var_to_range),
            shape_env.num_deferred_runtime_asserts, len(shape_env.guards),
            dict(getattr(shape_env, "axioms", {})))


def _rebuild_nodes(graph, records, env, by_name, decoder, fake_mode) -> None:
    with fake_mode:
        for r in records:
            if r["op"] == "placeholder":
                ph = by_name[r["name"]]
                node = graph.placeholder(ph.name, type_expr=ph.type)
                node.meta.update(ph.meta)
            elif r["op"] == "call_function":
                target = _decode_target(r["target"])
                args, kwargs = decoder(r["args"]), decoder(r["kwargs"])
                if not isinstance(args, tuple) or not isinstance(kwargs, dict):
                    raise CacheEntryError("malformed arguments")
                node = graph.create_node("call_function", target, args, kwargs, name=r["name"])
                node.meta["val"] = target(*_vals(args), **_vals(kwargs))
            elif r["op"] == "output":
                node = graph.output(decoder(r["args"])[0])
            else:
                raise CacheEntryError(f"node kind {r['op']!r}")
            if node.name != r["name"]:
                raise CacheEntryError(f"node name {r['name']!r} clashes")
            for k, v in r.get("tags", {}).items():
                if k in _TAGS and isinstance(v, (str, bool, int)):
                    node.meta[k] = v
            env[node.name] = node


def _collect_symbols(val, found: dict) -> None:
    sizes = [*val.shape, *val.stride()] if isinstance(val, torch.Tensor) else [val]
    for s in sizes:
        if isinstance(s, torch.SymInt):
            for sym in s.node.expr.free_symbols:
                found[sym.name] = sym


def _check_symbols(val, known: dict) -> None:
    """A node whose value has a size symbol the capture does not have (an op that made a new
    unbacked size) is not taken from the cache."""
    vals = val if isinstance(val, (tuple, list)) else [val]
    for v in vals:
        seen: dict = {}
        if isinstance(v, (torch.Tensor, torch.SymInt)):
            _collect_symbols(v, seen)
        if set(seen) - set(known):
            raise CacheEntryError(f"new size symbols {sorted(set(seen) - set(known))}")


def _vals(x):
    if isinstance(x, fx.Node):
        return x.meta["val"]
    if isinstance(x, (list, tuple)):
        return type(x)(_vals(v) for v in x)
    if isinstance(x, dict):
        return {k: _vals(v) for k, v in x.items()}
    return x


def _decode_target(t):
    if not isinstance(t, list) or not t:
        raise CacheEntryError(f"target {t!r}")
    try:
        if t[0] == "op" and len(t) == 4:
            packet = getattr(getattr(torch.ops, t[1]), t[2])
            op = getattr(packet, t[3])
            if isinstance(op, torch._ops.OpOverload):
                return op
        elif t[0] == "hop" and len(t) == 2:
            op = getattr(torch.ops.higher_order, t[1])
            if isinstance(op, torch._ops.HigherOrderOperator):
                return op
        elif t[0] == "operator" and len(t) == 2 and t[1] in _OPERATORS:
            return _OPERATORS[t[1]]
    except (AttributeError, RuntimeError, TypeError):
        pass
    raise CacheEntryError(f"target {t!r}")


class _Decoder:
    def __init__(self, env: dict, symbols: dict, fake_mode):
        self.env, self.symbols, self.shape_env = env, symbols, fake_mode.shape_env

    def __call__(self, x):
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if not isinstance(x, dict) or len(x) != 1:
            raise CacheEntryError(f"value {x!r}")
        (kind, v), = x.items()
        if kind == "node":
            if v not in self.env:
                raise CacheEntryError(f"node {v!r} used before it is defined")
            return self.env[v]
        if kind in ("list", "tuple") and isinstance(v, list):
            return (list if kind == "list" else tuple)(self(e) for e in v)
        if kind == "dict" and isinstance(v, dict):
            return {k: self(e) for k, e in v.items()}
        if kind == "float" and v in ("inf", "-inf", "nan"):
            return float(v)
        if kind == "symint":
            expr = self.expr(v)
            if isinstance(expr, sympy.Integer):
                return int(expr)
            return torch.SymInt(SymNode(expr, self.shape_env, int, None))
        if kind == "target":
            return _decode_target(v)
        named = {"dtype": torch.dtype, "layout": torch.layout,
                 "memory_format": torch.memory_format}
        if kind in named and isinstance(getattr(torch, str(v), None), named[kind]):
            return getattr(torch, v)
        if kind == "device" and isinstance(v, str):
            return torch.device(v)
        raise CacheEntryError(f"value {x!r}")

    def expr(self, e) -> sympy.Expr:
        if not isinstance(e, list) or not e:
            raise CacheEntryError(f"size expression {e!r}")
        if e[0] == "Symbol" and len(e) == 2 and e[1] in self.symbols:
            return self.symbols[e[1]]
        if e[0] == "Integer" and len(e) == 2 and isinstance(e[1], int) \
                and not isinstance(e[1], bool):
            return sympy.Integer(e[1])
        if e[0] in _SYMPY:
            return _SYMPY[e[0]](*[self.expr(a) for a in e[1:]])
        raise CacheEntryError(f"size expression {e!r}")
