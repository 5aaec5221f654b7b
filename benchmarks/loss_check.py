"""What the loss check (dpfx/loss_track.py, loss_check.py) costs a step of the README loop.

    python benchmarks/loss_check.py

One process, the two variants interleaved step by step so that other load on the machine hits
both alike: the README loop (``F.cross_entropy(dp(x), y).backward()``) on the benchmark MLP
(64-512-512-10, batch 256, Inductor), and the same step with the output handed back untracked and
the release flag set by hand (what the step cost before the check). Prints the medians.
"""
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
import dpfx.api


def main(steps: int = 400) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    checked = dpfx.api.track

    def unchecked(out, backend, batch, param_ids, inputs=()):
        backend.loss_released = True
        return out

    def step(track):
        dpfx.api.track = track
        start = time.perf_counter()
        F.cross_entropy(dp(x), y).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for track in (checked, unchecked) * 5:
        step(track)
    times = {checked: [], unchecked: []}
    for _ in range(steps):
        for track in (checked, unchecked):
            times[track].append(step(track))
    dpfx.api.track = checked
    dp._dpfx_backend.loss_released = False
    with_check, without = (statistics.median(times[t]) for t in (checked, unchecked))
    print(f"step with the loss check {with_check * 1e3:.3f} ms, without {without * 1e3:.3f} ms: "
          f"{(with_check - without) * 1e6:+.0f} us ({(with_check / without - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
