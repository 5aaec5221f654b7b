"""A private run under ``torchrun --max-restarts=3`` whose rank 1 is killed mid-run on the first
attempt (run by tests/privacy/test_faults_distributed.py, not collected by pytest).

    python -m torch.distributed.run --standalone --nproc_per_node=2 --max-restarts=3 \
        tests/support/torchrun_resume.py OUT_DIR

Every rank trains to ``TOTAL`` steps with ``make_private(..., ledger=)``; rank 0 saves a
checkpoint every ``SAVE_EVERY`` steps. On the first attempt rank 1 kills itself (SIGKILL) right
after step ``KILL_AFTER``: rank 0's next all-reduce fails (dpfx.PeerError), torchrun restarts
both, and they resume from the checkpoint and the ledger. Each rank appends one line per release
to ``releases{rank}.txt`` and writes its final accountant count to ``final{rank}.json``.
"""
import datetime
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dpfx

TOTAL, SAVE_EVERY, KILL_AFTER = 8, 3, 5


def main(out: str) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # torchrun's store outlives a restart: without a prefix of its own, a restarted rank can read
    # the address a dead rank of the previous attempt published and time out connecting to it
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    data = torch.utils.data.TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
    private = dpfx.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                                batch_size=8, max_grad_norm=1.0, noise_multiplier=1.0,
                                backend="eager", ledger=os.path.join(out, "privacy.ledger"))
    dp_model, optimizer, loader, accountant = private
    checkpoint = os.path.join(out, "model.ckpt")
    start = dpfx.load_checkpoint(checkpoint, private)["step"] if os.path.exists(checkpoint) \
        else 0
    batches = iter(())
    for step in range(start, TOTAL):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        optimizer.zero_grad()
        out_ = dp_model(x)
        (F.cross_entropy(out_, y) if len(y) else out_.sum() * 0).backward()
        optimizer.step()
        with open(os.path.join(out, f"releases{rank}.txt"), "a") as f:
            f.write(f"{attempt} {step + 1}\n")
        if (step + 1) % SAVE_EVERY == 0:
            if rank == 0:
                dpfx.save_checkpoint(checkpoint, private, step=step + 1)
            dist.barrier()
        if attempt == 0 and rank == 1 and step + 1 == KILL_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)
    with open(os.path.join(out, f"final{rank}.json"), "w") as f:
        json.dump({"steps": accountant.steps, "attempt": attempt}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
