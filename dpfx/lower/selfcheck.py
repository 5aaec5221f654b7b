"""A self-test of the compiled code, run once per graph before it trains on real data.

    check = GraphCheck(forward_graph, layouts, batch_symbols, ...)   # at compile time
    check.run(real_args)    # first call: raises PrivacyError if the compiled code is wrong

# Note [Checking what Inductor generated]
The verifier proves the FX graph; Inductor then generates the code that runs, and torch's handling
of an unbacked batch has had bugs the graph cannot show (Note [Inductor must not assume what it
cannot check] in lower/exact.py: a head split that mixed examples). So before a compiled forward and
backward pair first runs on the user's data, dpfx runs both on synthetic batches of SIZES examples
(Note [The self-check's two batch sizes]) built like the user's inputs (floats with the inputs'
mean and spread, integers within the inputs' range (a captured loss's integer targets: drawn
from the values they hold), boolean rows copied from the inputs) and with the real parameters,
and checks:

1. **Exact**: every output of the compiled forward, and every gradient output of the compiled
   backward (fed the compiled forward's saved tensors and random output gradients), matches the
   same graph run by the FX interpreter: ||got - want|| <= tol (||want|| + sqrt(n) s), tol 1e-3
   (2e-2 for 16-bit floats), s the largest RMS entry among the graph's outputs (Note [The
   self-check's floor scales with the graph]).
   The backward runs without noise: dpfx's CPU noise op adds zero during the check (Note [The
   self-check's backward runs without noise] in ops/noise.py: noise of the model's size would
   set the tolerance and hide the clipped sums). On GPU the noise is Inductor's own Philox in
   the graph, so the backward comparison runs only with noise="optimizer" there. A forward with
   random ops of its own (dropout) is compared only through check 2, since Inductor may
   schedule its draws in another order.
2. **Per-example independence**: changing example 0 of every input changes no other example's
   rows in any forward output (activations saved for the backward included), and no batch-free
   output at all. The batch layout of each output comes from dpfx's batch analysis.

Where the backward's release is known, check 1 runs at the smaller size only, and the larger
size adds an example before the smaller batch's: its forward rows must be the smaller size's
(check 2, and no assumed size), and its release may move by at most one example's clip bound
(Note [The second size grows the first]).

A failure raises ``PrivacyError`` before any gradient is computed from the user's data. It costs
two compiled runs of the forward and the backward and one eager run of each (at each size, and
a third compiled forward, where the sizes are not grown); its share of the first step is in
BENCHMARKS.md. ``dpfx.compile(..., self_check=False)`` skips it. Code that has passed it once is
not checked again (Note [A self-check is not repeated on code it has passed]), unless
``self_check="always"``.
tests/lower/test_selfcheck.py hands it deliberately miscompiled graphs.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import operator
import os
import threading
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
from torch.fx.graph import _BoxedCodeGen
import torch.utils._python_dispatch

from dpfx.capture import batch_branches
from dpfx.lower.cpu_builds import finish_builds
from dpfx.ops import noise as cpu_noise
from dpfx.errors import PrivacyError
from dpfx.passes.clip_noise import REAL_EXAMPLES
from dpfx.graph.batch import BatchDim

# Note [The second size grows the first]
# Comparing both sizes with the eager reference, each with its own independence run, takes ten
# graph runs, half of them eager: on a large model a third of torch.compile's whole cold first
# step. So where the backward's release is known (the backend sets
# ``release``: not under adaptive clipping or padded batches; not for 16-bit or random forwards,
# whose rows would not agree across sizes to the budget; not with a captured loss, whose saved
# terms carry the loss's normalizers, 1/B among them), the larger size B + 1 runs compiled only,
# on a batch whose examples 1.. are the smaller batch's, with the same output gradients on them:
# - the compiled forward at both sizes, before the larger backward runs (it may reuse its
#   donated saved tensors' buffers): every example's rows of every batch-laid output (saved
#   activations included) must be the same at B and at B + 1 with an example added before it,
#   and batch-free outputs the same. This is the independence test (what changing example 0
#   would change, adding it changes) and the test that no code assumed either size.
# - the compiled backward at both sizes, noiseless, the shared examples' output gradients the
#   same up to the mean's 1/B (Note [A mean's output gradients carry 1/B]): with S the released
#   sums times D, the added example may move S by at most its clip bound,
#       ||S(B + 1) - S(B)|| <= sqrt(sum_g C_g^2) (1 + 1e-3) + 1e-4 ||S(B)||,
#   the canary test, on the generated code at the larger size.
# - the smaller size is compared with the eager reference, forward and backward: the
#   comparison of the generated code against the proven graph.
# What the larger size does not show: a backward wrong there by less than one example's bound (a
# utility error, not a leak: mixing examples moves the sum by more). The check costs six runs, two
# of them eager (figures: BENCHMARKS.md, "Levers in the code"). Elsewhere both sizes run the full
# comparison. (tests/lower/test_selfcheck.py::test_code_wrong_at_the_larger_size_only_is_refused)

# Note [A mean's output gradients carry 1/B]
# Under loss_reduction="mean" the output gradients a backward receives carry the loss's 1/B, and
# the graph takes it off with the batch size of the call: each example's gradient is B times the
# one the graph computes from them (passes/clip_noise.py). The grown check draws the larger
# size's output gradients and gives the smaller size the same rows; fed as they are, every
# shared example's gradient at B + 1 would be (B + 1)/B times its gradient at B, and each
# unclipped example would move the sum by 1/B of its norm. With some examples near C and the
# added one clipped, that passed C on correct code, at some C and not others. So for a mean the
# smaller size's output gradients are the larger's rows times (B + 1)/B, as a mean loss's would
# be: every shared example's gradient is then the same at both sizes, and only the added one
# moves S. The backward is linear in its output gradients, so this is exact up to rounding.
# (tests/lower/test_selfcheck_sweep.py: C swept across the examples' norms, both reductions)

# Note [The self-check's two batch sizes]
# Two sizes, so that code which assumed one batch size fails at the other; neither is 1, which
# torch's size-oblivious reasoning sets apart, and 2 and 3 differ in parity. They are the
# smallest such pair because the check's time and memory are its graph runs, in proportion to
# the examples (BENCHMARKS.md, "Levers in the code"). Neither pair runs the vector body of a kernel
# over [B] (16 lanes): both run only its tail.
SIZES = (2, 3)


def eager_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph as it is now, kept for running eagerly (lowering rewrites ``gm`` in place), its
    mutating calls on dead intermediates made in place (Note [The eager reference mutates in
    place where nothing else sees it])."""
    return fx.GraphModule(gm, _eager_graph(gm))


def _eager_graph(gm: fx.GraphModule) -> fx.Graph:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.find_nodes(op="call_function",
                                 target=torch.ops.higher_order.auto_functionalized_v2):
        _mutate_in_place(node)
    _sink_tensor_sources(graph)
    graph.set_codegen(_BoxedCodeGen())    # Note [The self-check's runs free their inputs]
    return graph


def _attributes(gm: fx.GraphModule, graph: fx.Graph) -> dict:
    """What the graph's get_attr nodes read from ``gm``, by name, as it is now: the root of the
    module built from ``graph`` later (Note [The eager reference is built when the check runs])."""
    values = {}
    for node in graph.find_nodes(op="get_attr"):
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        values[node.target] = value
    return values


