"""``dpfx.validate``: every reason a model cannot be trained privately, listed at once.

    for problem in dpfx.validate(model, x):
        print(problem)       # [privacy] module 'bn' (BatchNorm1d) is in training mode ... GroupNorm
                             # [unsupported] parameter 'w': weight-gradient op ... hint

``dpfx.compile`` raises on the first problem; ``validate`` captures the model the same way
(backend="eager", nothing runs, ``p.grad`` untouched) and collects them all: module checks
(BatchNorm in training, the rest inspected on a copy where it is GroupNorm), forward ops that mix examples, and parameters no rule covers.
"""
from __future__ import annotations

import copy

import torch

from dpfx.api import compile as dp_compile
from dpfx.errors import CaptureError, DPFXError
from dpfx.capture.modules import module_problems, without_batch_mixing
from dpfx.passes import Problem


def validate(model: torch.nn.Module, *example_inputs, **kwargs) -> list[Problem]:
    problems = [Problem("privacy", m) for m in module_problems(model)]
    if problems:
        # torch cannot trace BatchNorm with a symbolic batch at all; inspect the rest of the
        # model on a copy with the (already reported) BatchNorms swapped for GroupNorm.
        model = without_batch_mixing(copy.deepcopy(model))
    dp = dp_compile(model, max_grad_norm=1.0, noise_multiplier=1.0, backend="eager")
    dp._dpfx_backend.problems = problems
    inputs = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in example_inputs]
    try:
        with torch.enable_grad():
            dp(*inputs, **kwargs)
    except CaptureError as e:
        problems.append(Problem("capture", str(e)))
    except DPFXError as e:
        problems.append(Problem("privacy", str(e)))
    except RuntimeError as e:
        if "dpfx.validate" not in str(e):
            raise
    return problems
