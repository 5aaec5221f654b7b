"""Options of one `dpfx.compile` call, validated once so that the passes can trust them."""
from __future__ import annotations

import dataclasses
import math
import warnings

from dpfx.errors import OptionError, OptionValueError, PrivacyError, DPFXWarning
from dpfx.options import Clipping
from dpfx.privacy import validate

LOSS_REDUCTIONS = ("mean", "sum")
BACKENDS = ("inductor", "eager")
STRATEGIES = ("auto", "materialize", "ghost")
NOISE_MODES = ("graph", "optimizer")
# Note [Clip functions]
# "flat" and "per_layer" clip to min(1, C / (||g|| + CLIP_EPS)) (one group,
# or one per name prefix); "automatic" scales every example by C / (||g|| + gamma) (Bu et al.
# 2022, "Automatic clipping"), which never exceeds C either: ||g|| C / (||g|| + gamma) < C;
# "adaptive" clips as "flat" to a bound C_t that the graph reads as an input at every step and
# that follows a target quantile of the per-sample norms (Andrew et al. 2021; Note [Adaptive
# clipping] in privacy/adaptive.py).
# (the names: options.CLIPPING; the options: dpfx.Clipping in options.py)

# Added to the per-sample norm before dividing, as Opacus does, so that results compare number for
# number: clip_factor = min(1, C / (||g|| + CLIP_EPS)).
CLIP_EPS = 1e-6


def _read_clip(field: str) -> property:
    return property(lambda self: getattr(self.clip, field),
                    doc=f"``clip.{field}`` (``dpfx.Clipping``, options.py)")


