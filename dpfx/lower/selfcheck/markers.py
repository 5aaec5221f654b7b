"""The self-check's markers: a passed check is not repeated, and a warm start may trust it.

    path = passed_marker(check, sizes)       # None: the code cannot be identified
    mark(path)                               # after the check passed
    mark(verdict_path(pair_verdict(forward_code, backward_code, check)))

The markers are empty files in Inductor's cache directory, named by a hash of what the check's
verdict depends on (Note [A self-check is not repeated on code it has passed]).
"""
from __future__ import annotations

import hashlib
import os

import torch

from dpfx.lower.selfcheck.batches import SIZES, sizes_served


# Note [A self-check is not repeated on code it has passed]
# The check tests the code Inductor generated for a pair of graphs, at fixed synthetic sizes. A
# user's second run of a script finds that code in Inductor's FX-graph cache and would test it
# again, a large share of a warm first step. So a check that
# passes leaves an empty marker file in Inductor's cache directory, named by a hash of what the
# check's verdict depends on:
# - each graph's FX-graph cache key (the graph Inductor compiled, which is also the eager
#   reference; its example inputs' metadata; Inductor's settings; torch's version; dpfx's
#   sources, through the key's custom-pass uuid: Note [dpfx's own FX-graph cache entries] in
#   lower/inductor.py) and the hash of the code it generated (``CompiledFxGraph.cache_key``);
# - what decides the check's runs and comparisons: the batch sizes it runs at, the graph's other
#   sizes, each output's batch layout and name, the inputs it synthesizes, whether the backward is
#   compared and whether the forward draws random numbers.
# A later check with the same hash is skipped: it would run the same code on the same sizes.
# Only the synthetic data's scale (from the user's batch) and the parameters' values differ,
# which decide no layout of the code, and so none of the bugs the check is for (code that mixes
# examples or assumed a batch size). A callable that is not a CompiledFxGraph with both keys
# (FX-graph caching off or bypassed, a test's wrapper) is always checked; so is a graph whose
# check failed (no marker), and ``self_check="always"`` checks every time. So is every graph on
# a GPU: Triton's autotuner picks each kernel's launch configuration (its block sizes) when the
# kernel first runs, which the code's hash does not name, and a kernel may be right under one
# configuration and wrong under another; Inductor's C++ code is fixed once generated. The marker holds no
# verdict to read, only its name: the proof (passes/verify/) still runs on every compile, and a marker
# can only skip a test that the same code passed.
# (tests/lower/test_selfcheck.py::test_passed_check_not_repeated_on_the_same_code)
def passed_marker(check: "GraphCheck", sizes: dict) -> str | None:
    """The marker file of this pair's check, or None where the code cannot be identified."""
    from torch._inductor.output_code import CompiledFxGraph
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if check.device.type != "cpu":
        return None     # Triton's autotuner picks launch configurations the code's hash omits
    keys = []
    for half in (check.forward, check.backward):
        if half is None:
            keys.append(None)
            continue
        code = half.compiled
        graph_key = getattr(code, "_fx_graph_cache_key", None)
        if not isinstance(code, CompiledFxGraph) or not isinstance(graph_key, str) \
                or not isinstance(code.cache_key, str):
            return None
        keys.append((graph_key, code.cache_key))
    halves = [None if h is None else (h.outputs, h.streamed, h.random, h.low_precision)
              for h in (check.forward, check.backward)]
    what = repr((keys, halves, check.layouts, sorted(check.batch_inputs), sorted(check.targets),
                 sizes_served(check.decisions), sorted((str(s), v) for s, v in sizes.items()),
                 check.compare_backward, SIZES, torch.__version__))
    name = hashlib.sha256(what.encode()).hexdigest()
    return os.path.join(cache_dir(), "dpfx_selfcheck", name)


def verdict_path(pair: str) -> str:
    """The marker of a passed check of the pair of compiled graphs named ``pair``."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "dpfx_verdicts", pair)


def pair_verdict(forward, backward, check: "GraphCheck | None") -> str | None:
    """The name of a passed check of this forward and backward's code (Note [A trusted warm
    start] in lower/trust.py): each graph's FX-graph cache key and its code's hash, and what
    decides the check's runs; None where the code cannot be identified."""
    from torch._inductor.output_code import CompiledFxGraph

    keys = []
    for code in (forward, backward):
        graph_key = getattr(code, "_fx_graph_cache_key", None)
        if not isinstance(code, CompiledFxGraph) or not isinstance(graph_key, str) \
                or not isinstance(code.cache_key, str):
            return None
        keys.append((graph_key, code.cache_key))
    checked = None if check is None else (
        check.layouts, sorted(check.batch_inputs), sorted(check.targets),
        sizes_served(check.decisions), check.compare_backward,
        [(h.outputs, h.streamed, h.random, h.low_precision) for h in (check.forward,)])
    what = repr((keys, checked, SIZES, torch.__version__))
    return hashlib.sha256(what.encode()).hexdigest()


def mark(path: str) -> None:
    """Create the marker file; a cache directory that cannot be written only costs a re-check."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a"):
            pass
    except OSError:
        pass
