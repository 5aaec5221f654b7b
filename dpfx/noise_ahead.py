"""The next step's graph noise, drawn on a background thread while the current step runs.

    with noise_ahead.serving():        # backend.py, around one run of an unseeded backward graph
        compiled(args)                 # dpfx::standard_normal(n) takes the buffer drawn ahead

# Note [Drawing the noise ahead]
A DP step needs one Gaussian per trainable parameter, and nothing about it depends on the data:
on a small model the draw is a tenth of the step (0.2-0.3 ms for 301k numbers on the 2-core
machine, the step's mm's are about as long), and it sits on the critical path in the middle of
the backward graph. dpfx draws it ahead instead: once a backward graph has taken noise of some
size, every later training forward queues a buffer of that size to a worker thread of the C
kernel (csrc/philox_normal.c), which never touches Python (a Python thread pool cost 0.1 ms a
step in wake-ups and GIL hand-offs) and draws on one core while the forward's and the loss's
Python leave one idle. The backward takes the buffer, waiting without the GIL if it is not
finished.

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
- Memory: the buffer is allocated when the forward starts, inside the step (a step's peak counts
  it), and nothing is held between steps; queued after the backward instead, it would sit beside
  the step's gradients until zero_grad (measured: +1.0 MB of step memory on the MLP).
(tests/test_noise_ahead.py)
"""
from __future__ import annotations

import atexit
import os
import secrets
import threading

import torch

from . import cpu_noise

ENABLED = True        # for benchmarks' A/B only: False draws every buffer in place
_state = threading.local()
_lock = threading.Lock()
_ahead: dict[int, tuple[torch.Tensor, int]] = {}     # noise size -> (buffer, ticket)
_wanted: set[int] = set()                             # noise sizes backwards have taken


class serving:
    """While active on this thread, ``dpfx::standard_normal`` takes buffers drawn ahead."""

    __slots__ = ("_outer", "_sizes")

    def __enter__(self):
        self._outer = getattr(_state, "sizes", None)
        self._sizes = _state.sizes = []
        return self

    def __exit__(self, *exc):
        _state.sizes = self._outer
        with _lock:
            _wanted.update(self._sizes)
        return False


def draw() -> None:
    """Start drawing a buffer for every noise size a backward has taken (DPModule's training
    forward calls this, so the draw runs while the forward does)."""
    if _wanted and ENABLED and cpu_noise.available():
        for n in list(_wanted):
            _start(n)


def active() -> bool:
    return ENABLED and getattr(_state, "sizes", None) is not None and cpu_noise.available()


def take(n: int) -> torch.Tensor:
    """f32[n] of N(0, 1): the buffer drawn ahead for this size, else one drawn now."""
    with _lock:
        ahead = _ahead.pop(n, None)
    _state.sizes.append(n)
    if ahead is None:
        return cpu_noise.philox_normal(n, secrets.randbits(64))
    buffer, ticket = ahead
    cpu_noise.wait(ticket)
    return buffer


def pending() -> list[int]:
    """The sizes being drawn ahead (for tests)."""
    with _lock:
        return list(_ahead)


def _start(n: int) -> None:
    with _lock:
        if n in _ahead or n == 0:
            return
        buffer = torch.empty(n, dtype=torch.float32)
        ticket = cpu_noise.submit(buffer, secrets.randbits(64))
        if ticket >= 0:
            _ahead[n] = (buffer, ticket)


def _finish() -> None:
    # At exit, let the worker finish writing into buffers Python is about to free.
    with _lock:
        tickets = [ticket for _, ticket in _ahead.values()]
        _ahead.clear()
    if tickets:
        cpu_noise.wait(max(tickets))


def _forget_after_fork() -> None:
    # A forked child has no worker thread (the kernel resets its queue): no buffers either.
    _ahead.clear()
    _wanted.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(_finish)
