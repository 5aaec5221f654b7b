"""Gaussian noise drawn outside the graph: torch's generator, or a cryptographically secure source.

``dpfx.DPOptimizer`` adds N(0, (sigma * S)^2) to the clipped sum once per logical step (S the
sensitivity, C or sqrt(sum C_g^2)). Two sources:

* ``gaussian(n, std, generator)``: on the CPU the Philox kernel of ops/noise.py keyed from a
  ``torch.Generator`` (``torch.randn`` where the kernel cannot be built), on a GPU ``torch.randn``
  from the device's own generator (``noise_generator``), seeded from the OS's
  CSPRNG unless the user fixed a seed. Fast, and fine against an adversary who only sees
  the trained model; an adversary who can observe or predict the generator's state could
  subtract the noise.
* ``secure_gaussian(n, std)`` (``secure_mode=True``): every random bit comes from the kernel's
  CSPRNG (``os.urandom``), nothing is seeded, nothing can be replayed.

# Note [Secure Gaussian sampling]
Floating-point samplers leak: Mironov (2012) showed that the set of doubles a textbook Laplace
sampler can output depends on the value it protects, and Holohan & Braghin (2021, "Secure random
sampling in differential privacy") showed the same for Gaussian samplers such as Box-Muller, whose
outputs lie on a sparse, invertible set. Their mitigation, which Opacus's secure_mode also uses,
is to add up several independent samples, so that the result is no longer a single transform of
one pair of uniforms. Here:

1. 53-bit uniforms u = (k + 1/2) * 2^-53 from 8 bytes of ``os.urandom`` each: never 0 or 1;
2. Box-Muller in float64: sqrt(-2 ln u1) * (cos, sin)(2 pi u2), two N(0, 1) per pair;
3. each output is (z1 + z2 + z3 + z4) / 2, which is N(0, 1) exactly in real arithmetic;
4. scaled by std in float64, then rounded once to the parameter's dtype.

Cost: 32 bytes of kernel randomness and four Box-Muller evaluations per coordinate, about
40 ms per million parameters on one CPU core, against ~2 ms for ``torch.randn``. This is the
published mitigation, not a sampler proven exact: an exact one (a discrete Gaussian, Canonne,
Kamath & Steinke 2020) would cost far more per coordinate.
"""
from __future__ import annotations

import math
import os

import torch

from dpfx.ops import noise as cpu_noise

_MASK53 = (1 << 53) - 1


def _secure_uniform(n: int) -> torch.Tensor:
    """float64[n] in (0, 1), from the kernel CSPRNG."""
    raw = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64) if n else \
        torch.empty(0, dtype=torch.int64)
    k = torch.bitwise_and(raw, _MASK53).to(torch.float64)
    return (k + 0.5) * 2.0 ** -53


def secure_standard_normal(n: int) -> torch.Tensor:
    """float64[n] ~ N(0, 1) from the kernel CSPRNG, as the sum of four Box-Muller normals / 2."""
    pairs = 2 * n                                   # 4n normals = 2n Box-Muller pairs
    u = _secure_uniform(2 * pairs).view(2, pairs)
    radius = torch.sqrt(-2.0 * torch.log(u[0]))
    angle = (2.0 * math.pi) * u[1]
    z = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])   # 4n normals
    return z.view(4, n).sum(0) / 2.0


def secure_gaussian(n: int, std: float, dtype=torch.float32, device=None) -> torch.Tensor:
    return (secure_standard_normal(n) * std).to(dtype=dtype, device=device)


def noise_generator(device: torch.device) -> torch.Generator:
    """The generator ``gaussian`` draws from for a parameter on ``device``: the device's own
    (Philox on CUDA), so the noise is drawn where it is added; a CPU one where the device has none.
    """
    if device.type != "cpu":
        try:
            return torch.Generator(device=device)
        except RuntimeError:
            pass
    return torch.Generator()


def add_gaussian_(x: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """x += N(0, std^2) per entry, in place: on the CPU in one pass of cpu_noise's kernel (the
    normals drawn in registers, no buffer of them), on a GPU from the device's generator."""
    if generator.device.type == "cpu" and x.device.type == "cpu" and x.is_contiguous() \
            and x.dtype in (torch.float32, torch.float64):
        cpu_noise.add_noise_keyed([x], std, 1.0, 1, generator)
        return
    x.add_(gaussian(x.numel(), std, generator, dtype=x.dtype, device=x.device).view_as(x))


def gaussian(n: int, std: float, generator: torch.Generator | None, dtype=torch.float32,
             device=None) -> torch.Tensor:
    if generator is not None and generator.device.type != "cpu":
        z = torch.randn(n, generator=generator, device=generator.device, dtype=torch.float32)
        return z.mul_(std).to(dtype=dtype, device=device)
    z = cpu_noise.gaussian(n, generator)
    return (z if std == 1.0 else z * std).to(dtype=dtype, device=device)