# Note [The eager reference creates a tensor where it is first read]
# A captured graph may create a tensor from sizes alone long before it reads it: GPT-2 small's
# backward makes the [V, d] zeros its tied table's clipped sum accumulates into near its start,
# and reads them at its end. Inductor allocates a buffer when it is needed; the eager run held
# them through the whole backward, at the check's peak (GPT-2 small's are 154 MB). So in the
# eager copy a node that
# makes a tensor from no tensor (``full``, ``zeros``, ``scalar_tensor``, ``iota``; never a
# random op, whose place in the order decides its draws) moves to just before its first reader:
# the same values, created later.
def _sink_tensor_sources(graph: fx.Graph) -> None:
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or not node.users \
                or not isinstance(node.target, torch._ops.OpOverload) \
                or torch.Tag.nondeterministic_seeded in node.target.tags \
                or not isinstance(node.meta.get("val"), torch.Tensor) \
                or any(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes):
            continue
        min(node.users, key=order.__getitem__).prepend(node)


# Note [The eager reference mutates in place where nothing else sees it]
# A mutating op in a captured graph is ``auto_functionalized_v2(op, _all_bases=[...])``: run
# eagerly, it clones every base and mutates the clones. The release of a CPU graph is one such
# call, ``dpfx::add_noise_`` on every parameter's clipped sum (ops/noise.py), so an eager run of
# the verified backward would hold two copies of the model's gradients at once, one more than
# the compiled backward, whose lowering re-inplaces the call. A base that is a fresh
# value of the graph (computed by an op whose result aliases none of its inputs) and that no node
# but this call reads is invisible to the rest of the graph once the call starts, so mutating it
# in place computes the same values: ``_only_clone_these_bases`` lists the others, which keep
# their clones (graph inputs, views, values read elsewhere).
def _mutate_in_place(node: fx.Node) -> None:
    bases = node.kwargs.get("_all_bases", [])
    keep = node.kwargs.get("_only_clone_these_bases")
    keep = range(len(bases)) if keep is None else keep
    node.kwargs = {**node.kwargs, "_only_clone_these_bases": tuple(
        i for i in keep if not (_fresh(bases[i]) and set(bases[i].users) == {node}))}


def _fresh(node) -> bool:
    """Whether ``node``'s value is a tensor no other value of the graph shares storage with."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _fresh(node.args[0]) and isinstance(node.args[0].meta.get("val"), (list, tuple))
    schema = getattr(node.target, "_schema", None)
    return isinstance(node.target, torch._ops.OpOverload) and schema is not None and \
        not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


# Note [The eager reference is built when the check runs]
# Lowering rewrites the graph in place, so the check's copy is taken before; but a check may never
# run (Note [A self-check is not repeated on code it has passed]): on a warm cache, generating and
# compiling the copies' Python would be nearly all of it. So a Half holds the copied graph and the
# values its get_attr nodes read, and builds the module at its first use.
@dataclasses.dataclass
class Half:
    """One graph (forward or backward): its eager copy, compiled callable and placeholders."""
    eager: fx.GraphModule | tuple[fx.Graph, dict]   # the copy, or what builds it
    compiled: Callable
    inputs: list[tuple[str, Any]]         # placeholder name, meta value
    outputs: list[str | None]             # output node names (saved tensors keep them)
    output_vals: list[Any]                # their meta values
    random: bool                          # has random ops besides dpfx's noise
    low_precision: bool = False           # computes in 16-bit floats somewhere (autocast)
    streamed: tuple[int, ...] = ()        # outputs the reference hands to _record, not returns

    @classmethod
    def of(cls, gm: fx.GraphModule, compiled: Callable) -> "Half":
        out = gm.graph.find_nodes(op="output")[0].args[0]
        out = out if isinstance(out, (list, tuple)) else [out]
        graph = _eager_graph(gm)
        streamed = _stream_graph(graph)
        eager = (graph, _attributes(gm, graph)) \
            if not graph.find_nodes(op="call_module") else fx.GraphModule(gm, graph)
        return cls(eager, compiled,
                   [(n.name, n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder")],
                   [o.name if isinstance(o, fx.Node) else None for o in out],
                   [o.meta.get("val") if isinstance(o, fx.Node) else None for o in out],
                   _has_random_ops(gm), _computes_in_16_bits(gm), streamed)

    @property
    def reference(self) -> fx.GraphModule:
        if isinstance(self.eager, tuple):
            graph, attributes = self.eager
            self.eager = fx.GraphModule(attributes, graph)
        return self.eager


def _computes_in_16_bits(gm: fx.GraphModule) -> bool:
    """Whether a value of the graph is a 16-bit float: its float32 outputs (norms, clipped sums
    under bfloat16 autocast) then carry 16-bit rounding, which Inductor's fused kernels and the
    eager graph accumulate differently."""
    return any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.is_floating_point()
               and v.element_size() <= 2 for n in gm.graph.nodes)


# Note [The eager reference compares each gradient as it is released]
# The compiled backward hands back every parameter's gradient at once, and so would an eager run of
# the verified graph: its one dpfx::add_noise_ over all clipped sums sits at the end of the
# backward, so every sum would stay alive until then, beside its clone, and then beside the compiled
# gradients. So the eager copy of a backward releases each clipped sum on its own, right after the
# op that computes it (or after the last value its release reads), moves and casts it to the output
# as the graph does, and hands it to ``_record``, which measures it against the compiled backward's
# output (run first) and lets both go; the graph returns None in that output's place. The check
# holds at most one set of gradients, which shrinks as the reference releases its own (figures:
# BENCHMARKS.md, "Levers in the code"). What is left over a step's: the compiled gradients, held
# while the eager copy computes the norms, and both forwards' saved tensors.
# One call per sum computes what the single call does only without noise: each sum's release
# is then (s * multiplier) / divisor, its own alone; with noise, every call would draw tensor
# 0's stream. So ``_record`` refuses to run outside ``cpu_noise.noiseless()``, where the check's
# backward runs. A graph whose release has any other shape is left whole: its outputs are
# returned and compared after the run.
def _stream_releases(gm: fx.GraphModule) -> tuple[int, ...]:
    """Rewrites ``gm`` (an eager copy) so that each dpfx::add_noise_ sum is released, cast and
    handed to ``_record`` as soon as it is computed; returns the output positions so handed."""
    streamed = _stream_graph(gm.graph)
    if streamed:
        gm.recompile()
    return streamed


def _stream_graph(graph: fx.Graph) -> tuple[int, ...]:
    """``_stream_releases`` on the graph alone."""
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
            if not _fresh(base) or set(base.users) != {call} or times[base] != 1:
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
                last = graph.call_function(_record, (position, chain[-1] if chain else item))
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


_recording = _Recording()


def _record(position: int, want: torch.Tensor) -> None:
    """The eager reference's gradient at ``position`` (Note [The eager reference compares each
    gradient as it is released]): measured against the compiled one's, then both let go."""
    if (_recording.measured is None and _recording.collect is None) or \
            not cpu_noise.silenced():
        raise RuntimeError("dpfx's self-check ran its streamed reference outside the check")
    if _recording.collect is not None:
        _recording.collect[position] = want
        return
    _recording.measured[position] = _measure(_recording.got[position], want)
    if _recording.seen is not None:
        _recording.seen(position, _recording.got[position])
    _recording.got[position] = None


