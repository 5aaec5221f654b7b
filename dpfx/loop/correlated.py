"""Correlated noise, one step at a time: the state of a matrix-factorization mechanism.

    noise = CorrelatedNoise(ToeplitzRecursion((1.0, 0.5, 0.25)), steps=1000, name="bandmf")
    w = noise.step(z)           # z: this step's fresh N(0, I) draw, flat; w = (C^{-1} z)_t
    flat += sigma * S * w       # DPOptimizer adds it to the clipped sum, then divides by D

A matrix-factorization mechanism (DP-MF, DP-FTRL: Choquette-Choo et al. 2023; BLT: Dvijotham et
al. 2024, McMahan et al. 2024) adds sigma * S * w_t at step t, w = C^{-1} Z for a lower-triangular
strategy matrix C. ``CorrelatedNoise`` runs the strategy's recursion (privacy/recursion.py) and
keeps what it needs of the past:

* ``ToeplitzRecursion`` with k coefficients: the last k - 1 vectors w (a ring);
* ``BLTRecursion`` with d buffers: the d buffers s_i;
* ``DenseRecursion``: every earlier w.

Its only input is z: ``step`` receives no gradient, no parameter and no clipped sum, so the state
is made of noise by construction (Note [The state is noise only]); ``NoiseCheck`` below checks
the releases against the dense C^{-1} at run time.

Beside the state: ``NoiseCheck``, the run-time check of the releases, and the checks a
``DPOptimizer(mechanism=)`` makes of its options (``check_mechanism``) and of a checkpoint it
resumes (``check_resume``).

Cost per step and per parameter: the window's vectors in float32 (4 (k - 1) bytes for k bands,
4 d bytes for d buffers, 4 t bytes at step t for a dense strategy) and one multiply-add per
vector of the window.

# Note [The state is noise only]
The recursion's state is the last w's (or the BLT buffers, linear combinations of earlier u = c w),
each a linear function of earlier z's alone. ``step`` takes z and nothing else, and the only
other writer of the buffers is ``load_state_dict``, which takes a state this class wrote. So no
value derived from data can enter the state, and w_t is exactly row t of C^{-1} applied to
z_0 .. z_t, whatever the gradients were.

# Note [The correlation state is kept in float32]
w_t is a linear combination of all earlier z's with coefficients of both signs (C^{-1} of a banded
or BLT strategy is dense), and the state's rounding errors feed every later step; but the
recursions of a valid strategy are stable (C^{-1}'s rows decay), so the errors stay bounded.
Measured against the float64 product C^{-1} Z (20,000 coordinates, 500 steps; 2,000 x 3,000 for
the slow ones): a float32 state's w has a relative L2 error of 8e-8 for a 4-band Toeplitz
strategy, 5e-8 and 6e-8 for BLTs with 2 and 4 buffers (theta up to 0.999), 4e-8 for a BLT with
theta = 0.9999 after 3,000 steps, and 7e-7 for a non-banded 500-step square-root (BSR-like)
Toeplitz strategy; the error does not grow with the steps. That is the float32 release's own
rounding (6e-8 of |sum + noise|), while a float64 state would double the state's memory (8 bytes
per parameter per vector of the window: 32 bytes per parameter for 4 buffers, four times the
float32 weights). So the state is float32 (``dtype=`` for tests), w is returned in it, and the
run-time check (``NoiseCheck``) allows 1e-4 of the terms' magnitude, far above this drift and far
below any data-dependent change of the release.

# Note [The correlation state is secret]
The buffers are the noise of earlier steps. Anyone holding them and an intermediate release could
subtract the noise from it. ``state_dict`` returns them so that a checkpoint resumes the same
noise sequence; keep such checkpoints as private as the training data (as a seeded generator's
state).
"""
from __future__ import annotations

import math
import secrets

import torch

from dpfx.errors import PrivacyError
from dpfx.privacy.recursion import BLTRecursion, DenseRecursion, ToeplitzRecursion

STATE_DTYPE = torch.float32        # Note [The correlation state is kept in float32]


