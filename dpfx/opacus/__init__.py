"""Opacus 1.6's surface over dpfx: an Opacus script switches by its imports.

    from dpfx.opacus import PrivacyEngine                      # was: from opacus import ...
    from dpfx.opacus.utils.batch_memory_manager import BatchMemoryManager
    from dpfx.opacus.validators import ModuleValidator

``PrivacyEngine.make_private`` returns what Opacus returns, built by ``dpfx.make_private``: the
compiled model, a ``dpfx.DPOptimizer`` and dpfx's Poisson loader. What carries over, what maps
and what is refused: docs/opacus.md.
"""
from dpfx.opacus.privacy_engine import PrivacyEngine

__all__ = ["PrivacyEngine"]