def _has_random_ops(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and torch.Tag.nondeterministic_seeded in n.target.tags
               and n.meta.get("dpfx") != "noise" and _dropout_p(n) != 0
               for n in gm.graph.nodes)


def _dropout_p(node: fx.Node):
    """An op's ``dropout_p`` argument (SDPA kernels are tagged random for their dropout)."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dropout_p":
            if arg.name in node.kwargs:
                return node.kwargs[arg.name]
            return node.args[i] if i < len(node.args) else arg.default_value
    return None


class GraphCheck:
    def __init__(self, forward: Half, layouts: list, batch_symbols: set, batch_inputs: set,
                 device: torch.device, decisions: list = (), targets: set = frozenset(),
                 always: bool = False):
        self.forward = forward
        self.always = always          # self_check="always": run even on code that passed before
        self.skipped = False          # the code had passed before: the check did not run
        self.targets = targets        # a captured loss's targets (loss/captured.py)
        self.backward: Half | None = None
        self.compare_backward = True
        self.layouts = layouts
        self.batch_symbols = batch_symbols
        self.batch_inputs = batch_inputs
        self.device = device
        self.decisions = decisions    # batch sizes this graph serves (capture/batch_branches.py)
        self.done = False
        # the pair's verdict name, whose marker a pass leaves for a trusted cache entry (Note
        # [A trusted warm start] in lower/warm.py); None: the entry is not trusted
        self.verdict: str | None = None
        # what the backward releases (set by the backend): Note [The second size grows the
        # first]; None: both sizes are compared with the eager reference
        self.release: Release | None = None

    def ready(self, args: list) -> bool:
        """Runs once, at the first call with a non-empty batch (its rows are sampled)."""
        if self.done:
            return False
        return any(name in self.batch_inputs and isinstance(a, torch.Tensor) and a.shape[0] > 0
                   for (name, _), a in zip(self.forward.inputs, args))

    def run(self, args: list) -> None:
        self.done = True
        finish_builds()     # Note [A graph's C++ builds run while the next graph lowers]
        generator = torch.Generator(device="cpu").manual_seed(0)
        sizes = _known_sizes(self.forward.inputs, args, self.batch_symbols)
        # See Note [A self-check is not repeated on code it has passed]
        passed = None if self.always else _passed_marker(self, sizes)
        if passed is not None and os.path.exists(passed):
            self.skipped = True
            self._passed(sizes)
            return
        # Note [The self-check runs outside the first call's dispatch modes]
        # The check runs inside the compiled forward's first call, where aot_autograd's runtime
        # wrapper has pushed a TorchDispatchMode that inspects every op for custom-op aliasing
        # (once per compiled function). Under it each eager op of the check pays a Python
        # dispatch, most of the check's time on a warm cache. The check's ops
        # are not the user's graph, so they run with the modes set aside; the real call that
        # follows still runs under them.
        with torch.utils._python_dispatch._disable_current_modes():
            served = _sizes_served(self.decisions)
            dims = self._tangent_dims() if self._grows(served) else None
            if dims is not None:    # Note [The second size grows the first]
                start = generator.get_state()
                try:
                    with _isolated_rng(self.device):
                        grown = self._run_grown(served[1], served[0], args, sizes, generator,
                                                dims)
                    with _isolated_rng(self.device):
                        self._check_at(served[0], args, sizes, generator, grown)
                except _GrownFailure as failure:
                    # See Note [The self-check blames only what it has shown]
                    with _isolated_rng(self.device):
                        error = self._blame(failure, args, sizes, start, dims)
                    raise error from None
            else:
                for b in served:
                    with _isolated_rng(self.device):
                        self._check_at(b, args, sizes, generator)
        if passed is not None:
            _mark(passed)
        self._passed(sizes)

    def _passed(self, sizes: dict) -> None:
        """Leave the pair's verdict for a trusted cache entry: only where no size the check
        read off the call (a non-batch symbol) decided what it ran."""
        if self.verdict is not None and not sizes:
            _mark(verdict_path(self.verdict))

    def _check_at(self, b: int, args: list, sizes: dict, generator,
                  grown: "_Grown | None" = None) -> None:
        sizes = {**sizes, **{s: b for s in self.batch_symbols}}
        fw_args = grown.fw_args if grown is not None else \
            [self._synthetic(name, meta, a, sizes, generator)
             for (name, meta), a in zip(self.forward.inputs, args)]
        # Note [The self-check holds two runs at a time]
        # Each forward output set holds the activations saved for the backward (GPT-2 small at
        # B = 5, T = 128: about 0.6 GB), so the order bounds the check's peak: the independence
        # run before the eager forward, and each side's forward outputs handed over to its
        # backward, which frees each after its last use (Note [The self-check's runs free their
        # inputs]). At most two forwards' outputs, or one forward's and the gradients, are alive
        # at once. The compiled backward runs first; the eager one then takes each of its
        # gradients as it releases it and lets both sides' go (Note [The eager reference
        # compares each gradient as it is released]), so one set of gradients is alive at a
        # time, as in a training step.
        if grown is not None:       # run and compared with the larger size's already
            got, grown.small, grown.fw_args = grown.small, None, None
        else:
            got = _call(self.forward.compiled, fw_args, self.device)
            if b > 1:
                self._check_independence(b, fw_args, got, sizes, generator)
        want = _call(self.forward.reference, fw_args, self.device)
        if not self.forward.random:
            _compare("forward", b, self.forward.outputs, got, want,
                     self.forward.low_precision,
                     skip={i for i, lay in enumerate(self.layouts) if lay == "side"})
        del fw_args
        if self.backward is None or not self.compare_backward or self.forward.random:
            return
        saved = _saved_by_backward_name(self.forward, got)
        bw_args = [saved[name] if name in saved else
                   grown.tangents[k] if grown is not None and k in grown.tangents else
                   _real_examples(b, meta) if name == REAL_EXAMPLES else
                   _random_like(meta, sizes, generator)
                   for k, (name, meta) in enumerate(self.backward.inputs)]
        # Each backward gets its own forward's saved tensors: the eager graph may read a saved
        # view through its base (as_strided over the packed q/k/v projection), and Inductor's
        # forward lays its outputs out for its own backward.
        mine = _saved_by_backward_name(self.forward, want)
        ref_args = [mine.get(name, a) for (name, _), a in zip(self.backward.inputs, bw_args)]
        del got, want, saved, mine
        # Note [The self-check's backward runs without noise] (ops/noise.py)
        with cpu_noise.noiseless():
            got_bw = _call(self.backward.compiled, bw_args, self.device, consume=True)
            # See Note [The eager reference compares each gradient as it is released]
            _recording.got, _recording.measured = got_bw, {}
            _recording.seen = grown.account if grown is not None else None
            try:
                want_bw = _call(self.backward.reference, ref_args, self.device,
                                consume=True)
                measured = _recording.measured
            finally:
                _recording.got = _recording.measured = _recording.seen = None
            del ref_args
        if grown is not None:
            for i, x in enumerate(got_bw):
                if x is not None:
                    grown.account(i, x)
        unchecked = [self.backward.outputs[i] for i in self.backward.streamed
                     if i not in measured]
        if unchecked:
            raise PrivacyError(f"dpfx's self-check: the verified backward released no gradient "
                               f"for outputs {unchecked} at batch size {b}, so they went "
                               f"unchecked; dpfx refuses to train (a dpfx bug: please report)")
        _compare("backward", b, self.backward.outputs, got_bw, want_bw,
                 self.backward.low_precision, measured)
        if grown is not None:
            grown.check(b)

    # -- Note [The second size grows the first] ---------------------------------------------------
    def _grows(self, served: list) -> bool:
        return len(served) == 2 and served[1] == served[0] + 1 and self.release is not None \
            and self.backward is not None and self.compare_backward \
            and not self.forward.random and not self.low_precision() and not self.targets \
            and "loss" not in self.layouts \
            and all(name != REAL_EXAMPLES for name, _ in self.backward.inputs)

    def low_precision(self) -> bool:
        return self.forward.low_precision or (self.backward is not None
                                              and self.backward.low_precision)

    def _tangent_dims(self) -> dict | None:
        """The batch dim of each backward input the check draws (an output's gradient), by
        position: None for one without the batch; None in all where one holds the batch
        other than as a dim of its own."""
        saved = set(self.forward.outputs)
        dims = {}
        for k, (name, meta) in enumerate(self.backward.inputs):
            if name in saved or name.startswith("rng_state_output_"):
                continue
            if isinstance(meta, torch.SymInt):
                if meta.node.expr.free_symbols & set(self.batch_symbols):
                    return None
                continue
            if not isinstance(meta, torch.Tensor):
                continue
            found = []
            for d, size in enumerate(meta.shape):
                if not isinstance(size, torch.SymInt):
                    continue
                expr = size.node.expr
                if expr in self.batch_symbols:
                    found.append(d)
                elif expr.free_symbols & set(self.batch_symbols):
                    return None
            if len(found) > 1:
                return None
            dims[k] = found[0] if found else None
        return dims

    def _tangent_scale(self, large: int, small: int) -> float:
        """Note [A mean's output gradients carry 1/B]: what the smaller size's output gradients
        are the larger size's times, so that every shared example's gradient is the same."""
        return large / small if self.release.mean else 1.0

    def _run_grown(self, large: int, small: int, args: list, sizes: dict, generator,
                   dims: dict) -> "_Grown":
        """The compiled forward and backward at the larger size; the smaller size's inputs,
        its examples 1 on."""
        at_large = {**sizes, **{s: large for s in self.batch_symbols}}
        at_small = {**sizes, **{s: small for s in self.batch_symbols}}
        fw_large = [self._synthetic(name, meta, a, at_large, generator)
                    for (name, meta), a in zip(self.forward.inputs, args)]
        fw_small = [_rows_from(a, 0 if name in self.batch_inputs else None, meta, at_small)
                    for (name, meta), a in zip(self.forward.inputs, fw_large)]
        got = _call(self.forward.compiled, fw_large, self.device)
        del fw_large
        grown = _Grown(fw_small, got, {}, large, at_large, self.release)
        # before the larger backward runs: it may reuse its saved tensors' buffers (donated)
        grown.small = _call(self.forward.compiled, fw_small, self.device)
        mixed = self._mixed_rows(small, grown.small, grown.outputs, large, at_small, at_large)
        grown.outputs = None
        if mixed is not None:
            raise _GrownFailure("forward", small, large, output=mixed[0],
                                batch_free=mixed[1])
        saved = _saved_by_backward_name(self.forward, got)
        del got
        bw_args, tangents = [], {}
        scale = self._tangent_scale(large, small)
        for k, (name, meta) in enumerate(self.backward.inputs):
            value = saved[name] if name in saved else _random_like(meta, at_large, generator)
            if k in dims:
                tangents[k] = _rows_from(value, dims[k], meta, at_small, scale)
            bw_args.append(value)
        del saved
        with cpu_noise.noiseless():
            released = _call(self.backward.compiled, bw_args, self.device, consume=True)
        grown.tangents = tangents
        for i in self.release.positions:
            if i < len(released) and isinstance(released[i], torch.Tensor):
                grown.large[i] = released[i]
        return grown

    def _mixed_rows(self, b: int, got: list, outputs: list, large: int, at_small: dict,
                    at_large: dict) -> tuple | None:
        """(name, batch-free?) of the first forward output whose examples' rows at size ``b``
        are not those they have at ``large``, where an example was added before them (or,
        batch-free, not the same): something mixes examples or assumed a batch size. None:
        every output agrees."""
        for name, layout, x, y in zip(self.forward.outputs, self.layouts, got, outputs):
            if not isinstance(x, torch.Tensor) or (layout is not None
                                                   and not isinstance(layout, BatchDim)):
                continue
            if layout is not None:
                x = _examples(x, layout, b, at_small)
                y = _other_examples(y, layout, large, at_large)
            if not _close(x, y, 1e-4):
                return name, layout is None
        return None

    # -- Note [The self-check blames only what it has shown] -------------------------------------
    def _blame(self, failure: "_GrownFailure", args: list, sizes: dict, start,
               dims: dict) -> PrivacyError:
        """The grown experiment again on the same batches, run by the verified graphs
        eagerly: the error names the compiled code only where the proven graph passes."""
        generator = torch.Generator(device="cpu")
        generator.set_state(start)
        large, small = failure.large, failure.b
        at_large = {**sizes, **{s: large for s in self.batch_symbols}}
        at_small = {**sizes, **{s: small for s in self.batch_symbols}}
        fw_large = [self._synthetic(name, meta, a, at_large, generator)
                    for (name, meta), a in zip(self.forward.inputs, args)]
        fw_small = [_rows_from(a, 0 if name in self.batch_inputs else None, meta, at_small)
                    for (name, meta), a in zip(self.forward.inputs, fw_large)]
        want_large = _call(self.forward.reference, fw_large, self.device, consume=True)
        want_small = _call(self.forward.reference, fw_small, self.device, consume=True)
        if failure.which == "forward":
            mixed = self._mixed_rows(small, want_small, want_large, large, at_small, at_large)
            return failure.error(reference_failed=mixed is not None)
        scale = self._tangent_scale(large, small)
        saved = _saved_by_backward_name(self.forward, want_large)
        bw_large, tangents = [], {}
        for k, (name, meta) in enumerate(self.backward.inputs):
            value = saved[name] if name in saved else _random_like(meta, at_large, generator)
            if k in dims:
                tangents[k] = _rows_from(value, dims[k], meta, at_small, scale)
            bw_large.append(value)
        del saved, want_large
        released_large = self._released_by_reference(bw_large)
        saved = _saved_by_backward_name(self.forward, want_small)
        bw_small = [saved[name] if name in saved else tangents[k] if k in tangents else
                    _random_like(meta, at_small, generator)
                    for k, (name, meta) in enumerate(self.backward.inputs)]
        del saved, want_small
        released_small = self._released_by_reference(bw_small)
        d_large = float(large) if self.release.divisor is None else self.release.divisor
        d_small = float(small) if self.release.divisor is None else self.release.divisor
        gap = 0.0
        for i in self.release.positions:
            x, y = released_large.get(i), released_small.get(i)
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                gap += float(torch.dist(x.double() * d_large, y.double() * d_small)) ** 2
        return failure.error(reference_moved=math.sqrt(gap))

    def _released_by_reference(self, bw_args: list) -> dict:
        """The verified backward's noiseless release, run eagerly: position -> gradient."""
        with cpu_noise.noiseless():
            _recording.collect = {}
            try:
                out = _call(self.backward.reference, bw_args, self.device, consume=True)
                collected = _recording.collect
            finally:
                _recording.collect = None
        released = {i: x for i, x in enumerate(out) if isinstance(x, torch.Tensor)}
        released.update(collected)
        return released

    def _synthetic(self, name, meta, real, sizes, generator):
        if isinstance(meta, torch.SymInt):
            return _concrete(meta, sizes)
        if name not in self.batch_inputs or not isinstance(real, torch.Tensor):
            return real
        shape = [_concrete(s, sizes) for s in meta.shape]
        if real.dtype.is_floating_point:
            x = torch.randn(shape, generator=generator).to(real.device, real.dtype)
            x = (x * real.float().std().nan_to_num(1.0) + real.float().mean()).to(real)
        elif real.dtype == torch.bool:
            rows = torch.randint(real.shape[0], (shape[0],), generator=generator)
            x = real[rows.to(real.device)]
        elif name in self.targets:
            # a captured loss's integer targets: values they hold, drawn element by element, so
            # that class labels stay labels (a label tensor holds -100 beside 0..K-1, and the
            # values between would index out of range in the loss, loss/captured.py)
            flat = real.reshape(-1)
            x = flat[torch.randint(flat.numel(), shape, generator=generator).to(real.device)]
        else:
            low, high = int(real.min()), int(real.max())
            x = torch.randint(low, high + 1, shape, generator=generator).to(real)
        return _laid_out(x, meta, sizes)

    def _check_independence(self, b, fw_args, got, sizes, generator) -> None:
        changed = []
        for (name, _), a in zip(self.forward.inputs, fw_args):
            if name in self.batch_inputs and isinstance(a, torch.Tensor):
                a = a.clone()
                a[0] = a[1] if a.dtype == torch.bool or not a.dtype.is_floating_point \
                    else a[0] + torch.randn(a[0].shape, generator=generator).to(a)
            changed.append(a)
        again = _call(self.forward.compiled, changed, self.device)
        mixed = self._changed_by_example_0(b, got, again, sizes)
        del again
        if mixed is None:
            return
        # See Note [The self-check blames only what it has shown]
        name, layout = mixed
        ours = self._changed_by_example_0(
            b, _call(self.forward.reference, fw_args, self.device),
            _call(self.forward.reference, changed, self.device, consume=True), sizes) is not None
        seen = (f"dpfx's self-check of the compiled forward: changing example 0 changed "
                f"{'other examples of' if layout is not None else 'the batch-free'} output "
                f"{name} at batch size {b}")
        if ours:
            raise PrivacyError(
                f"{seen}, and so did the verified graph, run eagerly on the same batches. So the "
                f"fault is in dpfx (its rewrite of this model, or the self-check itself), not in "
                f"the code torch generated. dpfx refuses to train. Please report it with the "
                f"model, dpfx.explain(model)'s output and your torch version; DPFX_DUMP_DIR=dumps "
                f"writes the graphs.")
        raise PrivacyError(
            f"{seen}, while the verified graph, run eagerly on the same batches, did not. So the "
            f"code Inductor generated mixes examples (a torch bug), and dpfx refuses to train "
            f"with it. backend='eager' runs the proven graph; please report this with your "
            f"torch version (DPFX_DUMP_DIR=dumps writes the graphs).")

    def _changed_by_example_0(self, b, got, again, sizes) -> tuple | None:
        """(name, layout) of the first forward output whose other examples' rows (or, batch-free,
        whose value) differ between ``got`` and ``again``, run with example 0 changed."""
        for name, layout, x, y in zip(self.forward.outputs, self.layouts, got, again):
            if not isinstance(x, torch.Tensor) or (layout is not None
                                                   and not isinstance(layout, BatchDim)):
                continue
            if layout is not None:
                x, y = _other_examples(x, layout, b, sizes), _other_examples(y, layout, b, sizes)
            if not _close(x, y, 1e-5):
                return name, layout
        return None


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
# verdict to read, only its name: the proof (verify.py) still runs on every compile, and a marker
# can only skip a test that the same code passed.
# (tests/lower/test_selfcheck.py::test_passed_check_not_repeated_on_the_same_code)
def _passed_marker(check: "GraphCheck", sizes: dict) -> str | None:
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
                 _sizes_served(check.decisions), sorted((str(s), v) for s, v in sizes.items()),
                 check.compare_backward, SIZES, torch.__version__))
    name = hashlib.sha256(what.encode()).hexdigest()
    return os.path.join(cache_dir(), "dpfx_selfcheck", name)


