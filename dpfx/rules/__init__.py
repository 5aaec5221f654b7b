"""The rule registry (``registry``) and the rules, one module per op family: ``linear``,
``embedding``, ``convolution``, ``reduction``, ``lift``, and the vmap ``fallback``.

Importing the package registers every rule; the registry's names are read through it
(``rules.find``, ``rules.Rule``, ``rules.FRONTIER``, ...).
"""
from dpfx.rules.registry import (FRONTIER, LIFT, NOMINAL_SIZE, Clip, Ghost, LiftRule, Rows, Rule,
                                 at_least_float32, at_nominal, find, frontier_key, gram, register,
                                 register_lift)
from dpfx.rules import block, convolution, embedding, linear, lift, reduction  # noqa: F401  (registration)

__all__ = ["FRONTIER", "LIFT", "NOMINAL_SIZE", "Clip", "Ghost", "LiftRule", "Rows", "Rule",
           "at_least_float32", "at_nominal", "find", "frontier_key", "gram", "register",
           "register_lift"]
