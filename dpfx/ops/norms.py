"""Per-sample gradient norms seen by the compiled backward, for users tuning the clipping bound C.

With ``dpfx.compile(..., track_norms=True)`` the backward graph passes each clipping group's
per-sample norms (f32[B]) through ``dpfx::observe_norms``, an opaque custom op that hands a copy to
the model's ``NormStats`` and returns its input unchanged. Inductor calls it as a fallback kernel;
it costs one copy of B floats per group and a Python call per step.

    dp_model = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.1, track_norms=True)
    ...; loss.backward()
    dp_model.norm_stats.clipped_fraction      # share of the last step's examples with norm > C
    dp_model.norm_stats.quantiles([0.5, 0.9]) # over the recent window

# Note [These numbers are not private]
The per-sample norms are computed from the raw examples and nothing here adds noise: a norm, a
quantile or a clipped fraction logged or published from a private run leaks about the examples it
came from. Use them to choose C on public or proxy data, or budget for their release yourself.
"""
from __future__ import annotations

import collections
import itertools
import warnings
import weakref

import torch

from dpfx.errors import DPFXWarning

_SINKS: dict[int, "weakref.ref[NormStats]"] = {}
_NEXT = itertools.count()


class NonFiniteExampleWarning(DPFXWarning):
    """Some examples had a non-finite per-sample gradient norm and contributed nothing."""


_NON_FINITE = ("dpfx: {n} example(s) in this batch had a non-finite per-sample gradient norm "
               "(a NaN or inf input feature, or an overflowing fp16 gradient). Each contributed "
               "zero to the private gradient (clip factor 0), so the release stays finite and "
               "its sensitivity C, but those examples were not learned from: check the data. "
               "Reported once per model; count: norm_stats.non_finite.")


# Note [Non-finite examples are reported, not raised]
# Raising would make a NaN in one example stop training, a signal an adversary who plants it can
# observe; the graph already drops the example (Note [Non-finite examples contribute zero] in
# rules/registry.py), so dpfx only tells the user, once, and counts. Both ride on track_norms:
# an observer in every graph cost 1.04x of an MLP step (the opaque call, measured interleaved
# against the same graph without it), while the selects themselves cost nothing measurable.
@torch.library.custom_op("dpfx::observe_norms", mutates_args=())
def observe_norms(norms: torch.Tensor, sink: int) -> torch.Tensor:
    """``norms``: f32[G, B], one row per clipping group."""
    ref = _SINKS.get(sink)
    stats = ref() if ref is not None else None
    if stats is not None:
        stats._record(norms.detach().clone())
    return norms.clone()


@observe_norms.register_fake
def _observe_norms_fake(norms, sink):
    return torch.empty_like(norms)


_SHOWN = (0.1, 0.5, 0.9, 0.99)    # the quantiles the repr shows


def _pct(fraction: float) -> str:
    return "n/a" if fraction != fraction else f"{100 * fraction:.1f}%"


