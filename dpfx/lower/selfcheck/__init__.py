"""A self-test of the compiled code, run once per graph before it trains on real data.

    check = GraphCheck(forward_graph, layouts, batch_symbols, ...)   # at compile time
    check.run(real_args)    # first call: raises PrivacyError if the compiled code is wrong


# Note [Checking what Inductor generated]
The verifier proves the FX graph; Inductor then generates the code that runs, and torch's handling
of an unbacked batch has had bugs the graph cannot show (Note [Inductor must not assume what it
cannot check] in lower/shape_patches.py: a head split that mixed examples). So before a
compiled forward and backward pair first runs on the user's data, dpfx runs both on synthetic
batches of SIZES examples (Note [The self-check's two batch sizes]) built like the user's inputs
(floats with the inputs' mean and spread, integers within the inputs' range (a captured loss's integer targets: drawn
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

The package, one concern a module: ``check`` (GraphCheck: the runs at each size and the
independence test), ``grow`` (the larger size grown from the smaller), ``reference`` (the eager
copy of the verified graph), ``stream`` (the copy's gradients measured as it releases them),
``compare`` (the tolerances and norms), ``batches`` (the synthetic batches and the boxed runs),
``markers`` (the passed checks' markers and the warm start's verdicts).
"""
from __future__ import annotations

from dpfx.lower.selfcheck.batches import SIZES
from dpfx.lower.selfcheck.check import GraphCheck
from dpfx.lower.selfcheck.grow import Release
from dpfx.lower.selfcheck.markers import pair_verdict, verdict_path
from dpfx.lower.selfcheck.reference import Half, eager_copy

__all__ = ["GraphCheck", "Half", "Release", "SIZES", "eager_copy", "pair_verdict", "verdict_path"]