def verdict_path(pair: str) -> str:
    """The marker of a passed check of the pair of compiled graphs named ``pair``."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "dpfx_verdicts", pair)


def pair_verdict(forward, backward, check: "GraphCheck | None") -> str | None:
    """The name of a passed check of this forward and backward's code (Note [A trusted warm
    start] in lower/warm.py): each graph's FX-graph cache key and its code's hash, and what
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
        _sizes_served(check.decisions), check.compare_backward,
        [(h.outputs, h.streamed, h.random, h.low_precision) for h in (check.forward,)])
    what = repr((keys, checked, SIZES, torch.__version__))
    return hashlib.sha256(what.encode()).hexdigest()


def _mark(path: str) -> None:
    """Create the marker file; a cache directory that cannot be written only costs a re-check."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a"):
            pass
    except OSError:
        pass


def _saved_by_backward_name(forward: Half, outs: list) -> dict:
    """The forward's outputs by the names the backward's placeholders give them: saved tensors
    keep their forward names; the RNG states saved for recomputing a checkpointed region
    (``run_and_save_rng_state``, the u8 outputs, in order) are ``rng_state_output_<k>``."""
    saved = dict(zip(forward.outputs, outs))
    states = [x for x, meta in zip(outs, forward.output_vals)
              if isinstance(meta, torch.Tensor) and meta.dtype == torch.uint8]
    saved.update({f"rng_state_output_{k}": x for k, x in enumerate(states)})
    return saved


def _sizes_served(decisions: list) -> list[int]:
    """SIZES, or for a graph captured for the batch sizes where the model's branches on the
    batch come out one way (Note [Deciding a branch on the batch size]), the first two sizes it
    serves (B = 1 alone for a graph of B = 1: exactness only)."""
    served = [b for b in (*SIZES, *range(1, 66)) if batch_branches.holds(decisions, b)]
    return list(dict.fromkeys(served))[:2]


# Note [The self-check's runs free their inputs]
# Both graphs of a check run in the boxed convention: the callable takes one list of inputs and
# clears it as it starts, so an input is freed after its last use, as in training (Inductor's
# code does; the eager reference is generated so too, ``_BoxedCodeGen``). A run that the
# check feeds for the last time is handed the list itself (``consume``): a backward's saved
# tensors then go as the backward passes them, where a list the caller kept held all of them
# to the end (an eager backward's saved tensors, beside the compiled gradients, at the check's
# peak). A forward's inputs are fed again and are copied.
def _call(fn, args: list, device, consume: bool = False) -> list:
    """``fn(args)`` for a boxed ``fn``; ``consume``: ``args`` itself, which ``fn`` empties."""
    torch.manual_seed(1234) if device.type == "cpu" else torch.get_device_module(
        device.type).manual_seed(1234)
    with torch.no_grad():
        out = fn(args if consume else list(args))
    return list(out) if isinstance(out, (list, tuple)) else [out]


class _isolated_rng:
    """The self-check draws from the device generator; the user's stream continues unchanged."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        self.state = torch.random.get_rng_state()
        if self.device.type != "cpu":
            self.device_state = torch.get_device_module(self.device.type).get_rng_state()

    def __exit__(self, *exc):
        torch.random.set_rng_state(self.state)
        if self.device.type != "cpu":
            torch.get_device_module(self.device.type).set_rng_state(self.device_state)


