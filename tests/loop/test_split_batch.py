"""A logical batch split into physical batches (dpfx/loop/data.py, Note [Near-equal physical
batches]): near-equal pieces, so that a one-row physical batch, and the graph a model that
branches on the batch size compiles for it, comes only from a logical batch of one row; the
split's clipped sums add up to the unsplit step, through Inductor."""
import pytest
import torch

import dpfx
from dpfx.loop.data import split_batch, split_sizes
from support.models import MLP
from support.reference import assert_close, dp_sgd_grads


@pytest.mark.parametrize("size", range(3, 17))
def test_no_one_row_physical_batch_unless_the_logical_batch_has_one(size):
    for n in range(0, 5 * size + 2):
        x = torch.arange(n)
        pieces = split_batch({"x": x, "y": -x}, size)
        lengths = [len(p["x"]) for p in pieces]
        assert lengths == split_sizes(n, size)
        assert sum(lengths) == n and all(length <= size for length in lengths)
        assert len(pieces) == max(1, -(-n // size))             # the fewest the cap allows
        assert max(lengths) - min(lengths) <= 1
        assert n == 1 or 1 not in lengths, (n, size, lengths)
        assert torch.equal(torch.cat([p["x"] for p in pieces]), x)   # in order, every row once
        assert all(torch.equal(p["y"], -p["x"]) for p in pieces)     # rows kept together


def test_split_sizes_examples():
    assert split_sizes(9, 8) == [5, 4]
    assert split_sizes(17, 8) == [6, 6, 5]
    assert split_sizes(16, 8) == [8, 8]
    assert split_sizes(1, 8) == [1] and split_sizes(0, 8) == [0]
    # a cap of 2 cannot keep an odd batch's rows in pairs; a cap of 1 is one row each
    assert split_sizes(5, 2) == [2, 2, 1] and split_sizes(3, 1) == [1, 1, 1]


def test_split_steps_equal_the_unsplit_step_through_inductor():
    """sigma 0: a logical batch of 9 at a cap of 8 runs as 5 + 4, and its step is the unsplit
    step's, both the clipped reference."""
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    x, y = torch.randn(9, 8) * 3, torch.randn(9, 4)
    dp = dpfx.compile(model, max_grad_norm=0.2, noise_multiplier=0.0, noise="optimizer",
                      expected_batch_size=6)
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp)

    def backward(cx, cy):
        ((dp(cx) - cy) ** 2).flatten(1).mean(1).mean().backward()

    opt.zero_grad()
    backward(x, y)
    opt.step()
    unsplit = {k: p.grad.clone() for k, p in model.named_parameters()}
    sizes = []
    for cx, cy in dpfx.VirtualBatches([(x, y)], 8, opt):
        sizes.append(len(cx))
        opt.zero_grad()
        backward(cx, cy)
        opt.step()
    assert sizes == [5, 4] and opt.steps == 2
    split = {k: p.grad.clone() for k, p in model.named_parameters()}
    assert dp.dp_config.backend == "inductor"
    assert_close(split, unsplit, rtol=1e-5, atol=1e-7)
    want = dp_sgd_grads(model, lambda out, t: ((out - t) ** 2).flatten(1).mean(1).mean(), x, y,
                        max_grad_norm=0.2, expected_batch_size=6)
    assert_close(split, want, rtol=1e-4, atol=1e-6)


def test_agreed_pieces_pad_with_empty_batches_after_the_rank_own():
    """Note [Every rank runs as many physical batches]: a rank whose Poisson batch cuts into
    fewer pieces than another's runs empty pieces after its own, every row exactly once."""
    batch = {"x": torch.arange(9).reshape(9, 1), "y": torch.arange(9)}
    pieces = split_batch(batch, 8, 4)
    assert [len(p["y"]) for p in pieces] == [5, 4, 0, 0]
    assert torch.cat([p["y"] for p in pieces]).tolist() == list(range(9))
    assert [p["x"].shape for p in pieces][-1] == (0, 1)
    assert [len(p["y"]) for p in split_batch(batch, 8, None)] == [5, 4]
    assert [len(p["y"]) for p in split_batch(batch, 8, 1)] == [5, 4]     # never fewer
