"""The errors dpfx raises. Each one names the parameter or module, the ATen op and a fix.

A privacy compiler must never fall back to non-private gradients; these errors are how it refuses.
"""


class DPFXError(Exception):
    """Base class of every dpfx error."""


class PrivacyError(DPFXError):
    """The model or a rewritten graph would break DP-SGD's guarantee.

    Raised for forward ops that mix examples (BatchNorm in training mode, reductions over the
    batch dim, ...) and when the verifier cannot prove that every trainable parameter's gradient
    passes through per-sample clipping and noise.
    """


class UnsupportedOpError(DPFXError):
    """No rule can make a parameter's weight gradient per-sample."""


class OptionError(DPFXError, TypeError):
    """An option of an entry point (``dpfx.compile``, ``make_private``, ``DPTrainer``,
    ``DPOptimizer``, ``dpfx.opacus``) has a type it cannot take (``loss=3``): refused at the call,
    before the model is touched, rather than at the first step. The base of every option
    mistake."""


class OptionValueError(OptionError, ValueError):
    """An option has a value outside what it can take (``max_grad_norm=-1``,
    ``noise_multiplier=float("nan")``, ``target_unclipped_quantile=2``): refused at the call,
    before the model is touched, with the same type whichever entry point is given it (the validators of
    privacy/validate.py and ``dpfx.Clipping`` raise it). A ``ValueError``, and an
    ``OptionError`` as every option mistake is."""


class CaptureError(DPFXError):
    """The model could not be captured as one graph (a graph break, an unsupported input)."""


class DPFXWarning(UserWarning):
    """Base class of every warning dpfx gives: something trains, but not as the user may think
    (a fixed seed, a fallback rule, a changed loss scale, an unaccounted loop). The test suite
    turns an unexpected one into a failure (pyproject.toml)."""


class PeerError(DPFXError, RuntimeError):
    """A collective of the private step failed: a peer rank died, or stayed silent past the
    process group's timeout. The rank that raises took no step."""
