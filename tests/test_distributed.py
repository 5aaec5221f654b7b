"""Distributed DP-SGD over torch.distributed (gloo, 2 processes spawned by the test itself).

With sigma = 0 the parameters after k steps equal one process training on the union of the
ranks' batches (same clipping, same denominator); with sigma > 0 the noise is added once
globally (std sigma*C/D) and every rank holds identical parameters; a mismatched model is an
error on every rank, not a hang. Every collective runs under a bounded timeout.
"""
import datetime
import os
import socket
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dpfx
from models import MLP

C, D, LR = 0.3, 6, 0.5
# Each step, each rank's batch (rank 1's second batch is empty; sizes differ across ranks).
SIZES = [(3, 2), (4, 0), (1, 5)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    n = SIZES[step][rank]
    return torch.randn(n, 8, generator=g) * 3, torch.randn(n, 4, generator=g)


def _loss(dp, x, y):
    out = dp(x)
    if x.shape[0] == 0:
        return out.sum() * 0.0
    return ((out - y) ** 2).flatten(1).mean(1).mean()


def _worker(rank, world, port, out_dir, scenario):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(0)
        model = MLP(8, 16, 4)
        if scenario == "mismatch" and rank == 1:
            with torch.no_grad():
                model.fc1.weight.add_(1.0)
        sigma = 0.0 if scenario == "exact" else 2.0
        dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=sigma,
                          expected_batch_size=D, backend="eager")
        assert dp.dp_config.noise == "optimizer"          # chosen because world > 1
        opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), dp)
        grads = []
        for step in range(len(SIZES)):
            x, y = _data(step, rank)
            if scenario == "noise":
                x, y = x[:0], y[:0]
            opt.zero_grad()
            _loss(dp, x, y).backward()
            opt.step()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        torch.save({"params": [p.detach() for p in model.parameters()],
                    "grads": torch.stack(grads)}, os.path.join(out_dir, f"rank{rank}.pt"))
    except Exception:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(tmp_path, scenario):
    ctx = mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path), scenario),
                             nprocs=2, join=False, start_method="spawn")
    deadline = 240
    import time
    start = time.monotonic()
    while not ctx.join(timeout=5):
        if time.monotonic() - start > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"distributed run '{scenario}' did not finish in {deadline}s")
    errors = {r: (tmp_path / f"rank{r}.err").read_text() for r in range(2)
              if (tmp_path / f"rank{r}.err").exists()}
    results = {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(2)
               if (tmp_path / f"rank{r}.pt").exists()}
    return results, errors


def _single_process_reference():
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=D,
                      backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(len(SIZES)):
        (x0, y0), (x1, y1) = _data(step, 0), _data(step, 1)
        opt.zero_grad()
        _loss(dp, torch.cat([x0, x1]), torch.cat([y0, y1])).backward()
        # the union's mean is over its own size; dpfx divides by D either way
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_two_ranks_equal_one_process_on_the_union(tmp_path):
    results, errors = _spawn(tmp_path, "exact")
    assert not errors, errors
    want = _single_process_reference()
    for rank in range(2):
        for got, w in zip(results[rank]["params"], want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0]["grads"], results[1]["grads"], rtol=0, atol=0)


def test_noise_is_added_once_globally(tmp_path):
    results, errors = _spawn(tmp_path, "noise")
    assert not errors, errors
    noise = results[0]["grads"]                       # 3 steps x 212 coordinates, no data
    assert torch.equal(noise, results[1]["grads"])    # identical on every rank
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
    # sigma*C/D once: not sqrt(2) times that (noise on both ranks), not 0 (on none)
    assert noise.std().item() == pytest.approx(2.0 * C / D, rel=0.1)


def test_mismatched_models_fail_on_every_rank(tmp_path):
    results, errors = _spawn(tmp_path, "mismatch")
    assert set(errors) == {0, 1}, errors
    assert all("ranks hold different models" in e for e in errors.values())


def test_ddp_wrapped_model_is_refused():
    class FakeDDP(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, module):                       # no process group needed to refuse
            torch.nn.Module.__init__(self)
            self.module = module

    with pytest.raises(TypeError, match="compile the bare module"):
        dpfx.compile(FakeDDP(MLP()), max_grad_norm=1.0, noise_multiplier=1.0)