# Note [Attention kernels' side outputs are not compared]
# A fused attention kernel on a GPU returns the seed and offset of its dropout RNG, which the
# forward graph saves for the backward (Note [Attention kernels keep the leading dims apart] in
# passes/verify.py). Without dropout they are allocated and never written: two runs of the same
# graph on the same inputs return different bits. They carry no example's data, so the forward
# check leaves them out (layout "side"): of the comparison with the eager reference (``skip``)
# and, being batch-free outputs that are not compared as such, of the independence check.
# (tests/lower/test_fused_attention.py::test_side_outputs_compared_would_refuse)
def _compare(which: str, b: int, names: list, got: list, want: list,
             low_precision: bool = False, measured: dict | None = None,
             skip: set = frozenset()) -> None:
    """Every output of a compiled graph against the eager reference's, but those in ``skip``;
    ``measured``: the outputs the reference measured as it released them (``_record``), by
    position."""
    measured = dict(measured or {})
    for i, (x, y) in enumerate(zip(got, want)):
        if i in skip:
            continue
        if i not in measured and isinstance(y, torch.Tensor) and y.is_floating_point():
            measured[i] = _measure(x, y)
    scale = max((m.scale_norm / m.numel ** 0.5 for m in measured.values()
                 if m.numel and math.isfinite(m.scale_norm)),
                default=0.0) or 1.0
    for i, name in enumerate(names):
        if i in skip:
            continue
        if i in measured:
            m = measured[i]
            if not m.within(2e-2 if m.element_size <= 2 or low_precision else 1e-3, scale):
                raise PrivacyError(
                    f"dpfx's self-check: the compiled {which} graph disagrees with dpfx's "
                    f"verified graph on output {name} at batch size {b} (relative error "
                    f"{m.relative_error():.3g}). The code Inductor generated is not the graph "
                    f"dpfx proved (a torch bug); dpfx refuses to train with it. Use "
                    f"backend='eager' and report this with your torch version.")
        elif isinstance(y := want[i], torch.Tensor) and not torch.equal(got[i], y):
            raise PrivacyError(f"dpfx's self-check: the compiled {which} graph disagrees with "
                               f"its verified graph on output {name} at batch size {b}")


