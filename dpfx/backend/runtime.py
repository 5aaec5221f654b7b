"""The runners of compiled graphs: what runs around Inductor's code at every step.

    runners = Runners(config, gate, generator, adaptive_clip, norm_stats)
    run_forward = runners.forward(compiled, check)
    run_backward = runners.backward(compiled, BackwardPlan(positions, zero_tangents, adaptive,
                                                           padded), device, released_elsewhere)

A forward runner runs the self-check at its first calls and tells the release gate that dpfx's
forward ran. A backward runner asks the gate to admit the backward, refuses a nonzero gradient
on a batch-free forward output, reseeds the one generator the graph's noise is drawn from
(Note [Where the graph's noise seed comes from]), appends the graph's scalar inputs (the count
of real examples of a padded batch, the adaptive bound C_t), negates the released gradients of a
negative multiple of the captured loss (Note [A negative multiple of the captured loss] in
loss/captured.py) and drops those whose sums left by their block's place. A graph's runner is
the same whether its code was compiled now or loaded from a trusted cache entry (Note [A trusted
warm start] in lower/trust.py).
"""
from __future__ import annotations

import copy
import dataclasses
import secrets

import torch

from dpfx.config import DPConfig
from dpfx.errors import PrivacyError
from dpfx.loss.gate import ReleaseGate
from dpfx.ops import blocks as block_ops
from dpfx.ops.norms import NormStats
from dpfx.privacy.adaptive import AdaptiveClip


# Note [Compiled graphs run below autograd]
# A compiled graph's code runs with grad mode off (inside aot_autograd's function), yet every op
# it calls still enters the dispatcher's autograd key first, which then finds nothing to record:
# a C++ check for ATen's ops, but for an op with a Python autograd formula (a block's ops,
# custom ops: ops/blocks.py) a Python layer that boxes the op's tensor lists and redispatches
# below itself, up to 100 us a call with a decoder layer's 30 tensors (36 calls a step at twelve
# layers; benchmarks/latest/below_autograd.md). The runners call the code with the autograd keys
# excluded, as that layer itself does: each op goes straight to its kernel. Nothing in the graph
# records autograd history; views and version counters are kept by the key below autograd,
# which stays. The self-check calls the code the same way (lower/selfcheck/batches.py).
# (tests/test_blocks.py::test_a_step_skips_the_block_ops_autograd_layer)
below_autograd = torch._C._AutoDispatchBelowAutograd


@dataclasses.dataclass
class BackwardPlan:
    """What a compiled backward's runner needs besides its code: each parameter's gradient
    output, the batch-free tangents that must be zero, and the scalar inputs the graph reads
    (passes/__init__.BackwardResult)."""
    positions: dict[str, int]       # parameter name -> output index of its gradient
    zero_tangents: list[int]
    adaptive: bool                  # reads C_t, returns the count of unclipped examples
    padded: bool                    # reads the count of real examples


