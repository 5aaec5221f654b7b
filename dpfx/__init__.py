"""dpfx: a compiler for differentially private training in PyTorch.

    import dpfx
    dp_model = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.1)
    loss = F.cross_entropy(dp_model(x), y)
    loss.backward()          # every trainable p.grad holds the DP-SGD gradient
"""
import warnings

from dpfx import audit, privacy
from dpfx.loop import data
from dpfx.privacy import ledger
from dpfx.ops import norms
from dpfx.api import DPModule, compile
from dpfx.config import FixedSeedWarning
from dpfx.engine import (PrivateTraining, load_checkpoint, make_private, make_private_with_epsilon,
                         save_checkpoint)
from dpfx.errors import (CaptureError, DPFXError, DPFXWarning, OptionError, OptionValueError,
                         PeerError, PrivacyError, UnsupportedOpError)
from dpfx.report.explain import Report, explain
from dpfx.loss.arranged import LossScaleWarning
from dpfx.loss.track import track_batch
from dpfx.lower.inductor import ComboKernelsWarning
from dpfx.capture.modules import replace_batchnorm
from dpfx.loop.data import VirtualBatches, expected_batch_size, poisson_loader, split_batch
from dpfx.loop.optim import DPOptimizer
from dpfx.loop.adambc import DPAdamBC
from dpfx.loop.fsdp import BlocksFallbackWarning
from dpfx.loop.optim import NoNoiseWarning
from dpfx.loop.checks import BatchSizeWarning, public
from dpfx.loss.gate import MissingZeroGradWarning, PlainGradientWarning
from dpfx.loop.users import per_user, user_loader
from dpfx.passes import Problem
from dpfx.options import Clipping
from dpfx.privacy.plan import Mechanism
from dpfx.report.validate import validate

__all__ = [
    "compile", "explain", "validate", "replace_batchnorm", "DPModule", "Report", "Problem",
    "DPFXError", "DPFXWarning", "PrivacyError", "UnsupportedOpError", "CaptureError", "PeerError", "DPOptimizer", "DPAdamBC",
    "OptionError", "OptionValueError", "VirtualBatches", "split_batch", "poisson_loader", "expected_batch_size",
    "per_user", "user_loader",
    "make_private", "make_private_with_epsilon",
    "PrivateTraining", "save_checkpoint", "load_checkpoint", "audit", "data", "ledger", "privacy",
    "norms", "FixedSeedWarning", "LossScaleWarning", "ComboKernelsWarning", "track_batch",
    "public", "PlainGradientWarning", "MissingZeroGradWarning", "NoNoiseWarning",
    "BatchSizeWarning", "Mechanism", "BlocksFallbackWarning", "Clipping",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``dpfx.stats``, the old name of ``dpfx.norms``, for this release only."""
    if name == "stats":
        warnings.warn("dpfx.stats is renamed dpfx.norms (the per-sample gradient norms: "
                      "NormStats, NonFiniteExampleWarning); the old name is accepted in this "
                      "release only", DeprecationWarning, stacklevel=2)
        return norms
    raise AttributeError(f"module 'dpfx' has no attribute {name!r}")
