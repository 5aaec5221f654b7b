"""Random ops in a checkpointed region, run under a saved RNG state (Note [An op run under a saved
RNG state] in dpfx/graph/batch.py).

The partitioner wraps a checkpointed attention kernel as ``run_and_save_rng_state(op, ...)`` in
the forward and ``run_with_rng_state(state, op, ...)`` in the backward. The batch analysis and the
forward check read the op inside: over ``per_user``'s merged rows (k = 2 rows per unit, a DPO
pair's layout) the checkpointed model trains through Inductor and equals the batch-of-one loop
over units; attention whose sequence dim holds the batch is refused, wrapped or not.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import dpfx
from dpfx.loop.users import per_user
from support.reference import assert_close, loop_dp_sgd_grads, loop_example_grads, run_dpfx_multi

C = 0.05


class Attention(nn.Module):
    """Causal self-attention over (rows, T, 8), or, ``across``, over the rows: the batch held in
    the attention's sequence dim."""

    def __init__(self, across=False):
        super().__init__()
        self.qkv, self.out, self.across = nn.Linear(8, 24), nn.Linear(8, 8), across

    def forward(self, x):
        if self.across:
            x = x.transpose(0, 1)
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        h = self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True)
                     .transpose(1, 2).flatten(2))
        return h.transpose(0, 1) if self.across else h


class Net(nn.Module):
    def __init__(self, checkpointed=True, across=False):
        super().__init__()
        self.block, self.head, self.checkpointed = Attention(across), nn.Linear(8, 3), checkpointed

    def forward(self, x):
        h = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return self.head(torch.tanh(h))


def mse(out, y):
    return F.mse_loss(out, y, reduction="sum")


def test_checkpointed_attention_over_a_units_two_rows_is_the_unit_reference():
    """per_user with k = 2 over a checkpointed attention block, through Inductor: every batch
    size's step is the clipped per-unit gradient of the batch-of-one loop (each unit's two rows
    together), and the graphs hold the wrapped kernel."""
    torch.manual_seed(0)
    model = per_user(Net())
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction="sum")
    x, y = torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 3)
    for b in (1, 3, 2):
        got = run_dpfx_multi(dp, model, mse, (x[:b],), y[:b], loss_reduction="sum")
        want = loop_dp_sgd_grads(model, mse, (x[:b],), y[:b], max_grad_norm=C,
                                 loss_reduction="sum")
        assert_close(got, want, rtol=2e-4, atol=1e-6)
    per_unit = loop_example_grads(model, mse, (x,), y)
    assert (torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_unit.values())) > C).all()
    graphs = dpfx.explain(per_user(Net()), x, max_grad_norm=C, noise_multiplier=0.0).graphs
    assert "run_and_save_rng_state(aten._scaled_dot_product_flash_attention_for_cpu" in \
        graphs["forward"]
    assert "run_with_rng_state(" in graphs["backward.private"]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_attention_along_the_batch_is_refused(checkpointed):
    """The CPU attention kernel whose sequence dim holds the examples mixes them: refused, and
    refused inside a checkpointed region, where it runs under a saved RNG state."""
    model = Net(checkpointed, across=True)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager")
    with pytest.raises(dpfx.PrivacyError, match="attends across the batch"):
        dp(torch.randn(3, 5, 8)).sum().backward()
    assert all(p.grad is None for p in model.parameters())
