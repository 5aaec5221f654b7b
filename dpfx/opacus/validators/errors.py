"""Opacus's validation error, raised by ``ModuleValidator.validate(strict=True)`` and
``PrivacyEngine.make_private``. A ``ValueError``, as Opacus's is, and a ``dpfx.PrivacyError``."""
from dpfx.errors import PrivacyError


class UnsupportedModuleError(PrivacyError, ValueError):
    """One or more reasons (``dpfx.Problem`` messages) the module cannot train privately."""


__all__ = ["UnsupportedModuleError"]
