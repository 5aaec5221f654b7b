"""The clipping option, declared once: ``dpfx.Clipping``, which every entry point takes as
``clipping=`` beside the bound ``max_grad_norm``.

    dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.1,
                 clipping=dpfx.Clipping("adaptive", target_unclipped_quantile=0.7,
                                        count_noise_multiplier=12.8))
    dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.1, clipping="automatic")

A name is shorthand for ``Clipping(name)``, as ``mechanism="bandmf"`` is for
``dpfx.Mechanism("bandmf")`` (privacy/plan.py). The loose keywords ``clipping_gamma=``,
``target_unclipped_quantile=``, ``clip_lr=`` and ``count_noise_multiplier=`` of
``dpfx.compile``, ``make_private`` and ``DPTrainer`` build the same object through
``clipping_option``, so the defaults below are the only ones. ``Clipping`` checks its own fields
when it is made; what depends on the bound or the noise (a dict of bounds is per-layer clipping;
the count's noise against sigma) it checks in ``resolved``, which ``DPConfig`` calls, before any
model is touched.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

from dpfx.errors import OptionError, OptionValueError
from dpfx.privacy import validate

# The clip functions (See Note [Clip functions] in config.py).
CLIPPING = ("flat", "per_layer", "automatic", "adaptive")
# Bu et al.'s stability constant gamma, the default of ``clipping_gamma``.
AUTOMATIC_GAMMA = 0.01
# The keywords of the entry points that build a Clipping (the private settings of a compiled
# model, api.py's _PRIVATE_SETTINGS).
# Keywords renamed, old -> new: each entry point that takes the new one (``renamed_keywords``)
# still takes the old one for one release, with a DeprecationWarning that names the new one.
RENAMED = {"target_quantile": "target_unclipped_quantile"}
KEYWORDS = ("clipping", "clipping_gamma", "target_unclipped_quantile", "clip_lr",
            "count_noise_multiplier", *RENAMED)


def renamed_keywords(fn):
    """``fn``, also taking the old names of its keywords in ``RENAMED``: each is passed on under
    its new name, with a DeprecationWarning at the caller's line."""
    @functools.wraps(fn)
    def taking_old_names(*args, **kwargs):
        for old, new in RENAMED.items():
            if old not in kwargs:
                continue
            if new in kwargs:
                raise OptionError(f"{old}= is the old name of {new}=: give {new}= alone")
            warnings.warn(f"{old}= is renamed {new}= (the name Opacus gives it); the old name is "
                          f"accepted in this release only", DeprecationWarning, stacklevel=2)
            kwargs[new] = kwargs.pop(old)
        return fn(*args, **kwargs)
    return taking_old_names