class CorrelatedNoise:
    """w_t = (C^{-1} z)_t for t = 0, 1, ..., steps - 1, from each step's fresh z_t."""

    def __init__(self, recursion, steps: int, *, name: str = "strategy",
                 dtype: torch.dtype = STATE_DTYPE):
        if not isinstance(recursion, (ToeplitzRecursion, BLTRecursion, DenseRecursion)):
            raise TypeError(f"recursion must be a ToeplitzRecursion, BLTRecursion or "
                            f"DenseRecursion (dpfx/privacy/recursion.py), got "
                            f"{type(recursion).__name__}")
        if int(steps) < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        self.recursion, self.steps, self.name, self.dtype = recursion, int(steps), name, dtype
        self.t = 0
        self._buffers: torch.Tensor | None = None      # [window, numel], allocated at step 0
        self._dense: list[torch.Tensor] = []           # DenseRecursion: w_0 .. w_{t-1}
        if isinstance(recursion, ToeplitzRecursion):
            coeffs = tuple(float(c) for c in recursion.coeffs[:self.steps])
            if not coeffs or coeffs[0] <= 0:
                raise ValueError(f"the Toeplitz strategy's c_0 must be positive, got {coeffs[:1]}")
            self._coeffs = coeffs
            self.window = len(coeffs) - 1
        elif isinstance(recursion, BLTRecursion):
            if recursion.scale <= 0 or len(recursion.theta) != len(recursion.omega):
                raise ValueError(f"BLT strategy: scale must be positive and theta, omega of one "
                                 f"length, got {recursion}")
            self._theta = torch.tensor(recursion.theta, dtype=dtype)
            self.window = len(recursion.theta)
        else:
            if len(recursion.rows) < self.steps:
                raise ValueError(f"the strategy matrix has {len(recursion.rows)} rows for "
                                 f"{self.steps} steps")
            if any(row[-1] <= 0 or len(row) != t + 1 for t, row in enumerate(
                    recursion.rows[:self.steps])):
                raise ValueError("the strategy matrix must be lower triangular with a positive "
                                 "diagonal (row t holds C[t, 0..t])")
            self.window = self.steps - 1

    def __repr__(self) -> str:
        return f"CorrelatedNoise({self.name!r}, step {self.t} of {self.steps})"

    # -- the step ----------------------------------------------------------------------------------
    def step(self, z: torch.Tensor) -> torch.Tensor:
        """w_t for this step's fresh standard normal z_t (flat); the state moves to t + 1."""
        if self.t >= self.steps:
            raise PrivacyError(
                f"the '{self.name}' strategy was built for {self.steps} steps and this is step "
                f"{self.t + 1}: its noise and its accounting end there. Build the strategy for "
                f"the run's full number of steps (its steps=), or start a new run with a new "
                f"strategy and count both runs' epsilon together")
        if z.dim() != 1:
            raise ValueError(f"z must be flat, got shape {tuple(z.shape)}")
        if self.t == 0:
            self._buffers = torch.zeros(max(self.window, 0) if not isinstance(
                self.recursion, DenseRecursion) else 0, z.numel(), dtype=self.dtype,
                device=z.device)
        elif z.numel() != self._numel():
            raise ValueError(f"z has {z.numel()} entries and the state {self._numel()}: one "
                             f"state follows one set of coordinates")
        z = z.to(self.dtype)
        if isinstance(self.recursion, ToeplitzRecursion):
            w = self._toeplitz(z)
        elif isinstance(self.recursion, BLTRecursion):
            w = self._blt(z)
        else:
            w = self._dense_step(z)
        self.t += 1
        return w

    # Note [The state's step as elementwise passes]
    # Each step is a few elementwise passes over the coordinates: for k bands, w = z / c_0 -
    # sum_j (c_j / c_0) w_{t-j} (k - 1 multiply-adds) and a copy into the ring; for d buffers,
    # u = z - sum_i omega_i s_i (d multiply-adds), s_i = theta_i s_i + u (one fused pass over the
    # buffers) and w = u / scale. Writing the sums as a matrix-vector product over the [window,
    # numel] buffers (torch.addmv) was 4-10x slower on the CPU (1M coordinates, 4 vectors).
    def _toeplitz(self, z: torch.Tensor) -> torch.Tensor:
        c, t, k1 = self._coeffs, self.t, self.window
        w = torch.mul(z, 1.0 / c[0])
        for j in range(1, min(t, k1) + 1):      # w_{t-j} sits at ring slot (t - j) mod (k - 1)
            w.sub_(self._buffers[(t - j) % k1], alpha=c[j] / c[0])
        if k1:
            self._buffers[t % k1].copy_(w)
        return w

    def _blt(self, z: torch.Tensor) -> torch.Tensor:
        s = self._buffers                        # s_{i,t}: theta_i s_{i,t-1} + u_{t-1}
        u = z.clone()
        if self.t:                               # s_{i,0} = 0
            for i, omega in enumerate(self.recursion.omega):
                u.sub_(s[i], alpha=float(omega))
        if self.window:
            if self._theta.device != s.device or self._theta.dtype != s.dtype:
                self._theta = self._theta.to(device=s.device, dtype=s.dtype)
            torch.addcmul(u, s, self._theta[:, None], out=s)     # s_{i,t+1}
        return u.div_(self.recursion.scale)

    def _dense_step(self, z: torch.Tensor) -> torch.Tensor:
        row = self.recursion.rows[self.t]
        acc = z.clone()
        for j, w_j in enumerate(self._dense):
            if row[j]:
                acc.sub_(w_j, alpha=float(row[j]))
        w = acc.div_(float(row[-1]))
        if self.t + 1 < self.steps:              # the last step's w is never read again
            self._dense.append(w.clone())
        return w

    def _numel(self) -> int:
        return self._buffers.shape[1]

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The step counter and the noise buffers (Note [The correlation state is secret])."""
        if isinstance(self.recursion, DenseRecursion) and self._dense:
            buffers = torch.stack(self._dense)
        else:
            buffers = None if self._buffers is None else self._buffers.clone()
        return {"name": self.name, "steps": self.steps, "t": self.t,
                "recursion": type(self.recursion).__name__, "buffers": buffers,
                "numel": None if self._buffers is None else self._numel()}

    def load_state_dict(self, state: dict, device=None) -> None:
        """A state this class wrote for the same strategy (checked before anything changes), its
        buffers moved to ``device`` (where the noise is drawn)."""
        if not isinstance(state, dict) or not {"t", "buffers", "steps"} <= set(state):
            raise ValueError("state must come from CorrelatedNoise.state_dict()")
        if state.get("name") != self.name or state["steps"] != self.steps or \
                state.get("recursion") != type(self.recursion).__name__:
            raise ValueError(
                f"the checkpoint's correlated noise is of the '{state.get('name')}' strategy "
                f"({state.get('recursion')}, {state['steps']} steps), this optimizer's of "
                f"'{self.name}' ({type(self.recursion).__name__}, {self.steps} steps): resume "
                f"with the strategy the run started with")
        t, buffers = int(state["t"]), state["buffers"]
        if not 0 <= t <= self.steps or (t > 0) != (buffers is not None):
            raise ValueError(f"the correlated noise state is damaged (step {t}, buffers "
                             f"{None if buffers is None else tuple(buffers.shape)})")
        if device is None and self._buffers is not None:
            device = self._buffers.device
        self.t = t
        if buffers is None:
            self._buffers, self._dense = None, []
            return
        buffers = buffers.to(device=device, dtype=self.dtype)
        if isinstance(self.recursion, DenseRecursion):
            self._buffers = torch.zeros(0, int(state["numel"]), dtype=self.dtype,
                                        device=buffers.device)
            self._dense = [b.clone() for b in buffers]
        else:
            self._buffers = buffers.clone()


# Note [Checking the releases]
# ``CorrelatedNoise`` is noise-only by construction (Note [The state is noise only]); ``NoiseCheck``
# checks what reached the release, so that a state which read a gradient, skipped an update or
# was fed the same draw twice is caught where it acts. ``DPOptimizer(check_noise_every=N)`` runs it:
#
# * every step, the draw z_t is recorded on m random coordinates (chosen from the OS's randomness
#   once per run, so no faulty state can aim at them); a draw equal on all m coordinates to an
#   earlier step's is a reused seed or key;
# * on the first window + 1 steps (window: the state's length, so every slot of the ring or
#   buffer has been written and read once) and on every N-th step after, the noise part of the
#   release on those coordinates, (release - clipped sum), is compared with sigma * S * sum_j
#   (C^{-1})[t, j] z_j, row t of C^{-1} computed from the dense C (``recursion.matrix``) by one
#   triangular solve, not by the recursion; and the draw's mean square is compared with 1 (a draw
#   scaled down would pass the first two).
#
# A mismatch beyond 1e-4 of the terms' magnitude (float32 rounding and the state's drift are below
# 1e-6, Note [The correlation state is kept in float32]) is a ``PrivacyError``; the step stops
# before the parameters move. It is a guard against faults, not the proof: a state that let
# through less than 1e-4 of the terms' magnitude, or acted only between checked steps without
# changing a later checked one, would pass; the proof is the construction (Note [The state is
# noise only]), and a fault in the recursion shows at the next checked step since every later
# w depends on the state. Cost: m numbers a step, and at a checked step t a t x t matrix
# (8 t^2 bytes, for a moment) and its solve: set N so that checks stay rare in long runs.
# The planted faults it catches: tests/loop/test_correlated_check.py.


class NoiseCheck:
    """Checks releases of correlated noise against the dense C^{-1} (Note [Checking the releases])."""

    TOLERANCE = 1e-4

    def __init__(self, recursion, *, name: str, window: int, every: int, coordinates: int = 64):
        if int(every) < 1:
            raise ValueError(f"check_noise_every must be a positive number of steps, got {every}")
        self.recursion, self.name = recursion, name
        self.first, self.every, self.coordinates = window + 1, int(every), int(coordinates)
        self.checked = 0                    # releases compared (tests assert that it ran)
        self._index: torch.Tensor | None = None
        self._draws: list[torch.Tensor] = []
        self._seen: dict[bytes, int] = {}
        self._clipped: torch.Tensor | None = None

    def due(self, t: int) -> bool:
        return t < self.first or t % self.every == 0

    def before(self, t: int, z: torch.Tensor, flat: torch.Tensor) -> None:
        """Step t's draw z, and the clipped sum ``flat`` it is about to be added to."""
        if self._index is None:
            pick = torch.Generator().manual_seed(secrets.randbits(62))
            m = min(self.coordinates, z.numel())
            self._index = torch.randperm(z.numel(), generator=pick)[:m].sort().values
        if len(self._draws) != t:
            raise PrivacyError(f"the noise check of the '{self.name}' strategy recorded "
                               f"{len(self._draws)} draws before step {t}: a release went "
                               f"unrecorded")
        index = self._index.to(z.device)
        row = z[index].to(device="cpu", dtype=torch.float64)
        key = row.numpy().tobytes()
        if key in self._seen:
            raise PrivacyError(
                f"'{self.name}' strategy, step {t}: the fresh noise draw repeats step "
                f"{self._seen[key]}'s on {row.numel()} random coordinates, so the noise "
                f"generator was re-seeded or a key reused. The release is refused; start the "
                f"run again from a checkpoint without fixing the seed")
        self._seen[key] = t
        self._draws.append(row)
        self._clipped = None
        if self.due(t):
            self._clipped = flat[index].to(device="cpu", dtype=torch.float64)
            n = z.numel()
            square = float(z.to(torch.float64).pow(2).mean())
            if abs(square - 1) > 6 * math.sqrt(2 / n):
                raise PrivacyError(f"'{self.name}' strategy, step {t}: the fresh draw has mean "
                                   f"square {square:.4g} over {n} coordinates, not 1: it is not "
                                   f"standard normal noise. The release is refused")

    def after(self, t: int, flat: torch.Tensor, std: float) -> None:
        """``flat`` now holds the clipped sum plus the step's noise of std ``std`` * w_t."""
        if self._clipped is None:
            return
        c = self.recursion.matrix(t + 1)
        unit = torch.zeros(t + 1, 1, dtype=torch.float64)
        unit[t] = 1.0
        row = torch.linalg.solve_triangular(c.T, unit, upper=True)[:, 0]    # (C^{-1})[t, :]
        draws = torch.stack(self._draws)                                  # [t + 1, m]
        expected = std * (row @ draws)
        released = flat[self._index.to(flat.device)].to(device="cpu", dtype=torch.float64)
        noise = released - self._clipped
        scale = self._clipped.abs() + released.abs() + std * (row.abs() @ draws.abs())
        off = (noise - expected).abs() > self.TOLERANCE * scale
        if bool(off.any()):
            i = int(off.nonzero()[0])
            raise PrivacyError(
                f"'{self.name}' strategy, step {t}: the release is not the clipped sum plus the "
                f"strategy's noise: on coordinate {int(self._index[i])} it added "
                f"{float(noise[i]):.6g}, and sigma * S * (C^{{-1}} z)_t is "
                f"{float(expected[i]):.6g} ({int(off.sum())} of {off.numel()} checked "
                f"coordinates differ). The correlation state did not follow the strategy; the "
                f"step is refused before the parameters move")
        self._clipped = None
        self.checked += 1

    def state_dict(self) -> dict:
        return {"index": self._index, "draws": torch.stack(self._draws) if self._draws
                else None}

    def load_state_dict(self, state: dict) -> None:
        self._index = state["index"]
        self._draws = [] if state["draws"] is None else list(state["draws"].unbind(0))
        self._seen = {d.numpy().tobytes(): t for t, d in enumerate(self._draws)}


