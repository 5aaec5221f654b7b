"""Activation checkpointing (``torch.utils.checkpoint``), both implementations, eager and Inductor.

dynamo captures a checkpointed region as one higher-order op whose forward is recomputed in the
backward; dpfx's rewrite sees the recomputed forward nodes as ordinary batched nodes. Recomputation
is a memory trade, not a change of function, so the DP-SGD gradient must equal that of the same
model without checkpointing (the reference runs with the checkpoints off: torch.func cannot
differentiate through checkpoint's saved-tensor hooks). Clipping bites, and B = 1 shares the graph
of B = 5 and 3. The Hugging Face form (``gradient_checkpointing_enable()``) is in test_hf.py.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import dpfx
from support.reference import assert_close, clip_fraction, dp_sgd_grads, run_dpfx

C = 0.05


class Block(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(6, 8), nn.Linear(8, 6), nn.LayerNorm(6)
        self.reentrant, self.checkpointed = reentrant, True

    def body(self, x):
        return self.norm(x + self.down(torch.tanh(self.up(x))))

    def forward(self, x):
        if self.checkpointed:
            return checkpoint(self.body, x, use_reentrant=self.reentrant)
        return self.body(x)


class Net(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.blocks = nn.Sequential(Block(reentrant), Block(reentrant))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.blocks(x).mean(1))

    def checkpointing(self, on: bool):
        for block in self.blocks:
            block.checkpointed = on


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_match_the_plain_model(reentrant, backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net(reentrant)
    x, y = torch.randn(5, 4, 6) * 3, torch.arange(5) % 3
    model.checkpointing(False)
    assert clip_fraction(model, F.cross_entropy, x, y, C) == 1.0
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend=backend)
    tol = {"rtol": 1e-4, "atol": 1e-6} if backend == "inductor" else {}
    for batch in (5, 1, 4):
        model.checkpointing(True)
        got = run_dpfx(dp, model, F.cross_entropy, x[:batch], y[:batch])
        model.checkpointing(False)
        want = dp_sgd_grads(model, F.cross_entropy, x[:batch], y[:batch], max_grad_norm=C)
        assert_close(got, want, **tol)
    assert dp.compile_count == 2
