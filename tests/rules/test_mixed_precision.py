"""bf16 and fp16 parameters: every strategy's clipped sum is taken in float32 and the gradient
comes back in the parameter's dtype. The ghost forms' book-keeping products used to mix a bf16
operand with the float32 clip-scaled one and fail at run time (rules.at_least_float32).

Reference: the float32 DP-SGD gradient of the same (bf16-rounded) weights and inputs. Tolerance:
the bf16 forward and backward carry ~2^-8 relative error per op, so a few percent; clipping
bites (C far below every per-example norm), so a wrong clip factor is off by far more."""
import copy

import pytest
import torch
import torch.nn as nn

import dpfx
from support.models import mse
from support.reference import clip_fraction, dp_sgd_grads, run_dpfx

C = 0.05


class SeqLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):                    # (B, T, 8): the ghost form's Gram branch
        return self.fc2(torch.relu(self.fc1(x))).mean(1)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(2, 4, 3, padding=1), nn.Linear(4 * 6 * 6, 4)

    def forward(self, x):                    # (B, 2, 6, 6)
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class EmbeddingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(30, 8), nn.Linear(8, 4)

    def forward(self, idx):                  # (B, 5) ids
        return self.fc(self.emb(idx).mean(1))


CASES = {
    "linear": (SeqLinear, lambda g, b: torch.randn(b, 5, 8, generator=g)),
    "conv": (ConvNet, lambda g, b: torch.randn(b, 2, 6, 6, generator=g)),
    "embedding": (EmbeddingNet, lambda g, b: torch.randint(0, 30, (b, 5), generator=g)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("batch", [0, 1, 4])
def test_low_precision_parameters(case, strategy, dtype, batch):
    ctor, make_x = CASES[case]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = ctor().to(dtype)
    x = make_x(g, batch)
    x = x.to(dtype) if x.is_floating_point() else x
    y = torch.randn(batch, 4, generator=g).to(dtype)
    reference = copy.deepcopy(model).float()
    x32 = x.float() if x.is_floating_point() else x
    want = dp_sgd_grads(reference, mse, x32, y.float(), max_grad_norm=C, expected_batch_size=4)
    if batch:
        assert clip_fraction(reference, mse, x32, y.float(), C) == 1.0

    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=4,
                      strategy=strategy, backend="eager")
    got = run_dpfx(dp, model, mse, x, y)
    weights = [pg for pg in dp._dpfx_backend.param_grads if pg.name.endswith("weight")]
    assert {pg.strategy for pg in weights} == {strategy}
    for name, grad in got.items():
        assert grad.dtype == dtype, name
        torch.testing.assert_close(grad.float(), want[name], rtol=0.05, atol=C * 2e-3,
                                   msg=lambda m: f"{name}: {m}")


def test_bf16_through_inductor():
    torch.manual_seed(0)
    model = SeqLinear().to(torch.bfloat16)
    x, y = torch.randn(3, 5, 8).to(torch.bfloat16), torch.randn(3, 4).to(torch.bfloat16)
    want = dp_sgd_grads(copy.deepcopy(model).float(), mse, x.float(), y.float(),
                        max_grad_norm=C, expected_batch_size=4)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=4)
    got = run_dpfx(dp, model, mse, x, y)
    for name, grad in got.items():
        torch.testing.assert_close(grad.float(), want[name], rtol=0.05, atol=C * 2e-3)
