"""``opacus.validators`` over dpfx's module checks (``dpfx.validate``, ``dpfx.replace_batchnorm``)."""
from dpfx.opacus.validators.errors import UnsupportedModuleError
from dpfx.opacus.validators.module_validator import ModuleValidator

__all__ = ["ModuleValidator", "UnsupportedModuleError"]
