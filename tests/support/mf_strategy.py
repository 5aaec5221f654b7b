"""Correlated-noise strategies for the runtime's tests, built from the recursions alone.

    mechanism = toeplitz3(steps=12)        # .name, .steps, .recursion(), .noise_variance(t)
    dpfx.DPOptimizer(opt, dp_model, mechanism=mechanism)

``StandIn`` has the surface ``DPOptimizer(mechanism=)`` reads of a strategy
(dpfx/privacy/strategies.py): a name, the number of steps, the recursion the runtime runs, the
variance of w_t (from the recursion's dense inverse, sum_j (C^{-1})[t, j]^2) and a state for
checkpoints. Each C is normalized as a strategy is: its largest column L2 norm is 1.
"""
from __future__ import annotations

import dataclasses

import torch

from dpfx.privacy.recursion import BLTRecursion, DenseRecursion, ToeplitzRecursion


@dataclasses.dataclass(frozen=True, eq=False)
class StandIn:
    name: str
    steps: int
    rec: object

    def recursion(self):
        return self.rec

    def matrix(self) -> torch.Tensor:
        return self.rec.matrix(self.steps)

    def noise_variance(self, t: int) -> float:
        return float(self.rec.inverse_matrix(t + 1)[t].pow(2).sum())

    def state_dict(self) -> dict:
        return {"name": self.name, "steps": self.steps, "recursion": repr(self.rec)}


def _largest_column_norm(rec, steps: int) -> float:
    return float(rec.matrix(steps).norm(dim=0).max())


def toeplitz3(steps: int) -> StandIn:
    """Three bands, c = (1, 0.5, 0.25) / ||c||."""
    norm = (1 + 0.25 + 0.0625) ** 0.5
    return StandIn("bandmf", steps, ToeplitzRecursion((1 / norm, 0.5 / norm, 0.25 / norm)))


def toeplitz4(steps: int) -> StandIn:
    c = torch.tensor([1.0, 0.6, 0.35, 0.15], dtype=torch.float64)
    return StandIn("bandmf", steps, ToeplitzRecursion(tuple((c / c.norm()).tolist())))


def blt(steps: int, buffers: int = 2) -> StandIn:
    theta = (0.9, 0.4, 0.7, 0.2)[:buffers]
    omega = (0.3, 0.2, 0.1, 0.1)[:buffers]
    rec = BLTRecursion(1.0, theta, omega)
    return StandIn("blt", steps, BLTRecursion(1.0 / _largest_column_norm(rec, steps), theta, omega))


def dense(steps: int, seed: int = 0) -> StandIn:
    """A lower-triangular C with a positive diagonal and mixed-sign entries below it."""
    g = torch.Generator().manual_seed(seed)
    c = torch.eye(steps, dtype=torch.float64) + 0.3 * torch.randn(
        steps, steps, dtype=torch.float64, generator=g).tril(-1)
    c = c / c.norm(dim=0).max()
    return StandIn("matrix", steps, DenseRecursion(tuple(tuple(c[t, :t + 1].tolist())
                                                         for t in range(steps))))


def gaussian(steps: int) -> StandIn:
    return StandIn("gaussian", steps, ToeplitzRecursion((1.0,)))


ALL = {"toeplitz3": toeplitz3, "blt2": blt, "dense": dense}


def assert_covariance(noise: torch.Tensor, expected: torch.Tensor, what: str, z: float = 5.0):
    """``noise``: (steps, coordinates), every column an independent draw of N(0, expected). Each
    entry of the empirical steps x steps covariance within ``z`` standard errors of
    ``expected``, the standard error of a Gaussian's product x_s x_t over n columns being
    sqrt((S_ss S_tt + S_st^2) / n)."""
    x = noise.to(torch.float64)
    n = x.shape[1]
    empirical = x @ x.T / n
    diag = expected.diagonal()
    se = ((diag[:, None] * diag[None, :] + expected ** 2) / n).sqrt()
    off = (empirical - expected).abs() / se
    worst = divmod(int(off.argmax()), expected.shape[0])
    assert float(off.max()) < z, (
        f"{what}: covariance of steps {worst} is {float(empirical[worst]):.4g}, expected "
        f"{float(expected[worst]):.4g} ({float(off.max()):.1f} standard errors off)")


def release_covariance(mechanism: StandIn, steps: int, std: float) -> torch.Tensor:
    """std^2 C^{-1} C^{-T} over the first ``steps`` steps: the covariance across steps of one
    coordinate's noise, std * (C^{-1} z)_t."""
    inv = mechanism.rec.inverse_matrix(mechanism.steps)[:steps, :]
    return std ** 2 * inv @ inv.T
