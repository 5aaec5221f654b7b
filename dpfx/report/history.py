"""A run's privacy and clipping over its steps, recorded once a step and drawn as one figure.

    history = dpfx.report.RunHistory(private.model, private.accountant, delta=1e-5)
    for x, y in private.loader:
        ...; private.optimizer.step()
        history.record()                 # after each optimizer step
    history.plot("run.png")              # epsilon, clipped fraction, bound against the step

``record()`` reads what the run already keeps, and computes nothing costly:

- the accountant's phases (noise multiplier, sample rate, steps), from which epsilon at
  ``delta`` is composed when asked for (``epsilon()``, ``plot``): one PLD composition costs
  about 0.4 s, so ``plot`` evaluates it at no more than ``points`` of the recorded steps, evenly
  spread, the last included;
- with ``track_norms=True``, the share of the examples of the backward passes since the last
  ``record()`` (a whole logical batch under virtual batches) that ``norm_stats`` counted as
  clipped, from its running counts;
- under ``clipping="adaptive"``, ``adaptive_clip.bound`` after the step: the bound the next
  step clips to.

A series the run does not keep (no ``track_norms``, a fixed bound) is left out of the figure
rather than drawn empty.

# Note [The clipped fraction is not private]
The per-sample norms behind the clipped fraction come from the raw examples (Note [These numbers
are not private] in ops/norms.py). The figure marks that panel "not private": epsilon and an
adaptive bound (computed from noised releases only) may be published, the clipped fraction may
not without a budget of its own. (tests/report/test_history.py)
"""
from __future__ import annotations

import copy

import math

from dpfx.privacy import Accountant

NOT_PRIVATE = "clipped fraction (not private)"


class RunHistory:
    """The steps of one run, as ``record()`` saw them (module docstring). ``model``: the
    ``dpfx.compile``'d module (``make_private``'s ``.model``); ``accountant``: the
    ``dpfx.privacy.Accountant`` counting its steps; ``delta``: the delta epsilon is reported at."""

    def __init__(self, model, accountant: Accountant, *, delta: float):
        self.model, self.accountant, self.delta = model, accountant, float(delta)
        self.steps: list[int] = []
        self._accounts: list[dict] = []              # the accountant's state after each step
        self.clipped_fraction: list[float] = []
        self.bound: list[float] = []
        stats = model.norm_stats
        self._seen = (stats.examples, stats.clipped) if stats is not None else None

    def record(self) -> None:
        """Take the step just finished: call once after each optimizer step."""
        self.steps.append(self.accountant.steps)
        self._accounts.append(self.accountant.state_dict())
        stats = self.model.norm_stats
        if stats is not None:
            examples, clipped = stats.examples - self._seen[0], stats.clipped - self._seen[1]
            self.clipped_fraction.append(clipped / examples if examples else math.nan)
            self._seen = (stats.examples, stats.clipped)
        clip = self.model.adaptive_clip
        if clip is not None:
            self.bound.append(clip.bound)

    def epsilon(self, points: int | None = None) -> tuple[list[int], list[float]]:
        """(steps, epsilon at ``delta`` after each), at every recorded step, or at ``points`` of
        them evenly spread (the first and the last included)."""
        chosen = _spread(len(self.steps), points)
        values = []
        for i in chosen:
            accountant = copy.copy(self.accountant)     # its kind: a MatrixAccountant too
            accountant.load_state_dict(self._accounts[i])
            values.append(accountant.get_epsilon(self.delta))
        return [self.steps[i] for i in chosen], values

    def series(self, points: int = 50) -> dict[str, tuple[list[int], list[float]]]:
        """Each series the run keeps, by the title ``plot`` gives its panel: (steps, values)."""
        out = {f"epsilon (delta={self.delta:g})": self.epsilon(points)}
        if self.clipped_fraction:
            out[NOT_PRIVATE] = (list(self.steps), list(self.clipped_fraction))
        if self.bound:
            out["adaptive clipping bound C"] = (list(self.steps), list(self.bound))
        return out

    def plot(self, path: str, points: int = 50) -> dict[str, tuple[list[float], list[float]]]:
        """Writes a PNG with one panel per series against the optimizer step; returns what each
        panel drew, by its title, as read back from the figure."""
        if not self.steps:
            raise ValueError("RunHistory.plot: nothing recorded; call record() after each "
                             "optimizer step")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        series = self.series(points)
        fig, axes = plt.subplots(len(series), 1, sharex=True, squeeze=False,
                                 figsize=(6.4, 2.2 * len(series) + 0.6))
        drawn = {}
        for ax, (title, (xs, ys)) in zip(axes[:, 0], series.items()):
            (line,) = ax.plot(xs, ys, marker="." if len(xs) <= 60 else None,
                              color="#c04040" if title == NOT_PRIVATE else "#3060a0")
            ax.set_title(title, fontsize=10)
            if title == NOT_PRIVATE:
                ax.set_ylim(-0.03, 1.03)
            ax.grid(alpha=0.3)
            drawn[title] = ([float(x) for x in line.get_xdata()],
                            [float(y) for y in line.get_ydata()])
        axes[-1, 0].set_xlabel("optimizer step")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return drawn


def _spread(n: int, points: int | None) -> list[int]:
    """Indices of ``points`` of ``n`` items evenly spread, the first and the last included."""
    if points is None or n <= points:
        return list(range(n))
    if points < 2:
        return [n - 1]
    return sorted({round(i * (n - 1) / (points - 1)) for i in range(points)})
