"""The next step's graph noise, drawn on a background thread while the current step runs.

    with noise_ahead.serving():        # backend.py, around one run of an unseeded backward graph
        compiled(args)                 # dpfx::standard_normal(n) takes the buffer drawn ahead

# Note [Drawing the noise ahead]
A DP step needs one Gaussian per trainable parameter, and nothing about it depends on the data:
on a small model the draw is a tenth of the step (0.2-0.3 ms for 301k numbers on the 2-core
machine, the step's mm's are about as long), and it sits on the critical path in the middle of
the backward graph. dpfx draws it ahead instead: when a backward graph takes its noise, the
buffer for the next step of that size is started on one background thread (the C kernel
releases the GIL), which runs while the optimizer step, the data loading and the next forward's
Python leave a core idle. The next backward takes it (waiting if it is not finished) and starts
the one after.

What it changes, and what it does not:
- Each buffer is drawn under its own 64-bit Philox key from the OS's CSPRNG (``secrets``) and is
  handed out once, then dropped: no noise is ever reused, and a buffer nobody takes is simply
  never released. The draws are the same kernel's (cpu_noise.py), so the noise's distribution is
  unchanged; only the thread that computes it differs.
- Only unseeded graphs draw ahead. A run with ``seed`` keeps the noise a function of the seed
  and the step count, drawn in place, so a checkpoint restores it bit for bit (a buffer drawn
  ahead would have advanced the seeded generator past the step it belongs to).
- Only the real step's backward is served: the self-check's synthetic runs compare the compiled
  graph with the eager one under one seeded generator and draw in place.
- Memory: one buffer of the graph's noise size per distinct size lives between steps (started
  after the backward graph returns, so it never adds to the backward's peak).
(tests/test_noise_ahead.py)
"""
from __future__ import annotations

import concurrent.futures
import os
import secrets
import threading

import torch

from . import cpu_noise

_state = threading.local()
_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_ahead: dict[int, concurrent.futures.Future] = {}      # noise size -> the buffer being drawn


class serving:
    """While active on this thread, ``dpfx::standard_normal`` takes buffers drawn ahead."""

    __slots__ = ("_outer", "_sizes")

    def __enter__(self):
        self._outer = getattr(_state, "sizes", None)
        self._sizes = _state.sizes = []
        return self

    def __exit__(self, *exc):
        _state.sizes = self._outer
        for n in self._sizes:          # after the graph returned: never during its peak
            _start(n)
        return False


def active() -> bool:
    return getattr(_state, "sizes", None) is not None and cpu_noise.available()


def take(n: int) -> torch.Tensor:
    """f32[n] of N(0, 1): the buffer drawn ahead for this size, else one drawn now."""
    with _lock:
        future = _ahead.pop(n, None)
    _state.sizes.append(n)
    if future is not None:
        return future.result()
    return cpu_noise.philox_normal(n, secrets.randbits(64))


def pending() -> list[int]:
    """The sizes being drawn ahead (for tests)."""
    with _lock:
        return list(_ahead)


def _forget_after_fork() -> None:
    # A forked child has no worker thread: a fresh pool and no buffers (never the parent's).
    global _pool
    _pool = None
    _ahead.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _start(n: int) -> None:
    global _pool
    with _lock:
        if n in _ahead:
            return
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dpfx-noise")
        _ahead[n] = _pool.submit(cpu_noise.philox_normal, n, secrets.randbits(64), 1)
