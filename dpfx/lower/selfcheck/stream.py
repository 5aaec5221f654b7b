"""The eager reference's gradients, each measured against the compiled one's as it is released.

    streamed = stream_graph(graph)     # rewrites an eager copy's release into one call per sum
    recording.got, recording.measured = compiled_grads, {}
    reference(ref_args)                # each gradient goes to record(), is measured, let go

Note [The eager reference compares each gradient as it is released] is the design; the state a
run shares with ``record`` is ``recording`` (one per thread).
"""
from __future__ import annotations

import collections
import operator
import threading
from typing import Callable

import torch
import torch.fx as fx

from dpfx.lower.selfcheck.compare import measure
from dpfx.ops import noise as cpu_noise


def fresh(node) -> bool:
    """Whether ``node``'s value is a tensor no other value of the graph shares storage with."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return fresh(node.args[0]) and isinstance(node.args[0].meta.get("val"), (list, tuple))
    schema = getattr(node.target, "_schema", None)
    return isinstance(node.target, torch._ops.OpOverload) and schema is not None and \
        not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


# Note [The eager reference compares each gradient as it is released]
# The compiled backward hands back every parameter's gradient at once, and so would an eager run of
# the verified graph: its one dpfx::add_noise_ over all clipped sums sits at the end of the
# backward, so every sum would stay alive until then, beside its clone, and then beside the compiled
# gradients. So the eager copy of a backward releases each clipped sum on its own, right after the
# op that computes it (or after the last value its release reads), moves and casts it to the output
# as the graph does, and hands it to ``record``, which measures it against the compiled backward's
# output (run first) and lets both go; the graph returns None in that output's place. The check
# holds at most one set of gradients, which shrinks as the reference releases its own (figures:
# BENCHMARKS.md, "Levers in the code"). What is left over a step's: the compiled gradients, held
# while the eager copy computes the norms, and both forwards' saved tensors.
# One call per sum computes what the single call does only without noise: each sum's release
# is then (s * multiplier) / divisor, its own alone; with noise, every call would draw tensor
# 0's stream. So ``record`` refuses to run outside ``cpu_noise.noiseless()``, where the check's
# backward runs. A graph whose release has any other shape is left whole: its outputs are
# returned and compared after the run.
def stream_releases(gm: fx.GraphModule) -> tuple[int, ...]:
    """Rewrites ``gm`` (an eager copy) so that each dpfx::add_noise_ sum is released, cast and
    handed to ``record`` as soon as it is computed; returns the output positions so handed."""
    streamed = stream_graph(gm.graph)
    if streamed:
        gm.recompile()
    return streamed


def stream_graph(graph: fx.Graph) -> tuple[int, ...]:
    """``stream_releases`` on the graph alone."""
    output = graph.find_nodes(op="output")[0]
    outs = output.args[0]
    if not isinstance(outs, (list, tuple)):
        return ()
    calls = [n for n in graph.find_nodes(op="call_function",
                                         target=torch.ops.higher_order.auto_functionalized_v2)
             if n.args[:1] == (torch.ops.dpfx.add_noise_.default,)]
    order = {n: i for i, n in enumerate(graph.nodes)}
    # (sets and counts, not list scans: GPT-2 small's call has 148 bases and 148 outputs)
    at = collections.defaultdict(list)     # an output's positions, by identity
    for i, o in enumerate(outs):
        at[id(o)].append(i)
    plans = []
    for call in calls:
        bases = call.kwargs.get("_all_bases", [])
        n = call.kwargs.get("_sums_length")
        if n != len(bases) or any(call.kwargs.get(f"_sums_{k}_base_index") != k
                                  for k in range(len(bases))):
            return ()
        times = collections.Counter(bases)
        call_reads = [a for a in call.all_input_nodes if a not in times]
        for item in call.users:
            if item.target is not operator.getitem or not isinstance(item.args[1], int) or \
                    not 1 <= item.args[1] <= n:
                return ()
            base = bases[item.args[1] - 1]
            if not fresh(base) or set(base.users) != {call} or times[base] != 1:
                return ()
            # each output the sum releases: the sum itself, or a chain of single-user ops from
            # it (a stacked sum: one slice per parameter, Note [Vector parameters' per-sample
            # gradients stacked] in passes/clip_noise.py)
            ends = []
            for first in ([item] if len(item.users) == 1 else list(item.users)):
                chain, node = [first], first
                while len(node.users) == 1 and next(iter(node.users)).op == "call_function":
                    node = next(iter(node.users))
                    chain.append(node)
                if list(node.users) != [output] or len(at[id(node)]) != 1 or \
                        chain[0] is not item and first.op != "call_function":
                    return ()
                ends.append((chain if chain[0] is not item else chain[1:], at[id(node)][0]))
            links = {item, *(c for chain, _ in ends for c in chain)}
            if len(links) != 1 + sum(len(chain) for chain, _ in ends):
                return ()   # two chains meet
            reads = [a for a in call_reads if a not in links] + [
                a for c in links for a in c.all_input_nodes
                if a not in links and a is not call and a not in times]
            plans.append((call, base, item, ends, max((base, *reads), key=order.__getitem__)))
    if not plans:
        return ()
    streamed, new_outs = [], list(outs)
    for call, base, item, ends, after in plans:
        kwargs = {k: v for k, v in call.kwargs.items()
                  if k in ("std", "multiplier", "divisor")}
        with graph.inserting_after(after):
            one = graph.call_function(
                torch.ops.higher_order.auto_functionalized_v2, call.args,
                {**kwargs, "_sums_length": 1, "_sums_0_base_index": 0, "_all_bases": [base],
                 "_only_clone_these_bases": ()})
        item.args = (one, 1)
        one.append(item)
        last = item
        for chain, position in ends:
            for node in chain:
                last.append(node)
                last = node
            with graph.inserting_after(last):
                last = graph.call_function(record, (position, chain[-1] if chain else item))
            new_outs[position] = None
            streamed.append(position)
    output.args = (type(outs)(new_outs),)
    for call in calls:
        graph.erase_node(call)
    graph.lint()
    return tuple(streamed)


class _Recording(threading.local):
    got: list | None = None           # the compiled backward's outputs
    measured: dict | None = None      # output position -> _Measure
    seen: Callable | None = None      # takes each compiled output before it is let go
    collect: dict | None = None       # output position -> the reference's gradient (_blame)


recording = _Recording()


def record(position: int, want: torch.Tensor) -> None:
    """The eager reference's gradient at ``position`` (Note [The eager reference compares each
    gradient as it is released]): measured against the compiled one's, then both let go."""
    if (recording.measured is None and recording.collect is None) or \
            not cpu_noise.silenced():
        raise RuntimeError("dpfx's self-check ran its streamed reference outside the check")
    if recording.collect is not None:
        recording.collect[position] = want
        return
    recording.measured[position] = measure(recording.got[position], want)
    if recording.seen is not None:
        recording.seen(position, recording.got[position])
    recording.got[position] = None

