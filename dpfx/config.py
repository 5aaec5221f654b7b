"""Options of one `dpfx.compile` call, validated once so that the passes can trust them."""
from __future__ import annotations

import dataclasses
import math

LOSS_REDUCTIONS = ("mean", "sum")
BACKENDS = ("inductor", "eager")
STRATEGIES = ("auto", "materialize", "ghost")

# Added to the per-sample norm before dividing, as Opacus does, so that results compare number for
# number: clip_factor = min(1, C / (||g|| + CLIP_EPS)).
CLIP_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class DPConfig:
    max_grad_norm: float
    noise_multiplier: float
    loss_reduction: str = "mean"
    expected_batch_size: int | None = None
    seed: int | None = None
    backend: str = "inductor"
    strategy: str = "auto"

    def __post_init__(self):
        if isinstance(self.max_grad_norm, bool) or not isinstance(self.max_grad_norm, (int, float)):
            raise ValueError(f"max_grad_norm must be a positive number, got {self.max_grad_norm!r}")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(
                f"max_grad_norm must be finite and > 0 (it is the clipping bound C), "
                f"got {self.max_grad_norm!r}"
            )
        if isinstance(self.noise_multiplier, bool) or not isinstance(self.noise_multiplier, (int, float)):
            raise ValueError(f"noise_multiplier must be a number >= 0, got {self.noise_multiplier!r}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(
                f"noise_multiplier must be finite and >= 0 (sigma; 0 gives no privacy), "
                f"got {self.noise_multiplier!r}"
            )
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {self.loss_reduction!r}"
            )
        if self.expected_batch_size is not None and (
            isinstance(self.expected_batch_size, bool)
            or not isinstance(self.expected_batch_size, int)
            or self.expected_batch_size <= 0
        ):
            raise ValueError(
                f"expected_batch_size must be a positive int or None, got {self.expected_batch_size!r}"
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise added to the clipped sum, before dividing by D."""
        return self.noise_multiplier * self.max_grad_norm