@dataclasses.dataclass
class _Measure:
    """What comparing two floating tensors needs, so that neither has to be kept: ||x - y|| with
    NaNs lined up (None: shapes or NaN places differ), ||y|| for the relative bound, ||y|| with
    NaNs read as 0 for the graph's scale (Note [The self-check's floor scales with the graph])."""
    gap: float | None
    norm: float
    scale_norm: float
    numel: int
    element_size: int

    def within(self, tol: float, scale: float) -> bool:
        return self.gap is not None and self.gap <= tol * (self.norm + self.numel ** 0.5 * scale)

    def relative_error(self) -> float:
        return math.inf if self.gap is None else self.gap / max(self.norm, 1e-30)


def _measure(x: torch.Tensor | None, y: torch.Tensor) -> _Measure:
    n, size = y.numel(), y.element_size()
    if not isinstance(x, torch.Tensor) or x.shape != y.shape:     # missing, or misshapen
        return _Measure(None, math.nan, math.nan, n, size)
    if x.is_floating_point() and x.element_size() >= 4 and y.dtype == x.dtype:
        gap, norm = _gap_and_norm(x, y)
        if math.isfinite(gap):    # y finite and x - y finite: x is finite too
            return _Measure(gap, norm, norm, n, size)
    if not x.is_floating_point() or x.element_size() < 4:
        x, y = x.double(), y.double()
    norm = _norm(y)
    if not torch.equal(torch.isnan(x), torch.isnan(y)):
        return _Measure(None, norm, norm, n, size)
    return _Measure(_norm((x - y).nan_to_num_()), norm, norm, n, size)


# Note [The self-check's comparisons are few passes over the data]
# Copying each output to float64 and clearing its NaNs would take four passes per side, each a
# parallel region, over every gradient: most of the check on a model with many gradient
# entries. The norms are as accurate as a
# float64 accumulation (Note [Norms in float32 rows, summed in float64]), the difference is
# taken once in the outputs' own precision (float32 at least), and NaNs, which must sit at the
# same places on both sides, are cleared only from the difference, or from a side whose norm
# came out NaN. Where the expected side's norm and the difference's are finite (then neither
# side holds a NaN or an infinity, the common case) there is nothing to line up or clear: two
# passes (the difference's norm, and the expected side's, taken once for the graph's scale too)
# where the NaN masks, their comparison and the clearing would take seven. A NaN or an infinity on
# the compiled side alone makes the difference's norm non-finite and takes the path that lines
# them up.
#
# Note [Norms in float32 rows, summed in float64]
# A float64 norm of a float32 tensor converts every entry first, on one thread: slow on an LM's
# logits. ATen's float32 norm of the whole tensor is an order of magnitude faster but not accurate
# enough (1e-3 relative at 19M entries, the check's own tolerance). So a float32 tensor's norm is
# taken as the float32 norms of rows of _ROW entries, their squares summed in float64: as fast as
# the float32 norm, and within 1e-9 of the float64 norm on those logits. A row's sum of at most 1024
# float32 squares is off by at most 1024 * 2^-24 (6e-5) relative, next to the check's 1e-3. Two
# things float32 squares lose are recomputed in float64: an infinity (an entry that is one, or a row
# whose squares overflowed) and a norm below sqrt(n) * 1e-17, where squares that fell below
# float32's normal range (entries under 1e-19) could be 1e-4 of the sum. A NaN entry makes a NaN
# norm either way.
_ROW = 1024
_SMALL = 1e-17


def _raw_norm(t: torch.Tensor) -> float:
    """The Euclidean norm of ``t``, as accurate as accumulating in float64: NaN if ``t`` holds a
    NaN."""
    n = t.numel()
    if t.dtype == torch.float32 and n >= 2 * _ROW:
        norm = math.sqrt(_square_sum(t.reshape(-1)))
        if math.isnan(norm) or _SMALL * n ** 0.5 <= norm < math.inf:
            return norm      # NaN for a NaN entry; inf (an inf entry or overflow) is recomputed
    return float(torch.linalg.vector_norm(t, dtype=torch.float64))