class NormStats:
    """The per-sample gradient norms of recent backward passes, by clipping group.

    ``bounds`` maps group key to C, in the order of the rows the graph reports; flat clipping is
    one group, key "".
    Keeps the last ``window`` backward passes.
    """

    def __init__(self, bounds: dict[str, float], window: int = 100):
        self._bounds = dict(bounds)
        self._live = None           # adaptive clipping: reads C_t (``follow``)
        self._keys = list(self._bounds)
        self.window = window
        self._recent: dict[str, collections.deque] = {
            k: collections.deque(maxlen=window) for k in self._keys}
        self.examples = 0
        self.clipped = 0
        self.non_finite = 0   # examples dropped for a non-finite norm, over every pass seen
        self.sink = next(_NEXT)
        _SINKS[self.sink] = weakref.ref(self)
        # a padded batch's real examples while its backward runs (Note [Padded rows contribute
        # zero] in passes/clip_noise.py): the rows after them are not examples
        self.rows: int | None = None

    @property
    def bounds(self) -> dict[str, float]:
        """Group key -> the C its examples are clipped to now: under adaptive clipping C_t, the
        bound the next backward clips to, not the initial one."""
        return {"": float(self._live())} if self._live is not None else dict(self._bounds)

    def follow(self, bound) -> None:
        """Adaptive clipping (one group): ``bound()`` is C_t, read at each pass, so a pass's
        clipped share is against the bound that pass clipped to."""
        self._live = bound

    def set_groups(self, keys: list[str]) -> None:
        """The groups the compiled graph reports, in its row order."""
        self._keys = list(keys)

    def _record(self, norms: torch.Tensor) -> None:
        if self.rows is not None:
            norms = norms[:, :self.rows]
        clipped = torch.zeros(norms.shape[1:], dtype=torch.bool, device=norms.device)
        bounds = self.bounds
        for key, row in zip(self._keys, norms):
            self._recent[key].append(row)
            clipped |= row > bounds[key]
        bad = int((~torch.isfinite(norms)).any(0).sum())
        if bad and not self.non_finite:
            warnings.warn(_NON_FINITE.format(n=bad), NonFiniteExampleWarning, stacklevel=3)
        self.non_finite += bad
        self.examples += clipped.numel()
        self.clipped += int(clipped.sum())
        self._last_clipped = clipped

    @property
    def last(self) -> dict[str, torch.Tensor]:
        """Group key -> the per-sample norms of the last backward pass (f32[B])."""
        return {k: d[-1] for k, d in self._recent.items() if d}

    @property
    def clipped_fraction(self) -> float:
        """Share of the last backward's examples that were clipped in at least one group (nan if
        it was empty or nothing ran yet)."""
        clipped = getattr(self, "_last_clipped", None)
        if clipped is None or clipped.numel() == 0:
            return float("nan")
        return float(clipped.float().mean())

    @property
    def total_clipped_fraction(self) -> float:
        """Share of every example seen so far that was clipped."""
        return self.clipped / self.examples if self.examples else float("nan")

    def quantiles(self, qs, group: str | None = None) -> torch.Tensor:
        """Quantiles of the finite per-sample norms over the recent window."""
        key = self._keys[0] if group is None else group
        seen = [n.float().cpu() for n in self._recent[key]]
        allnorms = torch.cat(seen) if seen else torch.empty(0)
        allnorms = allnorms[torch.isfinite(allnorms)]   # dropped examples (non_finite) aside
        if allnorms.numel() == 0:
            return torch.full((len(qs),), float("nan"))
        return torch.quantile(allnorms, torch.tensor(list(qs), dtype=torch.float32))

    def __repr__(self) -> str:
        """What a user tuning C reads first: passes and examples seen, the clipped fractions
        and, per group, its bound and the recent norms' quantiles."""
        passes = max((len(d) for d in self._recent.values()), default=0)
        head = (f"NormStats(passes={passes} (window {self.window}), examples={self.examples}, "
                f"clipped: last={_pct(self.clipped_fraction)} "
                f"total={_pct(self.total_clipped_fraction)}")
        if self.non_finite:
            head += f", non_finite={self.non_finite}"
        rows = []
        for key in self._keys:
            name = repr(key) if key else "'' (every parameter)" if len(self._keys) == 1 \
                else "'' (the other parameters)"
            q = self.quantiles(_SHOWN, key).tolist()
            norms = "none yet" if q[0] != q[0] else " ".join(
                f"p{round(p * 100)}={v:.4g}" for p, v in zip(_SHOWN, q))
            rows.append(f"\n  group {name}: C={self.bounds[key]:.4g}, norms {norms}")
        return head + "".join(rows) + ")"

    def reset(self) -> None:
        for d in self._recent.values():
            d.clear()
        self.examples = self.clipped = self.non_finite = 0
        self._last_clipped = None