class Runners:
    """One backend's runners, reading its live state: the release gate, the noise seed's
    generator, the adaptive bound and the norm statistics."""

    def __init__(self, config: DPConfig, gate: ReleaseGate, generator: torch.Generator | None,
                 adaptive_clip: AdaptiveClip | None, norm_stats: NormStats | None):
        self.config = config
        self.gate = gate
        self.generator = generator     # None: every step's seed from the OS's CSPRNG
        self.adaptive_clip = adaptive_clip
        self.norm_stats = norm_stats

    def forward(self, compiled, check):
        gate, stats = self.gate, self.norm_stats

        def run_forward(args):
            if check is not None and check.ready(args):
                # Note [Checking what Inductor generated]; its synthetic norms are not the user's.
                saved = copy.deepcopy(stats.__dict__) if stats else None
                with block_ops.stand_ins():
                    check.run(args)
                if saved is not None:
                    stats.__dict__.update(saved)
            gate.graph_forward()
            with block_ops.live(), below_autograd():
                return compiled(args)

        run_forward._boxed_call = True
        return run_forward

    def backward(self, compiled, plan: BackwardPlan, device: torch.device,
                 released_elsewhere: set[str] = frozenset()):
        """The compiled backward's runner: the gate's admission, the noise seed, the released
        gradients' sign and place. ``released_elsewhere``: parameters whose clipped sums
        leave by their block's place (Note [Sharded blocks] in loop/fsdp.py)."""
        if plan.adaptive:
            compiled = self._with_bound(compiled, device)
        if plan.padded:      # appended before C_t: the outer wrapper
            compiled = self._with_real_examples(compiled, device)
        gate, zero_tangents = self.gate, plan.zero_tangents
        elsewhere = [i for name, i in plan.positions.items() if name in released_elsewhere]
        positions = {name: i for name, i in plan.positions.items()
                     if name not in released_elsewhere}
        names = tuple(positions)    # the parameters whose p.grad autograd accumulates into

        def produced(outs):
            negated = gate.sign != 1.0
            if not (elsewhere or negated):
                return outs
            if not isinstance(outs, list):
                outs = list(outs)
            for i in elsewhere:
                outs[i] = None      # zeros without storage: the sum went to its block's place
            if negated:
                # Note [A negative multiple of the captured loss] in loss/captured.py
                for i in positions.values():
                    if outs[i] is not None:
                        outs[i] = outs[i].neg()
            return outs

        def admit(args):
            gate.admit_backward(names)
            if elsewhere and gate.sign != 1.0:
                raise PrivacyError(
                    "a negative multiple of the captured loss with sharded blocks: their clipped "
                    "sums leave by their blocks' places, where dpfx cannot negate them. Put the "
                    "sign inside the loss function. dpfx's graph has written no gradient.")
            check_zero_tangents(args, zero_tangents)

        if self.config.noise == "optimizer":     # no random op in the graph
            def run_deferred(args):
                admit(args)
                with block_ops.live(), below_autograd():
                    return produced(compiled(args))

            run_deferred._boxed_call = True
            return run_deferred

        # Note [Where the graph's noise seed comes from]
        # Every step runs under a fresh seed: from the OS's CSPRNG (secrets) by default, so the
        # noise cannot be predicted from the user's torch.manual_seed (torch's default generator
        # starts from a fixed seed in every process); from a generator seeded with ``seed`` when
        # one is given, for reproducible runs. The stream itself is torch's (MT19937 on CPU,
        # Philox on GPU): for noise from a cryptographic source use DPOptimizer(secure_mode=True).
        generator = device_generator(device)
        seeds = self.generator

        def run_backward(args):
            admit(args)
            if seeds is None:
                step_seed = secrets.randbits(62)
            else:
                step_seed = int(torch.randint(2**62, (1,), generator=seeds))
            # Save, reseed and restore the one generator the graph draws from: ~5 us, where
            # fork_rng + torch.manual_seed cost ~250 us on CPU (it visits every device type).
            saved = generator.get_state()
            generator.manual_seed(step_seed)
            try:
                with block_ops.live(), below_autograd():
                    return produced(compiled(args))
            finally:
                generator.set_state(saved)

        run_backward._boxed_call = True
        return run_backward

    def _with_bound(self, compiled, device: torch.device):
        """The compiled backward called with C_t appended to its arguments; its last output, the
        step's count of unclipped examples, goes to the adaptive bound's owner: noised
        (noise="graph": C_{t+1} is set at once) or raw (noise="optimizer": DPOptimizer.step
        noises the logical batch's count once). Note [Adaptive clipping] in
        privacy/adaptive.py."""
        state, config, gate = self.adaptive_clip, self.config, self.gate

        def run(args):
            examples = gate.pending
            args.append(state.tensor(device))
            outs = list(compiled(args))
            count = outs.pop()
            if config.noise == "optimizer":
                state.add_count(count)
            else:
                state.released(float(count), config.expected_batch_size or examples)
            return outs

        run._boxed_call = True
        return run

    def _with_real_examples(self, compiled, device: torch.device):
        """The compiled backward called with the count of real examples of its forward's padded
        batch appended to its arguments (Note [Padded rows contribute zero] in
        passes/clip_noise.py); ``norm_stats`` records those rows' norms only."""
        gate, stats = self.gate, self.norm_stats

        def run(args):
            real = gate.pending
            args.append(torch.tensor(float(real), dtype=torch.float32, device=device))
            if stats is None:
                return compiled(args)
            stats.rows = real
            try:
                return compiled(args)
            finally:
                stats.rows = None

        run._boxed_call = True
        return run


def check_zero_tangents(args, positions: list[int]) -> None:
    """Note [Batch-free forward outputs: gradient zero or refused] in passes/__init__.py."""
    for i in positions:
        t = args[i]
        if isinstance(t, torch.Tensor) and t.numel() and bool(t.ne(0).any()):
            raise PrivacyError(
                "a forward output without a batch dim, computed from parameters, received a "
                "nonzero gradient: a tensor the forward returns or stores on a module (such as "
                "the weight the deprecated nn.utils.weight_norm hook sets each forward) was used "
                "by the loss outside the dpfx-compiled module. No example's share of that "
                "gradient can be told apart, so it cannot be clipped. Compute such terms inside "
                "the module's forward from the data, or use "
                "torch.nn.utils.parametrizations.weight_norm. dpfx's graph has written no "
                "gradient.")


def device_generator(device: torch.device) -> torch.Generator:
    """The default generator that ``randn`` (or Inductor's Philox seeds) on ``device`` reads."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


def refuse_to_run(args):
    """The runner of a graph ``dpfx.validate`` compiled only to inspect it."""
    raise RuntimeError("dpfx.validate compiled this graph only to inspect it; it does not run")


refuse_to_run._boxed_call = True
