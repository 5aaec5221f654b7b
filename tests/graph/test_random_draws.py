"""Random draws over a merged batch dim (Note [A random draw holds no example] in
dpfx/graph/batch.py): dropout's mask reads no example, so it takes whatever layout the activation
it multiplies has, batch-major (``per_user``'s k*U rows) or time-major ((T, B) flattened); ops that
read across examples next to a draw stay refused.

The exact tests run a dropout at p = 1e-30, whose draw stays in the graph while its mask keeps
every element (Note [A dropout that keeps every element] in tests/loop/test_users.py), through
Inductor against the batch-of-one loop.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from support.reference import assert_close, loop_dp_sgd_grads, run_dpfx_multi

KEEPS_ALL, C, T = 1e-30, 0.05, 4


class TimeMajor(nn.Module):
    """(B, T, d) flattened time-major to (T*B, d), dropout, back to (B, T, d)."""

    def __init__(self, p=KEEPS_ALL):
        super().__init__()
        self.fc, self.drop, self.head = nn.Linear(3, 5), nn.Dropout(p), nn.Linear(5, 2)

    def forward(self, x):
        b, t, d = x.shape
        h = torch.tanh(self.fc(x.transpose(0, 1).reshape(t * b, d)))
        h = self.drop(h).view(t, b, -1).transpose(0, 1)
        return self.head(h.sum(1))


def test_dropout_on_time_major_rows_equals_the_reference():
    """The draw is laid out batch-major, the rows time-major: the mask casts no vote, the
    product is laid out as the rows are, and the step equals the reference at B = 1, T and 5."""
    torch.manual_seed(0)
    model = TimeMajor()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0)
    for b in (1, T, 5):
        x, y = torch.randn(b, T, 3), torch.randint(0, 2, (b,))
        got = run_dpfx_multi(dp, model, F.cross_entropy, (x,), y)
        want = loop_dp_sgd_grads(model, F.cross_entropy, (x,), y, max_grad_norm=C)
        assert_close(got, want, rtol=2e-4, atol=1e-6)
    assert "inductor_random" in dp._dpfx_backend.stages.graphs["forward"]
    assert dp.compile_count == 2


class Mixing(nn.Module):
    """Dropout beside an op that reads across the rows of ``per_user``'s merged dim."""

    def __init__(self, mix):
        super().__init__()
        self.mix, self.fc, self.drop, self.head = mix, nn.Linear(3, 5), nn.Dropout(0.1), \
            nn.Linear(5, 2)

    def forward(self, x):
        h = self.drop(torch.tanh(self.fc(x)))
        return self.head(MIXES[self.mix](h))


MIXES = {
    "rows drawn at random": lambda h: h[torch.randint(0, h.shape[0], (h.shape[0],))],
    "mean over the rows": lambda h: h - h.mean(0, keepdim=True),
    "rolled rows": lambda h: torch.roll(h, 1, 0),
    "mask of a statistic": lambda h: h * torch.bernoulli(torch.sigmoid(h.mean(0)).expand_as(h)),
    "draw sorted by the rows": lambda h: h * torch.sort(torch.rand_like(h), 0).values,
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_ops_that_mix_users_beside_dropout_are_refused(mix):
    dp = dpfx.compile(dpfx.per_user(Mixing(mix)), max_grad_norm=C, noise_multiplier=0.0,
                      backend="eager")
    with pytest.raises(dpfx.PrivacyError, match="mixes examples|moves one example's values"):
        dp(torch.randn(4, 3, 3))
