"""The bound of adaptive clipping, C_t, and its one writer.

    dp_model = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0,
                            expected_batch_size=256, clipping="adaptive",
                            target_unclipped_quantile=0.5, clip_lr=0.2,
                            count_noise_multiplier=256 / 20)
    ...
    dp_model.adaptive_clip.bound        # C_t, public: it is computed from noised releases only

# Note [Adaptive clipping]
Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping". At step t every
example is clipped to C_t (``min(1, C_t / (||g_i|| + 1e-6))``, as flat clipping), and beside the
gradient the step releases the centered count of unclipped examples

    s_t = sum_i (1[||g_i|| <= C_t] - 1/2) + N(0, sigma_b^2)

whose per-example term is +-1/2: sensitivity 1/2 under adding or removing an example, noise
multiplier 2 sigma_b. Then b_t = s_t / D + 1/2 (D the expected batch size, or the batch's own
size without one) and C_{t+1} = C_t exp(-eta (b_t - gamma)): the bound shrinks while more than a
fraction gamma of the examples fit under it, and grows otherwise, so it follows the gamma-quantile
of the per-sample norms. C_{t+1} is computed from C_t and the noised release only, so it is public.

Privacy (Andrew et al., Theorem 1): the gradient (sensitivity C_t, std sigma_grad C_t) and the
count (sensitivity 1/2, std sigma_b) of one sampled batch are one Gaussian mechanism on the
concatenation: scaled to unit noise, an example moves them by at most
sqrt(sigma_grad^-2 + (2 sigma_b)^-2). With sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2) that is
1/sigma: the step costs exactly one Poisson-sampled Gaussian step of multiplier sigma, which is
what the accountant counts. sigma_b <= sigma / 2 leaves no noise budget for the gradient and is
refused (config.py).

The graph reads C_t as an input (a 0-d tensor, the placeholder ``clip_bound``, appended by the
backend to the backward's arguments), so a new bound never compiles anything again; the verifier
proves that the clip factor and the noise std read that one input (passes/verify/). The count
is computed in the graph from the norms the clip factor reads; with noise="graph" the graph adds
its noise (one more entry of the step's draw) and the backend hands s_t to ``released``; with
noise="optimizer" the graph returns the raw count, ``add_count`` sums it over a logical batch and
``DPOptimizer.step`` noises it once and calls ``released``.
"""
from __future__ import annotations

import math

import torch

from dpfx.errors import PrivacyError


class AdaptiveClip:
    """C_t and the count of the step in progress. Its methods are the only writers of both."""

    def __init__(self, initial: float, target_unclipped_quantile: float, clip_lr: float,
                 count_noise_multiplier: float):
        self.target_unclipped_quantile = float(target_unclipped_quantile)
        self.clip_lr = float(clip_lr)
        self.count_noise_multiplier = float(count_noise_multiplier)
        self._bound = float(initial)
        self._steps = 0
        self._count = None          # noise="optimizer": the raw centered count since the last step
        self._tensors: dict = {}    # device -> the 0-d float32 tensor the graphs read

    @property
    def bound(self) -> float:
        """C_t: the bound the next backward clips to."""
        return self._bound

    @property
    def steps(self) -> int:
        """Updates of the bound so far."""
        return self._steps

    def tensor(self, device: torch.device) -> torch.Tensor:
        """C_t as the graph's input on ``device`` (the same tensor every step, written in place)."""
        t = self._tensors.get(device)
        if t is None:
            t = self._tensors[device] = torch.tensor(self._bound, dtype=torch.float32,
                                                     device=device)
        return t

    # -- noise="optimizer": the raw count of each backward, noised once at the step -----------------
    def add_count(self, count: torch.Tensor) -> None:
        self._count = count if self._count is None else self._count + count

    def take_count(self) -> torch.Tensor | None:
        count, self._count = self._count, None
        return count

    def reset_count(self) -> None:
        self._count = None

    # -- the update --------------------------------------------------------------------------------
    def released(self, noisy_count: float, denominator: float) -> None:
        """C_{t+1} = C_t exp(-eta (b_t - gamma)), b_t = s_t / D + 1/2, from the step's noised
        centered count s_t. Without examples to divide by (D = 0) the bound stays."""
        if denominator <= 0:
            return
        fraction = float(noisy_count) / float(denominator) + 0.5
        bound = self._bound * math.exp(-self.clip_lr * (fraction - self.target_unclipped_quantile))
        if not (math.isfinite(bound) and bound > 0):
            raise PrivacyError(f"adaptive clipping: the bound left (0, inf) ({bound}); the noised "
                               f"count was {noisy_count}")
        self._set(bound)
        self._steps += 1

    def _set(self, bound: float) -> None:
        self._bound = bound
        for t in self._tensors.values():
            t.fill_(bound)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self._count is not None:
            raise ValueError("a logical batch's count is half accumulated; save after its step()")
        return {"bound": self._bound, "steps": self._steps,
                "target_unclipped_quantile": self.target_unclipped_quantile,
                "clip_lr": self.clip_lr, "count_noise_multiplier": self.count_noise_multiplier}

    def load_state_dict(self, state: dict) -> None:
        if "target_quantile" in state:      # a checkpoint written under the keyword's old name
            state = {**state, "target_unclipped_quantile": state["target_quantile"]}
        for key in ("target_unclipped_quantile", "clip_lr", "count_noise_multiplier"):
            if float(state[key]) != getattr(self, key):
                raise ValueError(f"the checkpoint's adaptive clipping has {key}={state[key]}, this "
                                 f"model {getattr(self, key)}: compile with the checkpoint's "
                                 f"settings to resume it")
        bound = float(state["bound"])
        if not (math.isfinite(bound) and bound > 0):
            raise ValueError(f"the checkpoint's adaptive bound {bound} is not in (0, inf)")
        self._set(bound)
        self._steps = int(state["steps"])
        self._count = None
