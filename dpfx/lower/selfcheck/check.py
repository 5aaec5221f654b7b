"""GraphCheck: one compiled forward and backward pair checked against its verified graphs.

    check = GraphCheck(Half.of(forward, compiled_forward), layouts, batch_symbols, ...)
    if check.ready(real_args):
        check.run(real_args)     # raises PrivacyError if the compiled code is wrong

At each size it runs the compiled forward, changes example 0 for the independence test, compares
both graphs with the eager reference (Note [Checking what Inductor generated] in
lower/selfcheck/__init__.py); where the sizes are grown (selfcheck/grow.py) the larger runs
compiled only.
"""
from __future__ import annotations

import os

import torch
import torch.utils._python_dispatch

from dpfx.errors import PrivacyError
from dpfx.graph.batch import BatchDim
from dpfx.lower.cpu_builds import finish_builds
from dpfx.lower.selfcheck import grow
from dpfx.lower.selfcheck.batches import (call_boxed, isolated_rng, known_sizes, other_examples,
                                          random_like, real_examples, saved_by_backward_name,
                                          sizes_served, synthetic)
from dpfx.lower.selfcheck.compare import close, compare
from dpfx.lower.selfcheck.grow import GrownFailure, Release
from dpfx.lower.selfcheck.markers import mark, passed_marker, verdict_path
from dpfx.lower.selfcheck.reference import Half
from dpfx.lower.selfcheck.stream import recording
from dpfx.ops import noise as cpu_noise
from dpfx.passes.clip_noise import REAL_EXAMPLES


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
        # [A trusted warm start] in lower/trust.py); None: the entry is not trusted
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
        sizes = known_sizes(self.forward.inputs, args, self.batch_symbols)
        # See Note [A self-check is not repeated on code it has passed]
        passed = None if self.always else passed_marker(self, sizes)
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
            served = sizes_served(self.decisions)
            dims = grow.tangent_dims(self) if grow.grows(self, served) else None
            if dims is not None:    # Note [The second size grows the first]
                start = generator.get_state()
                try:
                    with isolated_rng(self.device):
                        grown = grow.run(self, served[1], served[0], args, sizes, generator, dims)
                    with isolated_rng(self.device):
                        self._check_at(served[0], args, sizes, generator, grown)
                except GrownFailure as failure:
                    # See Note [The self-check blames only what it has shown]
                    with isolated_rng(self.device):
                        error = grow.blame(self, failure, args, sizes, start, dims)
                    raise error from None
            else:
                for b in served:
                    with isolated_rng(self.device):
                        self._check_at(b, args, sizes, generator)
        if passed is not None:
            mark(passed)
        self._passed(sizes)

    def _passed(self, sizes: dict) -> None:
        """Leave the pair's verdict for a trusted cache entry: only where no size the check
        read off the call (a non-batch symbol) decided what it ran."""
        if self.verdict is not None and not sizes:
            mark(verdict_path(self.verdict))

    def _check_at(self, b: int, args: list, sizes: dict, generator,
                  grown: "grow.Grown | None" = None) -> None:
        sizes = {**sizes, **{s: b for s in self.batch_symbols}}
        fw_args = grown.fw_args if grown is not None else \
            [synthetic(name, meta, a, sizes, generator, self.batch_inputs, self.targets)
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
            got = call_boxed(self.forward.compiled, fw_args, self.device)
            if b > 1:
                self._check_independence(b, fw_args, got, sizes, generator)
        want = call_boxed(self.forward.reference, fw_args, self.device)
        if not self.forward.random:
            compare("forward", b, self.forward.outputs, got, want,
                     self.forward.low_precision,
                     skip={i for i, lay in enumerate(self.layouts) if lay == "side"})
        del fw_args
        if self.backward is None or not self.compare_backward or self.forward.random:
            return
        saved = saved_by_backward_name(self.forward, got)
        bw_args = [saved[name] if name in saved else
                   grown.tangents[k] if grown is not None and k in grown.tangents else
                   real_examples(b, meta) if name == REAL_EXAMPLES else
                   random_like(meta, sizes, generator)
                   for k, (name, meta) in enumerate(self.backward.inputs)]
        # Each backward gets its own forward's saved tensors: the eager graph may read a saved
        # view through its base (as_strided over the packed q/k/v projection), and Inductor's
        # forward lays its outputs out for its own backward.
        mine = saved_by_backward_name(self.forward, want)
        ref_args = [mine.get(name, a) for (name, _), a in zip(self.backward.inputs, bw_args)]
        del got, want, saved, mine
        # Note [The self-check's backward runs without noise] (ops/noise.py)
        with cpu_noise.noiseless():
            got_bw = call_boxed(self.backward.compiled, bw_args, self.device, consume=True)
            # See Note [The eager reference compares each gradient as it is released]
            recording.got, recording.measured = got_bw, {}
            recording.seen = grown.account if grown is not None else None
            try:
                want_bw = call_boxed(self.backward.reference, ref_args, self.device,
                                consume=True)
                measured = recording.measured
            finally:
                recording.got = recording.measured = recording.seen = None
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
        compare("backward", b, self.backward.outputs, got_bw, want_bw,
                 self.backward.low_precision, measured)
        if grown is not None:
            grown.check(b)


    def low_precision(self) -> bool:
        return self.forward.low_precision or (self.backward is not None
                                              and self.backward.low_precision)

    def _check_independence(self, b, fw_args, got, sizes, generator) -> None:
        changed = []
        for (name, _), a in zip(self.forward.inputs, fw_args):
            if name in self.batch_inputs and isinstance(a, torch.Tensor):
                a = a.clone()
                a[0] = a[1] if a.dtype == torch.bool or not a.dtype.is_floating_point \
                    else a[0] + torch.randn(a[0].shape, generator=generator).to(a)
            changed.append(a)
        again = call_boxed(self.forward.compiled, changed, self.device)
        mixed = self._changed_by_example_0(b, got, again, sizes)
        del again
        if mixed is None:
            return
        # See Note [The self-check blames only what it has shown]
        name, layout = mixed
        ours = self._changed_by_example_0(
            b, call_boxed(self.forward.reference, fw_args, self.device),
            call_boxed(self.forward.reference, changed, self.device, consume=True),
            sizes) is not None
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
                x, y = other_examples(x, layout, b, sizes), other_examples(y, layout, b, sizes)
            if not close(x, y, 1e-5):
                return name, layout
        return None

