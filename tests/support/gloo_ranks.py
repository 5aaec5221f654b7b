"""Gloo ranks for the distributed tests: each a spawned process that runs one function and saves
what it returns.

    results, errors = spawn(tmp_path, world, body, *args)   # body(*args) on every rank

Rank r joins a gloo group of ``world`` on a free local port, with one intra-op thread, calls
``body(*args)`` (a module-level function, so that the spawned process can import it; it reads its
rank from ``torch.distributed``), and writes the result to ``rank{r}.pt`` or its traceback to
``rank{r}.err``. ``spawn`` returns both as dicts by rank; a run past ``deadline`` seconds fails,
and every collective is bounded by the group's ``timeout``.

# Note [A rank that aborts after its work]
A rank can die as its process exits: test_fsdp.py's rank 1 was killed by SIGABRT ("terminate
called without an active exception") once in a CI run, and that test failed once more in about
70 runs on the 2-core machine, beside another compile. The message is what a C++ thread object
prints when it is destroyed while still joinable, as gloo's threads can be when a process tears
down its group at exit (a known torch behaviour with gloo). So a rank that finished waits at a
closing barrier for every rank to finish, writes ``rank{r}.done``, destroys its group and leaves
through ``os._exit(0)`` (no interpreter teardown; the results are already on disk). ``spawn``
turns a death after every rank's ``done`` into a warning, since nothing under test runs then; a
death before it, a missing result or an error still fails the test
(tests/loop/test_distributed.py::test_a_rank_dying_during_its_work_fails_the_run).
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, out_dir: str, timeout: float, body,
          args: tuple) -> None:
    finished = False
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        result = body(*args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        finished = True
    except Exception:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        if dist.is_initialized():
            if finished:
                try:
                    dist.barrier()
                    open(os.path.join(out_dir, f"rank{rank}.done"), "w").close()
                except Exception:     # another rank failed and left: its .err says why
                    pass
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(tmp_path, world: int, body, *args, deadline: float = 480, timeout: float = 120):
    """({rank: result}, {rank: traceback}) of ``body(*args)`` on ``world`` gloo ranks, every
    collective bounded by ``timeout`` seconds."""
    ctx = mp.start_processes(_rank, args=(world, free_port(), str(tmp_path), timeout, body, args),
                             nprocs=world, join=False, start_method="spawn")
    start = time.monotonic()
    while True:
        try:
            if ctx.join(timeout=5):
                break
        except mp.ProcessExitedException as e:
            if not all((tmp_path / f"rank{r}.done").exists() for r in range(world)):
                raise
            warnings.warn(f"a rank died after every rank had finished its work ({e}); Note "
                          f"[A rank that aborts after its work] in tests/support/gloo_ranks.py")
            break
        if time.monotonic() - start > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{body.__name__}{args} on {world} ranks did not finish in {deadline}s")
    errors = {r: (tmp_path / f"rank{r}.err").read_text() for r in range(world)
              if (tmp_path / f"rank{r}.err").exists()}
    results = {r: torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)
               if (tmp_path / f"rank{r}.pt").exists()}
    return results, errors
