"""dpfx: a compiler for differentially private training in PyTorch.

    import dpfx
    dp_model = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.1)
    loss = F.cross_entropy(dp_model(x), y)
    loss.backward()          # every trainable p.grad holds the DP-SGD gradient
"""
from . import audit, data, ledger, privacy, stats
from .api import DPModule, compile
from .config import FixedSeedWarning
from .engine import (PrivateTraining, load_checkpoint, make_private, make_private_with_epsilon,
                     save_checkpoint)
from .errors import (CaptureError, DPFXError, OptionError, PeerError, PrivacyError,
                     UnsupportedOpError)
from .explain import Report, explain
from .loss_track import LossScaleWarning, track_batch
from .lowering import ComboKernelsWarning
from .modules import replace_batchnorm
from .data import VirtualBatches, split_batch
from .optim import DPOptimizer
from .passes import Problem
from .validate import validate

__all__ = [
    "compile", "explain", "validate", "replace_batchnorm", "DPModule", "Report", "Problem",
    "DPFXError", "PrivacyError", "UnsupportedOpError", "CaptureError", "PeerError", "DPOptimizer",
    "OptionError",
    "VirtualBatches", "split_batch", "make_private", "make_private_with_epsilon",
    "PrivateTraining", "save_checkpoint", "load_checkpoint", "audit", "data", "ledger", "privacy",
    "stats", "FixedSeedWarning", "LossScaleWarning", "ComboKernelsWarning", "track_batch",
]
__version__ = "0.1.0"
