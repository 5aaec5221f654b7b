"""Golden graphs: the normalized forward and rewritten backward graphs of canonical models.

Regenerate (from a clean tree, then read the diff line by line) with:

    DPFX_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py

Each golden is paired with a numeric check of the same model against the torch.func reference,
so a golden that still matches cannot hide wrong maths.
"""
import os
import pathlib

import pytest
import torch

import dpfx
from models import MLP, SeqModel, mse, xent
from reference import assert_close, dp_sgd_grads, run_dpfx

GOLDEN = pathlib.Path(__file__).parent / "golden"
UPDATE = os.environ.get("DPFX_UPDATE_GOLDEN") == "1"

CASES = {
    "mlp": (MLP, (8,), mse, lambda b: torch.randn(b, 4)),
    "seq": (SeqModel, (6, 8), xent, lambda b: torch.randint(0, 4, (b,))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_graphs(name):
    model_cls, shape, loss_fn, target = CASES[name]
    torch.manual_seed(0)
    model = model_cls()
    report = dpfx.explain(model, torch.randn(3, *shape), max_grad_norm=1.0, noise_multiplier=1.0)
    for stage in ("forward", "backward.private"):
        path = GOLDEN / f"{name}.{stage}.txt"
        text = report.graphs[stage]
        if UPDATE:
            path.write_text(text)
        assert path.exists(), f"missing golden {path}; run with DPFX_UPDATE_GOLDEN=1"
        assert text == path.read_text(), f"{path} changed; regenerate and review the diff"
    # The paired numeric check.
    x, y = torch.randn(5, *shape), target(5)
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, backend="eager")
    assert_close(run_dpfx(dp, model, loss_fn, x, y),
                 dp_sgd_grads(model, loss_fn, x, y, max_grad_norm=0.05))
