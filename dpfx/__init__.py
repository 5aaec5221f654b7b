"""dpfx: a compiler for differentially private training in PyTorch.

    import dpfx
    dp_model = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.1)
    loss = F.cross_entropy(dp_model(x), y)
    loss.backward()          # every trainable p.grad holds the DP-SGD gradient
"""
from .api import DPModule, compile
from .errors import CaptureError, DPFXError, PrivacyError, UnsupportedOpError
from .explain import Report, explain
from .modules import replace_batchnorm
from .passes import Problem
from .validate import validate

__all__ = [
    "compile", "explain", "validate", "replace_batchnorm", "DPModule", "Report", "Problem",
    "DPFXError", "PrivacyError", "UnsupportedOpError", "CaptureError",
]
__version__ = "0.1.0"
