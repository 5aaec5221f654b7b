"""How a correlated-noise strategy is run one step at a time: the recursions that give w = C^{-1} z.

    from dpfx.privacy.recursion import ToeplitzRecursion
    r = ToeplitzRecursion((1.0, 0.5))            # C = Toeplitz, c_0 = 1, c_1 = 0.5 (two bands)
    r.inverse_matrix(4)                           # float64 [4, 4]: C^{-1}, for tests and variances

A matrix-factorization mechanism (DP-MF, DP-FTRL) adds sigma * S * w_t at step t, where
w = C^{-1} z for a lower-triangular strategy matrix C and iid standard normal vectors z_t. The
runtime never forms C^{-1}: each step it reads the fresh z_t and a state made of earlier noise only,
by one of three recursions (the strategy decides which; ``Strategy.recursion()`` in
privacy/strategies.py):

* ``ToeplitzRecursion(coeffs)``: C lower-triangular Toeplitz with first column c_0 .. c_{k-1}
  (k the number of bands, or n): w_t = (z_t - sum_{j=1}^{min(t, k-1)} c_j w_{t-j}) / c_0. State: the
  last k - 1 vectors w.
* ``BLTRecursion(scale, theta, omega)``: C = scale * T, T Toeplitz with T_0 = 1 and
  T_j = sum_i omega_i theta_i^(j-1) for j >= 1 (a buffered linear Toeplitz matrix, Dvijotham et
  al. 2024): u_t = z_t - sum_i omega_i s_{i,t}, s_{i,t} = theta_i s_{i,t-1} + u_{t-1} (s_{i,0} = 0),
  w_t = u_t / scale. State: the d buffers s_i.
* ``DenseRecursion(matrix)``: any lower-triangular C: w_t = (z_t - sum_{j<t} C[t,j] w_j) / C[t,t].
  State: every earlier w.

Each also gives its C as a dense float64 matrix for n steps, so a test or an accountant can check
the recursion against C^{-1} computed by a linear solve.
"""
from __future__ import annotations

import dataclasses

import torch


def _inverse(c: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(c.shape[0], dtype=torch.float64)
    return torch.linalg.solve_triangular(c, eye, upper=False)


@dataclasses.dataclass(frozen=True)
class ToeplitzRecursion:
    coeffs: tuple[float, ...]           # c_0 .. c_{k-1}, c_0 > 0

    def matrix(self, steps: int) -> torch.Tensor:
        c = torch.zeros(steps, dtype=torch.float64)
        k = min(steps, len(self.coeffs))
        c[:k] = torch.tensor(self.coeffs[:k], dtype=torch.float64)
        i = torch.arange(steps)
        lag = i[:, None] - i[None, :]
        return torch.where(lag >= 0, c[lag.clamp(min=0)], torch.zeros((), dtype=torch.float64))

    def inverse_matrix(self, steps: int) -> torch.Tensor:
        return _inverse(self.matrix(steps))


@dataclasses.dataclass(frozen=True)
class BLTRecursion:
    scale: float
    theta: tuple[float, ...]            # the buffers' decay rates, in [0, 1)
    omega: tuple[float, ...]            # their weights

    def coefficients(self, steps: int) -> tuple[float, ...]:
        """T_0 .. T_{steps-1} of the unscaled Toeplitz matrix T."""
        theta = torch.tensor(self.theta, dtype=torch.float64)
        omega = torch.tensor(self.omega, dtype=torch.float64)
        j = torch.arange(max(steps - 1, 0), dtype=torch.float64)
        tail = (omega[None, :] * theta[None, :] ** j[:, None]).sum(1)
        return (1.0, *tail.tolist())[:steps]

    def matrix(self, steps: int) -> torch.Tensor:
        return self.scale * ToeplitzRecursion(self.coefficients(steps)).matrix(steps)

    def inverse_matrix(self, steps: int) -> torch.Tensor:
        return _inverse(self.matrix(steps))


@dataclasses.dataclass(frozen=True)
class DenseRecursion:
    rows: tuple[tuple[float, ...], ...]     # row t holds C[t, 0..t]

    def matrix(self, steps: int) -> torch.Tensor:
        if steps > len(self.rows):
            raise ValueError(f"the strategy matrix has {len(self.rows)} steps, not {steps}")
        c = torch.zeros(steps, steps, dtype=torch.float64)
        for t in range(steps):
            c[t, :t + 1] = torch.tensor(self.rows[t], dtype=torch.float64)
        return c

    def inverse_matrix(self, steps: int) -> torch.Tensor:
        return _inverse(self.matrix(steps))