def check_mechanism(mechanism, config, check_noise_every) -> None:
    """A correlated-noise strategy (``mechanism=``) needs the optimizer's noise and a noise scale
    fixed for the run; ``check_noise_every`` needs a strategy to check."""
    if check_noise_every is not None and mechanism is None:
        raise ValueError("check_noise_every checks correlated noise against its strategy: give "
                         "mechanism= too (Gaussian noise has no state to check)")
    if mechanism is None:
        return
    missing = [a for a in ("name", "steps", "recursion", "noise_variance", "state_dict")
               if not hasattr(mechanism, a)]
    if missing:
        raise TypeError(f"mechanism must be a correlated-noise strategy "
                        f"(dpfx.privacy.strategies), got {type(mechanism).__name__} without "
                        f"{', '.join(missing)}")
    if config.noise != "optimizer":
        raise ValueError(
            f"mechanism='{mechanism.name}' adds noise correlated across steps, which only the "
            f"optimizer can do: compile the model with dpfx.compile(..., noise='optimizer') "
            f"(it has noise='{config.noise}')")
    if config.adaptive:
        raise ValueError(
            f"mechanism='{mechanism.name}' with clipping='adaptive': the strategy's accounting "
            f"needs one noise scale sigma * S for every step, and adaptive clipping moves S "
            f"each step (and releases a noised count the strategy does not account). Compile "
            f"with a fixed max_grad_norm, or use mechanism=None")