def _square_sum(flat: torch.Tensor) -> float:
    """The sum of squares of a 1-D float32 tensor: float32 norms of rows of _ROW entries, their
    squares and the tail's summed in float64 (Note [Norms in float32 rows, summed in float64])."""
    k = flat.numel() // _ROW
    total = 0.0
    if k:
        rows = torch.linalg.vector_norm(flat[:k * _ROW].view(k, _ROW), dim=1)
        total = float(rows.double().square().sum())
    if k * _ROW < flat.numel():
        total += float(torch.linalg.vector_norm(flat[k * _ROW:], dtype=torch.float64)) ** 2
    return total


# Note [The self-check's comparisons stream through the cache]
# ||x - y|| and ||y|| of a float32 pair would be three passes over memory and a fresh buffer the
# size of the output for x - y (page faults, and a tied [V, d] gradient's size beside both
# sides' gradients at the first step's peak). Where the two are paired entry for
# entry by their memory order (both row-major, or both laid out alike over dense memory: a
# compiled output and its eager twin usually are), the difference is taken in chunks of
# _CHUNK entries into one reused buffer, and each chunk's difference and its y are normed
# while they are in cache: one read of each side. Outputs equal on both sides are common (saved
# activations computed alike: most of the entries an LM's check compares): their squared
# differences sum to 0, which would send them to a float64 norm of the difference (one thread),
# to tell a zero gap from one whose float32 squares underflowed. A chunk whose
# squared differences sum to 0 is asked instead whether its difference, still in cache, holds
# any nonzero entry: a pair with none has a gap of exactly 0. The norms are _raw_norm's sums
# (rows of _ROW, in float64), with the same recomputations where float32 squares lose
# (Note [Norms in float32 rows, summed in float64]); an all-zero y's norm is 0. Other pairs
# (strides that differ, views with gaps) take x - y, as do tensors off the CPU (each chunk's
# norms would wait on the device).
_CHUNK = 1 << 18


