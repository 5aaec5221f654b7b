"""Opacus's ``ModuleValidator`` over dpfx's module checks.

    model = ModuleValidator.fix(model)             # a copy: BatchNorm -> GroupNorm
    ModuleValidator.validate(model, strict=True)   # raises UnsupportedModuleError, else []
    ModuleValidator.validate(model, x)             # dpfx extension: with an example input, the
                                                   # model is captured and every op checked

Without inputs ``validate`` checks what can be seen on the modules (normalization layers that
mix the batch), as Opacus's does. Opacus's other fixes (LSTM -> DPLSTM, MultiheadAttention ->
DPMultiheadAttention) have no dpfx counterpart because none is needed: dpfx trains the torch
modules themselves. dpfx's fixer picks the largest divisor of the channel count up to 32 for
GroupNorm's groups, where Opacus takes gcd(32, channels): they agree for channel counts that are
multiples of 32 or powers of two.
"""
from __future__ import annotations

import copy

from torch import nn

from dpfx.capture.modules import module_problems, without_batch_mixing
from dpfx.opacus.validators.errors import UnsupportedModuleError
from dpfx.report.validate import validate as dp_validate


class ModuleValidator:
    @classmethod
    def validate(cls, module: nn.Module, *example_inputs, strict: bool = False,
                 **example_kwargs) -> list[UnsupportedModuleError]:
        if example_inputs or example_kwargs:
            problems = [str(p) for p in dp_validate(module, *example_inputs, **example_kwargs)]
        else:
            problems = [f"[privacy] {m}" for m in module_problems(module)]
        errors = [UnsupportedModuleError(p) for p in problems]
        if strict and errors:
            raise UnsupportedModuleError("\n".join(problems))
        return errors

    @classmethod
    def is_valid(cls, module: nn.Module, *example_inputs, **example_kwargs) -> bool:
        return not cls.validate(module, *example_inputs, **example_kwargs)

    @classmethod
    def fix(cls, module: nn.Module, **kwargs) -> nn.Module:
        """A copy of ``module`` with BatchNorm replaced by GroupNorm and InstanceNorm's
        running statistics off (``dpfx.replace_batchnorm``); the module given is untouched."""
        if kwargs:
            raise TypeError(f"ModuleValidator.fix takes no options in dpfx, got {sorted(kwargs)}")
        return without_batch_mixing(copy.deepcopy(module))

    @classmethod
    def fix_and_validate(cls, module: nn.Module, **kwargs) -> nn.Module:
        fixed = cls.fix(module, **kwargs)
        cls.validate(fixed, strict=True)
        return fixed


__all__ = ["ModuleValidator"]