def check_resume(mechanism, state: dict, *, holds_state: bool, checked: bool, ledger) -> None:
    """Before a DPOptimizer loads ``state``: its correlated noise continues this optimizer's
    strategy at the checkpoint's step, and no release came after the checkpoint."""
    mine = None if mechanism is None else mechanism.state_dict()
    if state.get("mechanism") != mine:
        raise ValueError(
            f"the checkpoint's noise mechanism ({_strategy_name(state.get('mechanism'))}) is not "
            f"this DPOptimizer's ({_strategy_name(mine)}): a correlated-noise run resumes with "
            f"the strategy it started with (the same mechanism=), and a Gaussian run with "
            f"mechanism=None")
    if mechanism is None:
        return
    steps = int(state.get("steps", 0))
    saved = state.get("correlated")
    if holds_state and (saved is None or int(saved.get("t", -1)) != steps):
        raise ValueError(
            f"the checkpoint's correlated noise state is at step "
            f"{None if saved is None else saved.get('t')} and its optimizer at step {steps}; it "
            f"was not saved by this rank's DPOptimizer.state_dict() (under several ranks rank 0 "
            f"holds the state: load each rank's own checkpoint, saved on the same rank)")
    if checked and state.get("noise_check") is None:
        raise ValueError("check_noise_every: the checkpoint has no record of its earlier noise "
                         "draws (it was saved without the check), so the check could not "
                         "recompute this run's noise; resume without check_noise_every")
    # Note [A release after the checkpoint]
    # With Gaussian noise a release after the last checkpoint is one more composed step, which
    # the accountant takes from the ledger. With correlated noise the steps after the
    # checkpoint drew noise that the checkpoint's state does not hold; resuming from it would
    # release those rows of the strategy again with other noise, a second, partial run of the
    # mechanism that the strategy's accounting does not cover. So a ledger ahead of the
    # checkpoint is refused (tests/loop/test_correlated_optimizer.py).
    if ledger is not None and ledger.steps > steps:
        raise ValueError(
            f"the privacy ledger records {ledger.steps} releases and the checkpoint was saved "
            f"after {steps}: the releases in between used correlated noise this checkpoint's "
            f"state does not hold, and resuming here would release steps {steps + 1}.. of the "
            f"'{mechanism.name}' strategy a second time, which its accounting does not cover. "
            f"Resume from a checkpoint saved at step {ledger.steps}, or start a new run")



def _strategy_name(state) -> str:
    if state is None:
        return "Gaussian, none"
    if isinstance(state, dict):
        return f"'{state.get('name')}', {state.get('steps')} steps"
    return repr(state)
