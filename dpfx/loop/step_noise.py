"""The noise a private step draws at ``step()``: Gaussian, or correlated under a strategy.

    noise = StepNoise(config, device, secure_mode=False, sharding=None, mechanism=None,
                      check_noise_every=None, draws=True)
    noise.add(flat, std)              # N(0, std^2) on every coordinate (the adaptive count too)
    noise.add_release(flat, std)      # the gradient's noise: std * w_t under a strategy

The source is the generator's Philox stream (OS-seeded, or the compiled model's seed mixed with
the rank under sharding) or, with ``secure_mode``, the CSPRNG (loop/noise.py). Under a
correlated-noise strategy the state of earlier noise lives where the noise is drawn (Note
[Correlated noise where it is drawn]); ``draws`` says whether this rank draws it.
"""
from __future__ import annotations

import secrets

import torch

from dpfx.errors import PrivacyError
from dpfx.loop.correlated import CorrelatedNoise, NoiseCheck
from dpfx.loop.noise import (add_gaussian_, gaussian, noise_generator, secure_gaussian,
                             secure_standard_normal)


class StepNoise:
    """The optimizer's noise source: its generator (None under ``secure_mode`` or graph noise),
    and under a strategy the correlation state and its check."""

    def __init__(self, config, device: torch.device, *, secure_mode: bool, sharding,
                 mechanism, check_noise_every: int | None, draws: bool):
        self.secure_mode = secure_mode
        self.mechanism = mechanism
        self.generator = None
        if config.noise == "optimizer" and not secure_mode:
            seed = secrets.randbits(62) if config.seed is None else config.seed
            if sharding is not None and config.seed is not None:
                seed = sharding.seed(seed)
            self.generator = noise_generator(device).manual_seed(seed)
        # See Note [Correlated noise where it is drawn]
        self.correlated = self.check = None
        if mechanism is not None and draws:
            recursion = mechanism.recursion()
            self.correlated = CorrelatedNoise(recursion, mechanism.steps, name=mechanism.name)
            if check_noise_every is not None:
                self.check = NoiseCheck(recursion, name=mechanism.name,
                                        window=self.correlated.window, every=check_noise_every)

    def check_left(self, steps: int, ledger) -> None:
        """A correlated-noise strategy for n steps releases n steps, refused before the ledger
        records step n + 1 (every rank refuses alike: they count the same steps)."""
        if self.mechanism is not None and steps >= self.mechanism.steps:
            raise PrivacyError(
                f"the '{self.mechanism.name}' strategy was built for {self.mechanism.steps} "
                f"steps and this is step {steps + 1}: its noise and its accounting end "
                f"there, and nothing was released. Build the strategy for the run's full number "
                f"of steps (its steps=), or start a new run with a new strategy and count both "
                f"runs' epsilon together")
        if self.mechanism is not None and ledger is not None and \
                ledger.steps != steps:
            raise PrivacyError(
                f"the privacy ledger records {ledger.steps} releases and this "
                f"optimizer is at step {steps} of the '{self.mechanism.name}' strategy: "
                f"release t of the strategy must be the ledger's record t + 1. Load the run's "
                f"checkpoint (dpfx.load_checkpoint) before stepping, or give a new run a new "
                f"ledger path")
        if self.correlated is not None and self.correlated.t != steps:
            raise PrivacyError(
                f"the correlated noise state of the '{self.mechanism.name}' strategy is at step "
                f"{self.correlated.t} and the optimizer at step {steps}: a release's noise was "
                f"drawn without its step being taken (an error inside step()). Resume from the "
                f"last checkpoint")

    # Note [Correlated noise where it is drawn]
    # With a correlated-noise strategy (``mechanism=``) step t adds std * w_t, w_t = (C^{-1} z)_t,
    # to the clipped sum (loop/correlated.py), z_t drawn from the same sources as the Gaussian
    # noise (the generator's Philox stream, or secure_mode's CSPRNG). The state lives where the
    # noise is drawn: on rank 0 under replicated ranks (Note [Noise once across ranks] in
    # loop/optim.py), so the other ranks hold none; on every rank under sharding, over the
    # coordinates the rank owns (its padded shards end to end, Note [Sharded DP-SGD] in
    # loop/fsdp.py), so it is sharded like the gradients and each coordinate's noise sequence is
    # drawn and correlated once. The flat buffer is used (not the in-place kernel) since w_t is
    # needed as a vector.
    def add_release(self, flat: torch.Tensor, std: float) -> None:
        if self.mechanism is None:
            self.add(flat, std)
            return
        t = self.correlated.t
        z = secure_standard_normal(flat.numel()).to(flat.device) if self.secure_mode else \
            gaussian(flat.numel(), 1.0, self.generator, device=flat.device)
        if self.check is not None:
            self.check.before(t, z, flat)
        w = self.correlated.step(z)
        if std:
            flat.add_(w.to(flat.dtype), alpha=std)
        if self.check is not None:
            self.check.after(t, flat, std)

    def add(self, flat: torch.Tensor, std: float) -> None:
        if std == 0:
            return
        if self.secure_mode:
            flat += secure_gaussian(flat.numel(), std, device=flat.device)
        else:
            add_gaussian_(flat, std, self.generator)
