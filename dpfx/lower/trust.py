"""Whether a warm start runs a cache entry's code as it is, and what an entry holds to be run
so: the one precondition, the graphs that may be written for a trusted start, the pairing of a
forward with its backward, the digest, and the load of a trusted entry's code.

    if trustable(gm, batch_symbols, config, validating):   # while compiling a forward
        backend.trust.forward(graph_id, lowered)
    runner = load(code, backend, example_inputs, constants, kwargs)   # on a cache hit

The entries themselves, and the rebuild of those not trusted, are lower/warm.py's (Note [A warm
start without the joint trace]).

# Note [A trusted warm start]
By default a hit does not rebuild: it runs the code the entry holds, as Inductor runs the code it
loads from the same directory (a writer of that directory can already run code as the user).
What dpfx decided about the graphs is as trustworthy as the code it lowered them to, so an entry
holds, beside the captured graph, the verdicts and what they cover:

- the rewritten graph's lowered code (Inductor's ``CompiledFxGraph``, serialized as Inductor's
  own cache serializes it), proven before it was lowered (a proof that refuses raises, and a
  compile that raises saves no entry);
- a plan: what the backend's runner needs (the backward's gradient outputs by parameter, the
  batch-free tangents that must be zero, whether the graph reads C_t) and the stage texts that
  ``DPFX_DUMP_DIR`` and ``dpfx.explain`` read;
- the pair's verdict name (``selfcheck.pair_verdict``: both graphs' FX-graph keys and code
  hashes, and what decides the check's runs). The self-check does not run at compile time, so
  the verdict lives beside the entry: a check that passes leaves a marker by that name
  (``dpfx_verdicts/`` in Inductor's cache directory). Without it the entry is rebuilt, proven
  and checked, and the pass leaves it.
- a sha256 over the plan, the code and the captured graph: an entry that does not match it (a
  torn write, a flipped byte) is a miss (``FXGraphCacheMiss``), so the compile runs dpfx's
  passes on a fresh trace and writes the entry again.

The key covers everything the verdicts depend on: the captured graph, torch's version and
Inductor's settings (AOTAutogradCache's own key), dpfx's source digest, the batch-size
decisions, every setting of ``DPConfig`` and the role of each graph input (a parameter by name,
a batch input, a constant, a captured loss's target), through the custom pass's uuid
(``lowering._CacheKey``). A changed bound, noise multiplier, strategy, noise placement or loss
reduction misses.

The forward and its backward are trusted together: the backward of a rebuilt forward is rebuilt;
a trusted forward whose backward cannot be is a miss of the pair. Not trusted, and so rebuilt
as above: a graph holding a block's kernels or a norm sink (state of the process that compiled
it), graphs whose self-check depends on non-batch sizes read at run time, ``self_check="always"``,
``dpfx.validate``, and every compile under ``DPFX_REPROVE=1`` (for auditors; the test suite sets
it, and tests/lower/test_warm_start.py runs both paths).
(tests/lower/test_warm_trust.py, tests/lower/test_warm_start.py)
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import pickle
import threading
from typing import Any, Callable

import torch
import torch.fx as fx

from dpfx.config import DPConfig
from dpfx.lower.selfcheck import pair_verdict, verdict_path


class _State(threading.local):
    trusted: int = 0                   # entries run as they are
    trusted_forward: Any = None        # the plan of the forward just loaded as it is


state = _State()


def may_trust(config: DPConfig, validating: bool) -> bool:
    """The precondition shared by writing an entry's code for a trusted start and by running
    it: the Inductor backend, no ``dpfx.validate`` (``validating``), no norm sink
    (``track_norms``) and no check at every new size (``self_check="always"``)."""
    return config.backend == "inductor" and not validating and not config.track_norms \
        and config.self_check != "always"


def trustable(gm: fx.GraphModule, batch_symbols, config: DPConfig, validating: bool) -> bool:
    """Whether a cache entry of this forward (and its backward) may run without the passes
    in a later process: the code holds nothing of this process (a block's kernels) and the
    self-check's verdict does not depend on sizes read at run time (``batch_symbols``: the
    forward's batch symbols, the only ones its inputs' sizes may hold)."""
    if not may_trust(config, validating):
        return False
    if any(str(n.target).startswith("dpfx.block_") for n in gm.graph.nodes
           if n.op == "call_function"):
        return False
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        sizes = value.shape if isinstance(value, torch.Tensor) else \
            [value] if isinstance(value, torch.SymInt) else []
        for size in sizes:
            if isinstance(size, torch.SymInt) and \
                    not size.node.expr.free_symbols <= set(batch_symbols):
                return False
    return True


def trusts(plan: dict, config: DPConfig, validating: bool) -> bool:
    """Whether this compile runs a cache entry's code as it is: its self-check passed before
    (its pair's verdict is on disk) or is off, and nothing here asks for the passes to run."""
    if not may_trust(config, validating):
        return False
    if config.self_check is False:
        return True
    pair = plan.get("pair")
    return pair is not None and os.path.exists(verdict_path(pair))


class Trust:
    """One backend's side of a trusted warm start: the lowered code and the plan of each graph
    it compiles that an entry may run as it is, a forward's paired with its backward's. A plan
    holds what the backend's runner needs (the backward's gradient outputs by parameter, the
    batch-free tangents that must be zero, whether the graph reads C_t or a padded batch's
    count), the stage texts the compile recorded and the pair's verdict name."""

    def __init__(self):
        self._made: tuple | None = None     # (lowered code, plan) of the graph being compiled
        self._plans: dict = {}      # graph id -> the forward's kept plan, until its backward
        self._forwards: dict = {}   # graph id -> a trustable forward's lowered code

    def begin(self) -> None:
        """A graph's compile starts: nothing made for it yet."""
        self._made = None

    def made(self, kwargs: dict, stages: dict) -> tuple | None:
        """The lowered code and plan an entry of the graph just compiled keeps for a trusted
        start, if any (``stages``: the stage texts its compile recorded); a backward's names
        its pair's verdict in its forward's plan too."""
        if self._made is None:
            return None
        from torch._inductor.output_code import CompiledFxGraph

        lowered, plan = self._made
        plan["stages"] = stages
        kept = isinstance(lowered, CompiledFxGraph)
        if kwargs.get("is_backward"):
            forward = self._plans.pop(kwargs.get("graph_id"), None)
            if forward is not None:
                forward["pair"] = plan["pair"]
        elif kept:
            self._plans[kwargs.get("graph_id")] = plan
        return (lowered, plan) if kept else None

    def forward(self, graph_id, lowered) -> None:
        """A trustable forward was lowered to ``lowered``."""
        self._made = (lowered, {"kind": "forward"})
        self._forwards[graph_id] = lowered

    def backward(self, graph_id, lowered, check, runner: dict | None) -> None:
        """A backward was lowered to ``lowered``; ``runner``: what its runner needs (None: it
        cannot be trusted). Trusted with its forward where both graphs' code is identified
        (``selfcheck.pair_verdict``); the pair's ``check`` then leaves its verdict by that
        name."""
        forward = self._forwards.pop(graph_id, None)
        if forward is None or runner is None:
            return
        plan = {"kind": "backward", **runner}
        plan["pair"] = pair_verdict(forward, lowered, check)
        if plan["pair"] is not None:
            self._made = (lowered, plan)
            if check is not None:
                check.verdict = plan["pair"]


@dataclasses.dataclass(frozen=True)
class TrustedGrad:
    """A parameter's gradient output in a graph loaded from a trusted cache entry."""
    name: str
    output_index: int



def load(code, backend, example_inputs, constants, kwargs: dict) -> Callable | None:
    """The runner of the entry ``code`` (lower/warm.py's ``DPOutputCode``) with its lowered
    code run as it is, where it may be; None: rebuild and prove the graph again."""
    from torch._functorch._aot_autograd.autograd_cache import FXGraphCacheMiss
    from torch._inductor.codecache import FxGraphCache

    backward = bool(kwargs.get("is_backward"))
    if backward and state.trusted_forward is None:
        return None         # the forward was rebuilt: its backward is too
    trusted = code.plan is not None and code.lowered is not None and \
        os.environ.get("DPFX_REPROVE") != "1" and \
        trusts(code.plan, backend.config, validating=backend.problems is not None)
    if not trusted:
        if backward:        # a trusted forward's backward that cannot be: compile both
            raise FXGraphCacheMiss("dpfx: a trusted forward's backward is not trusted")
        state.trusted_forward = None
        return None
    if code.digest != digest(code.plan, code.lowered, code.graph):
        forget(code.digest)
        raise FXGraphCacheMiss("dpfx: a cache entry does not match its digest; rebuilt")
    from dpfx.lower.cpu_builds import merged_cpu_builds

    # the module's kernels load as the lowering built them: merged units (Note [A graph's
    # C++ builds run while the next graph lowers]), found in the cache by their key; with
    # Inductor's own AsyncCompile each kernel was compiled again on its own
    with merged_cpu_builds():
        lowered, _ = FxGraphCache.cache_hit_post_compile(copy.copy(code.lowered), {}, constants)
    if lowered is None:
        raise FXGraphCacheMiss("dpfx: a cache entry's code no longer loads; rebuilt")
    lowered.post_compile(example_inputs, constants, {"is_backward": backward, **kwargs})
    runner = backend.load_trusted(code.plan, lowered, kwargs)
    state.trusted += 1
    state.trusted_forward = None if backward else code.plan
    return runner


def digest(plan: dict, lowered, graph: bytes) -> str:
    """What an entry's trusted path runs, hashed: the plan, the code and the captured graph."""
    found = hashlib.sha256(pickle.dumps(plan))
    found.update(str(lowered.source_code).encode())
    found.update(str(lowered.cache_key).encode())
    found.update(graph)
    return found.hexdigest()


def forget(digest: str | None) -> None:
    """Remove the AOTAutogradCache entries that hold ``digest`` (an entry that failed it): the
    compile that follows writes the entry again, and a lookup must not find the corrupted one
    first."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if not digest:
        return
    mark = digest.encode()
    for root, _, files in os.walk(os.path.join(cache_dir(), "aotautograd")):
        for name in files:
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    if mark in f.read():
                        os.remove(path)
            except OSError:
                pass