@dataclasses.dataclass(frozen=True)
class Clipping:
    """How each example's gradient is bounded by ``max_grad_norm`` (Note [Clip functions]).

    ``mode``: "flat", "per_layer", "automatic" or "adaptive"; None: "per_layer" for a dict of
    bounds, else "flat". ``gamma``: automatic clipping's C / (||g|| + gamma).
    ``target_unclipped_quantile``, ``clip_lr``, ``count_noise_multiplier``: adaptive clipping's
    quantile of the per-sample norms that the bound follows (the fraction of examples left
    unclipped), its geometric rate eta, and sigma_b, the std of the noise on the count of
    unclipped examples (required with noise, above sigma / 2; Note [Adaptive clipping] in
    privacy/adaptive.py). ``target_unclipped_quantile`` is also the keyword's name and that of
    the checkpoints' adaptive state (``AdaptiveClip.state_dict``)."""
    mode: str | None = None
    gamma: float = AUTOMATIC_GAMMA
    target_unclipped_quantile: float = 0.5
    clip_lr: float = 0.2
    count_noise_multiplier: float | None = None

    def __post_init__(self):
        if self.mode is not None and self.mode not in CLIPPING:
            raise OptionValueError(f"clipping must be one of {CLIPPING} (or a dpfx.Clipping), "
                                   f"got {self.mode!r}")
        if not (validate.finite_number(self.gamma) and self.gamma > 0):
            raise OptionValueError(f"clipping_gamma must be a finite number > 0 (automatic "
                                   f"clipping's C / (||g|| + gamma)), got {self.gamma!r}")
        if self.mode != "adaptive":
            if self.count_noise_multiplier is not None:
                raise OptionValueError("count_noise_multiplier is the noise on adaptive "
                                       "clipping's count of unclipped examples: pass "
                                       "clipping='adaptive' too")
            return
        quantile = self.target_unclipped_quantile
        if not (validate.finite_number(quantile) and 0 < quantile < 1):
            raise OptionValueError(f"target_unclipped_quantile must be a number in (0, 1) (the "
                                   f"fraction of examples left unclipped), got {quantile!r}")
        if not (validate.finite_number(self.clip_lr) and self.clip_lr > 0):
            raise OptionValueError(f"clip_lr must be a finite number > 0 (the geometric rate eta "
                                   f"of C <- C exp(-eta (b - target_unclipped_quantile))), got "
                                   f"{self.clip_lr!r}")
        sigma_b = self.count_noise_multiplier
        if sigma_b is not None and not (validate.finite_number(sigma_b) and sigma_b >= 0):
            raise OptionValueError(f"count_noise_multiplier must be a finite number >= 0, got "
                                   f"{sigma_b!r}")

    @property
    def adaptive(self) -> bool:
        return self.mode == "adaptive"

    def resolved(self, max_grad_norm, noise_multiplier) -> "Clipping":
        """This clipping for the bound ``max_grad_norm`` (a number, or per-layer (prefix, C)
        pairs) and the noise ``noise_multiplier``: the mode inferred, and sigma_b 0.0 where
        adaptive clipping runs without noise."""
        per_layer = isinstance(max_grad_norm, (dict, tuple))
        mode = self.mode or ("per_layer" if per_layer else "flat")
        if mode == "flat" and per_layer:
            raise OptionValueError("clipping='flat' takes one bound max_grad_norm=C; a dict of "
                                   "bounds by parameter-name prefix is clipping='per_layer'")
        if mode == "per_layer" and not per_layer:
            raise OptionValueError("clipping='per_layer' takes max_grad_norm as a dict "
                                   "{parameter-name prefix: C} (\"\" matches every parameter)")
        if mode != "adaptive":
            return dataclasses.replace(self, mode=mode)
        if per_layer:
            raise OptionValueError(
                "clipping='adaptive' adapts one flat bound: pass max_grad_norm=C (its initial "
                "value C_0); per-layer adaptive bounds are not supported (use "
                "clipping='per_layer' with fixed bounds)")
        sigma, sigma_b = noise_multiplier, self.count_noise_multiplier
        noisy = validate.finite_number(sigma) and sigma > 0
        if sigma_b is None:
            if noisy:
                raise OptionValueError(
                    "clipping='adaptive' needs count_noise_multiplier=sigma_b, the std of the "
                    "noise on the count of unclipped examples (Andrew et al. 2021 suggest "
                    "expected_batch_size / 20); the gradient's noise multiplier is then raised "
                    "so that both releases together cost what noise_multiplier does")
            return dataclasses.replace(self, count_noise_multiplier=0.0)
        if noisy and not sigma_b > sigma / 2:
            raise OptionValueError(
                f"count_noise_multiplier={sigma_b} must exceed noise_multiplier / 2 = "
                f"{sigma / 2}: the count's release (sensitivity 1/2, std sigma_b) and the "
                f"gradient's compose to sigma only if sigma_grad = (sigma^-2 - (2 sigma_b)^-2)"
                f"^(-1/2) is finite. Raise count_noise_multiplier (Andrew et al. 2021 suggest "
                f"expected_batch_size / 20)")
        return self


Clipping.__init__ = renamed_keywords(Clipping.__init__)


def clipping_option(clipping=None, *, clipping_gamma=None, target_unclipped_quantile=None,
                    clip_lr=None, count_noise_multiplier=None) -> Clipping:
    """``clipping=`` and its loose keywords as every entry point takes them: None, a name or a
    ``Clipping``; a keyword left None takes ``Clipping``'s default. A ``Clipping`` carries its
    own options, so it comes with none of the keywords."""
    given = {name: value for name, value in (
        ("gamma", clipping_gamma), ("target_unclipped_quantile", target_unclipped_quantile),
        ("clip_lr", clip_lr), ("count_noise_multiplier", count_noise_multiplier))
        if value is not None}
    if isinstance(clipping, Clipping):
        if given:
            keywords = sorted("clipping_gamma" if k == "gamma" else k for k in given)
            raise OptionError(f"clipping=dpfx.Clipping(...) holds its own options: give "
                              f"{', '.join(keywords)} in it, not beside it")
        return clipping
    if clipping is not None and not isinstance(clipping, str):
        raise OptionError(f"clipping must be a name {CLIPPING} or a dpfx.Clipping, got "
                          f"{type(clipping).__name__}")
    return Clipping(clipping, **given)