@dataclasses.dataclass(frozen=True)
class DPConfig:
    """``max_grad_norm`` is one bound C (flat clipping: one norm over all parameters) or, for
    per-layer clipping, a tuple of (parameter-name prefix, C) pairs: every trainable parameter
    belongs to the group of its longest matching prefix, each group is clipped to its own C, and
    the noise std is sigma * sqrt(sum of C^2) (the sensitivity of the whole clipped gradient).
    ``noise="optimizer"`` leaves the noise and the divide by D to ``dpfx.DPOptimizer``."""
    max_grad_norm: float | tuple
    noise_multiplier: float
    loss_reduction: str = "mean"
    expected_batch_size: int | None = None
    seed: int | None = None
    backend: str = "inductor"
    strategy: str = "auto"
    noise: str = "graph"
    track_norms: bool = False
    self_check: bool | str = True
    allow_input_grads: bool = False
    # the clip function and its options (options.py), resolved for max_grad_norm and sigma
    clip: Clipping = Clipping()
    # Note [Padded rows contribute zero] in passes/clip_noise.py: batch sizes the inputs are
    # padded up to (one compiled shape per bucket), increasing; None: the batch as it comes
    batch_buckets: tuple[int, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.clip, Clipping):
            raise OptionError(f"DPConfig.clip must be a dpfx.Clipping, got "
                              f"{type(self.clip).__name__}")
        object.__setattr__(self, "clip", self.clip.resolved(self.max_grad_norm,
                                                            self.noise_multiplier))
        self._check_buckets()
        if isinstance(self.max_grad_norm, dict):
            object.__setattr__(self, "max_grad_norm", tuple(self.max_grad_norm.items()))
        bounds = (self.max_grad_norm if isinstance(self.max_grad_norm, tuple)
                  else (("", self.max_grad_norm),))
        if not bounds:
            raise OptionValueError("max_grad_norm: a per-layer dict needs at least one entry")
        for entry in bounds:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise OptionValueError(f"max_grad_norm: one bound C, or per-layer (name prefix, "
                                       f"C) pairs (a dict), got the entry {entry!r}")
            key, c = entry
            if not isinstance(key, str):
                raise OptionValueError(f"max_grad_norm: per-layer keys are parameter-name "
                                       f"prefixes (str), got {key!r}")
            validate.bound(c, f"max_grad_norm[{key!r}]" if key else "max_grad_norm")
        validate.noise_multiplier(self.noise_multiplier)
        validate.choice(self.loss_reduction, LOSS_REDUCTIONS, "loss_reduction")
        if self.expected_batch_size is not None:
            validate.integer(self.expected_batch_size, "expected_batch_size (or None)", 1)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise OptionValueError(f"seed must be an int or None, got {self.seed!r}")
        validate.choice(self.strategy, STRATEGIES, "strategy")
        validate.choice(self.backend, BACKENDS, "backend")
        validate.choice(self.noise, NOISE_MODES, "noise")
        for flag in ("track_norms", "allow_input_grads"):
            if not isinstance(getattr(self, flag), bool):
                raise OptionValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if not isinstance(self.self_check, bool) and self.self_check != "always":
            raise OptionValueError(f"self_check must be True, False or 'always', got "
                                   f"{self.self_check!r}")

    def _check_buckets(self) -> None:
        buckets = self.batch_buckets
        if buckets is None:
            return
        if isinstance(buckets, (list, tuple)):
            buckets = tuple(buckets)
        ok = isinstance(buckets, tuple) and buckets and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in buckets) \
            and all(a < b for a, b in zip(buckets, buckets[1:]))
        if not ok:
            raise OptionValueError(f"batch_buckets must be a non-empty sequence of increasing "
                                   f"positive ints (the batch sizes a batch is padded up to, such "
                                   f"as (64, 128, 256)), or None; got {self.batch_buckets!r}")
        object.__setattr__(self, "batch_buckets", buckets)

    def bucket_for(self, batch: int) -> int:
        """The smallest bucket that holds ``batch`` rows (Note [Padded rows contribute zero]
        in passes/clip_noise.py); ``batch`` itself without buckets or for an empty batch."""
        if self.batch_buckets is None or batch == 0:
            return batch
        for bucket in self.batch_buckets:
            if batch <= bucket:
                return bucket
        raise ValueError(
            f"batch size {batch} exceeds the largest of batch_buckets={self.batch_buckets}: "
            f"dpfx pads each batch up to a bucket and never drops examples. Add a bucket of at "
            f"least {batch} to dpfx.compile(..., batch_buckets=...) (Poisson sampling's batch "
            f"size exceeds its expected size q*N by a few standard deviations sqrt(q*N) at most "
            f"in practice), or sample smaller batches.")

    # The clip function's options by their keywords, as the graph, the passes and the optimizer
    # read them ("clipping" is the resolved mode).
    clipping = _read_clip("mode")
    clipping_gamma = _read_clip("gamma")
    target_unclipped_quantile = _read_clip("target_unclipped_quantile")
    clip_lr = _read_clip("clip_lr")
    count_noise_multiplier = _read_clip("count_noise_multiplier")

    @property
    def adaptive(self) -> bool:
        return self.clip.adaptive

    @property
    def grad_noise_multiplier(self) -> float:
        """The noise multiplier of the gradient's release: sigma, or under adaptive clipping
        sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2), so that the gradient (sensitivity C,
        std sigma_grad C) and the count (sensitivity 1/2, std sigma_b) compose to one Gaussian
        mechanism of multiplier sigma (Andrew et al. 2021, Theorem 1)."""
        sigma = float(self.noise_multiplier)
        if not self.adaptive or sigma == 0:
            return sigma
        return (sigma ** -2 - (2 * float(self.count_noise_multiplier)) ** -2) ** -0.5

    @property
    def per_layer(self) -> bool:
        return isinstance(self.max_grad_norm, tuple)

    @property
    def clip_eps(self) -> float:
        """What the clip factor adds to the per-sample norm before dividing (Note [Clip
        functions])."""
        return float(self.clipping_gamma) if self.clipping == "automatic" else CLIP_EPS

    @property
    def clip_bounds(self) -> dict[str, float]:
        """Group key -> C; flat clipping is the one group ``""``."""
        if self.per_layer:
            return {k: float(c) for k, c in self.max_grad_norm}
        return {"": float(self.max_grad_norm)}

    def group_of(self, param: str) -> str:
        """The clipping group of a parameter: its longest matching name prefix (a prefix matches
        the whole name or a dotted module path: "fc1" matches "fc1.weight", not "fc10.bias")."""
        best = None
        for key in self.clip_bounds:
            if key == "" or param == key or param.startswith(key + "."):
                if best is None or len(key) > len(best):
                    best = key
        if best is None:
            raise OptionValueError(f"max_grad_norm: parameter '{param}' matches no per-layer "
                                   f"key (keys: {sorted(self.clip_bounds)}); add its name or a "
                                   f"prefix")
        return best

    def check_params(self, names: list[str]) -> None:
        """Every parameter in a group, every group used: a typo in a key is an error."""
        used = {self.group_of(n) for n in names}
        unused = sorted(set(self.clip_bounds) - used)
        if unused:
            raise OptionValueError(f"max_grad_norm: the per-layer keys {unused} match no "
                                   f"trainable parameter (parameters: {names})")

    @property
    def sensitivity(self) -> float:
        """The L2 bound of one example's whole clipped gradient: C, or sqrt(sum C_g^2)."""
        return math.sqrt(sum(c * c for c in self.clip_bounds.values()))

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise added to the clipped sum, before dividing by D. Under
        adaptive clipping it changes every step (``grad_noise_multiplier`` times the step's
        bound): the graph and the optimizer read the bound, never this."""
        if self.adaptive:
            raise PrivacyError("under clipping='adaptive' the noise std is "
                               "grad_noise_multiplier * C_t, with C_t the step's bound")
        return self.noise_multiplier * self.sensitivity


def check_loss(loss) -> None:
    """``loss=`` is a function ``fn(output, *targets)``, an ``nn.Module`` loss instance, or
    None: anything else would only fail at the first ``dp_model.loss(...)``, as a capture
    error about the model.
    (tests/loss/test_loss_graph.py::test_a_loss_that_is_not_a_function_is_refused_at_compile)"""
    if loss is None:
        return
    if isinstance(loss, type):
        raise OptionError(f"dpfx.compile(loss=...) takes a loss function fn(output, *targets), "
                          f"got the class {loss.__name__}: pass an instance "
                          f"(loss={loss.__name__}()) or a function")
    if not callable(loss):
        raise OptionError(f"dpfx.compile(loss=...) takes a loss function fn(output, *targets) "
                          f"(such as F.cross_entropy or nn.CrossEntropyLoss()), got "
                          f"{type(loss).__name__} {_shown(loss)}")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse_change(self, name: str, value) -> None:
    raise PrivacyError(
        f"DPConfig.{name} cannot change after dpfx.compile: the compiled graphs clip and noise "
        f"with the values they were built with, and the optimizer and the accountant read them "
        f"too. Call dpfx.compile(model, {name}=...) again (and build a new DPOptimizer).")


# The frozen dataclass's own refusal (FrozenInstanceError: "cannot assign to field") does not
# say why or what to do instead.
DPConfig.__setattr__ = _refuse_change
DPConfig.__delattr__ = lambda self, name: _refuse_change(self, name, None)


class FixedSeedWarning(DPFXWarning):
    """A fixed ``seed=``: every run (and every model compiled with it) draws the same noise."""


def warn_fixed_seed(seed: int | None) -> None:
    if seed is not None:
        warnings.warn(FixedSeedWarning(
            f"seed={seed} fixes the noise: every run, and every model compiled with the same "
            f"seed, draws the same noise, so two releases made with it can be subtracted from "
            f"each other. Use it for tests and reproductions only; leave seed=None for training "
            f"(noise seeded from the OS's CSPRNG)."), stacklevel=3)