def _gap_and_norm(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(||x - y||, ||y||) for floating tensors of one shape and dtype, each as accurate as a
    float64 accumulation; the gap is NaN where ||y|| is not finite, and NaN or inf where x - y
    holds a NaN or an infinity (the caller lines those up)."""
    pair = _paired(x, y) if x.dtype == torch.float32 and x.numel() >= 2 * _ROW \
        and x.device.type == "cpu" else None
    if pair is None:
        norm = _raw_norm(y)
        return (_raw_norm(x - y) if math.isfinite(norm) else math.nan), norm
    fx, fy = pair
    n = fx.numel()
    buf = torch.empty(min(n, _CHUNK), dtype=fx.dtype, device=fx.device)
    gap_sq = norm_sq = 0.0
    equal = True      # every entry of x - y is 0 (for floats: x == y, but NaN != NaN)
    for start in range(0, n, _CHUNK):
        xs, ys = fx[start:start + _CHUNK], fy[start:start + _CHUNK]
        d = torch.sub(xs, ys, out=buf[:xs.numel()])
        chunk = _square_sum(d)
        if equal and (chunk != 0.0 or bool(d.any())):
            equal = False
        gap_sq += chunk
        norm_sq += _square_sum(ys)
    floor = _SMALL * n ** 0.5
    norm = math.sqrt(norm_sq)
    if not (math.isnan(norm) or floor <= norm < math.inf):
        norm = 0.0 if norm_sq == 0.0 and not bool(fy.any()) else \
            float(torch.linalg.vector_norm(y, dtype=torch.float64))
    if not math.isfinite(norm):
        return math.nan, norm
    gap = math.sqrt(gap_sq)
    if not (equal or math.isnan(gap) or floor <= gap < math.inf):
        gap = _raw_norm(x - y)
    return gap, norm


def _paired(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``x`` and ``y`` as 1-D views that pair their entries, without a copy: both row-major, or
    both with the same strides over dense memory; None otherwise."""
    if x.is_contiguous() and y.is_contiguous():
        return x.view(-1), y.view(-1)
    if x.stride() == y.stride() and _dense(x):
        n = x.numel()
        return x.as_strided((n,), (1,)), y.as_strided((n,), (1,))
    return None


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s entries fill a block of memory once each: its dims, ordered by stride,
    are a row-major layout of some permutation."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _norm(t: torch.Tensor) -> float:
    """The Euclidean norm of ``t`` accumulated in float64, NaN entries read as 0."""
    norm = _raw_norm(t)
    if math.isnan(norm):
        norm = float(torch.linalg.vector_norm(t.nan_to_num(), dtype=torch.float64))
    return norm


# Note [The self-check's floor scales with the graph]
# ||x - y|| <= tol * (||y|| + sqrt(n) * scale): relative, with a floor for outputs near zero (the
# spatial mean after an InstanceNorm is ~1e-8 on both sides, all rounding, next to activations of
# order 1). The floor's scale is the graph's own: the largest RMS entry among its outputs. A fixed
# floor of sqrt(n) let a 1% error through in every DP gradient, whose entries are of order C/D
# (C = 1, D = 256: ~1e-3 each), so the floor outweighed the relative term 250 times
# (tests/lower/test_selfcheck.py::test_miscompiled_graph_refused_before_training, "dp-scale").
def _close(x, y, tol: float, scale: float = 1.0) -> bool:
    return _measure(x, y).within(tol, scale)


def _other_examples(t: torch.Tensor, layout: BatchDim, b: int, sizes: dict) -> torch.Tensor:
    """Every example but 0, from a tensor whose dim ``layout.dim`` is (outer, B, inner)."""
    outer, inner = _concrete(layout.outer, sizes), _concrete(layout.inner, sizes)
    d = layout.dim
    split = t.reshape(*t.shape[:d], outer, b, inner, *t.shape[d + 1:])
    return split.narrow(d + 1, 1, b - 1)


@dataclasses.dataclass(frozen=True)
class Release:
    """What the compiled backward releases, for Note [The second size grows the first]: its
    gradient outputs' positions, D (None: the batch size, a mean without expected_batch_size;
    1 for clipped sums and sums), the most one example may move the sum of clipped gradients
    (sqrt(sum_g C_g^2)), and whether the graph multiplies each example's gradient by the batch
    size of the call (loss_reduction="mean": Note [A mean's output gradients carry 1/B])."""
    positions: frozenset
    divisor: float | None
    bound: float
    mean: bool = False


class _Grown:
    """The larger size's run, kept for the smaller size's check."""

    def __init__(self, fw_args, outputs, tangents, size, sizes, release: Release):
        self.fw_args, self.outputs, self.tangents = fw_args, outputs, tangents
        self.size, self.sizes, self.release = size, sizes, release
        self.large: dict = {}       # position -> the larger size's released gradient
        self.small: list | None = None    # the smaller size's compiled forward outputs
        self.gap = 0.0              # sum over positions of ||S_large - S_small||^2
        self.norm = 0.0             # ... of ||S_small||^2
        self.finite = True

    def _d(self, b: int) -> float:
        return float(b) if self.release.divisor is None else self.release.divisor

    def account(self, position: int, small: torch.Tensor) -> None:
        large = self.large.pop(position, None)
        if large is None or not isinstance(small, torch.Tensor):
            return
        d_small, d_large = self._d(self.size - 1), self._d(self.size)
        norm = float(torch.linalg.vector_norm(small, dtype=torch.float64)) * d_small
        if not math.isfinite(float(torch.linalg.vector_norm(large))):
            self.finite = False     # an example's non-finite terms are selected away
            return
        if not math.isfinite(norm):
            return                  # the eager comparison lines these up
        # ||S_large - S_small|| without a copy of either (torch.dist fuses the difference)
        scaled = small if d_small == d_large else small * (d_small / d_large)
        gap = float(torch.dist(large, scaled)) * d_large
        self.gap += gap * gap
        self.norm += norm * norm

    def check(self, b: int) -> None:
        moved = math.sqrt(self.gap)
        limit = self.release.bound * (1 + 1e-3) + 1e-4 * math.sqrt(self.norm)
        if self.large or not self.finite or not moved <= limit:
            raise _GrownFailure("backward", b, self.size, moved=moved, limit=limit,
                                bound=self.release.bound, unmatched=bool(self.large),
                                finite=self.finite)


# Note [The self-check blames only what it has shown]
# The grown comparison runs compiled code only, so a failure there shows that the generated
# code moved (or mixed) something, not whose fault it is. Before it refuses, the check runs the
# same experiment on the same batches through the verified graphs eagerly. Where they pass, the
# generated code is not the graph dpfx proved, and the error says so (a torch bug: the eager
# backend runs the proven graph). Where they fail too, the fault is dpfx's own (its rewrite, or
# this check's premise about the graph), and the error says that instead and does not send the
# user to another backend. Either way dpfx refuses to train. The reference runs only on this
# path. (tests/lower/test_selfcheck.py::test_a_grown_failure_blames_what_the_reference_shows)
class _GrownFailure(Exception):
    """What the grown comparison saw (Note [The second size grows the first])."""

    def __init__(self, which: str, b: int, large: int, *, output: str | None = None,
                 moved: float = math.nan, limit: float = math.nan, bound: float = math.nan,
                 unmatched: bool = False, finite: bool = True, batch_free: bool = False):
        super().__init__(which)
        self.batch_free = batch_free
        self.which, self.b, self.large, self.output = which, b, large, output
        self.moved, self.limit, self.bound = moved, limit, bound
        self.unmatched, self.finite = unmatched, finite

    def error(self, reference_failed: bool | None = None,
              reference_moved: float | None = None) -> PrivacyError:
        if self.which == "forward":
            changed = f"the batch-free output {self.output}" if self.batch_free else \
                f"the other examples' rows of output {self.output}"
            seen = (f"dpfx's self-check of the compiled forward: adding an example before the "
                    f"others changed {changed} (batch size {self.b} against {self.large})")
            ours = reference_failed
            reference = "the verified graph, run eagerly on the same batches, changed them too" \
                if ours else "the verified graph, run eagerly on the same batches, did not"
        else:
            what = (" and released a gradient the smaller batch did not" if self.unmatched
                    else " and released a non-finite gradient" if not self.finite else "")
            seen = (f"dpfx's self-check of the compiled backward: one example added to a batch "
                    f"of {self.b} moved the sum of clipped gradients (noiseless, times D) by "
                    f"{self.moved:.6g}{what}; one example may move it by at most its clip bound "
                    f"{self.bound:.6g} (limit with rounding {self.limit:.6g})")
            ours = reference_moved is not None and not reference_moved <= self.limit
            reference = f"the verified graph, run eagerly on the same batches, moved it by " \
                f"{reference_moved:.6g}"
        if ours:
            return PrivacyError(
                f"{seen}; {reference}. So the fault is in dpfx (its rewrite of this model, or "
                f"the self-check itself), not in the code torch generated. dpfx refuses to "
                f"train. Please report it with the model, dpfx.explain(model)'s output and "
                f"your torch version; DPFX_DUMP_DIR=dumps writes the graphs.")
        return PrivacyError(
            f"{seen}; {reference}. So the code Inductor generated is not the graph dpfx proved "
            f"(it mixes examples or assumed a batch size: a torch bug), and dpfx refuses to "
            f"train with it. backend='eager' runs the proven graph; please report this with "
            f"your torch version (DPFX_DUMP_DIR=dumps writes the graphs).")


def _rows_from(value, dim: int | None, meta, sizes: dict, scale: float = 1.0):
    """A larger size's value at the smaller size: its examples 1 on along ``dim`` (None: the
    value itself), times ``scale``, laid out as the graph was compiled for."""
    if not isinstance(value, torch.Tensor) or dim is None:
        return _concrete(meta, sizes) if isinstance(meta, torch.SymInt) else value
    rows = value.narrow(dim, 1, value.shape[dim] - 1).clone()
    if scale != 1.0:
        rows.mul_(scale)
    return _laid_out(rows, meta, sizes)


def _examples(t: torch.Tensor, layout: BatchDim, b: int, sizes: dict) -> torch.Tensor:
    """Every example, from a tensor whose dim ``layout.dim`` is (outer, B, inner)."""
    outer, inner = _concrete(layout.outer, sizes), _concrete(layout.inner, sizes)
    d = layout.dim
    return t.reshape(*t.shape[:d], outer, b, inner, *t.shape[d + 1:])


def _known_sizes(inputs: list, args: list, batch_symbols: set) -> dict:
    """Values of the graph's non-batch size symbols, read off the real arguments."""
    sizes = {}
    for (_, meta), a in zip(inputs, args):
        if isinstance(meta, torch.SymInt) and isinstance(meta.node.expr, sympy.Symbol):
            sizes[meta.node.expr] = int(a)
        elif isinstance(meta, torch.Tensor) and isinstance(a, torch.Tensor):
            for s, v in zip(meta.shape, a.shape):
                if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                    sizes.setdefault(s.node.expr, v)
    return {s: v for s, v in sizes.items() if s not in batch_symbols}


def _real_examples(b: int, meta: torch.Tensor) -> torch.Tensor:
    """A padded batch's count of real examples (Note [Padded rows contribute zero] in
    passes/clip_noise.py) for a check at batch size ``b``: all rows but the last, so that the
    check runs a padded row through both graphs."""
    return torch.tensor(float(max(b - 1, 1)), dtype=meta.dtype, device=meta.device)


def _concrete(size, sizes: dict) -> int:
    expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.sympify(size)
    return int(sympy.sympify(expr).subs(sizes))


def _random_like(meta, sizes: dict, generator) -> Any:
    if isinstance(meta, torch.SymInt):
        return _concrete(meta, sizes)
    shape = [_concrete(s, sizes) for s in meta.shape]
    x = torch.randn(shape, generator=generator)
    return _laid_out(x.to(dtype=meta.dtype, device=meta.device), meta, sizes)


def _laid_out(x: torch.Tensor, meta: torch.Tensor, sizes: dict) -> torch.Tensor:
    """``x`` with the strides the graph was compiled for: the compiled code asserts them (a
    channels-last image stays channels-last)."""
    strides = [_concrete(s, sizes) for s in meta.stride()]
    if list(x.stride()) == strides:
        return x
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device).copy_(x)
