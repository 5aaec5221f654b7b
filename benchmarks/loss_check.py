"""What the loss check costs a step: the plain loop (dpfx/loss/track.py, loss/check.py) and the
loss captured with the model (dpfx/loss/captured.py).

    python benchmarks/loss_check.py

One process, three variants interleaved step by step so that other load on the machine hits
all alike, on the benchmark MLP (64-512-512-10, batch 256, Inductor): the README's plain loop
(``F.cross_entropy(dp(x), y).backward()``); the same step with the output handed back untracked
and the release flag set by hand (what the step cost before the check, the reference); and the
captured form (``dpfx.compile(model, loss=F.cross_entropy)``, ``dp.loss(x, y).backward()``).
Prints the medians and each variant's difference from the reference.
"""
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
import dpfx.compiled_call


def main(steps: int = 400) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, loss=F.cross_entropy)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    checked = dpfx.compiled_call.track

    def unchecked(out, backend, batch, param_ids, inputs=()):
        return out

    def step(variant):
        dpfx.compiled_call.track = unchecked if variant == "unchecked" else checked
        start = time.perf_counter()
        if variant == "captured":
            dp.loss(x, y).backward()
        elif variant == "unchecked":    # the reference: the backward let through unproven
            loss = F.cross_entropy(dp(x), y)
            with dp._dpfx_backend.gate.proven():
                loss.backward()
        else:
            F.cross_entropy(dp(x), y).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    variants = ("plain loop", "unchecked", "captured")
    for variant in variants * 5:
        step(variant)
    times = {v: [] for v in variants}
    for _ in range(steps):
        for variant in variants:
            times[variant].append(step(variant))
    dpfx.compiled_call.track = checked
    without = statistics.median(times["unchecked"])
    print(f"the step without the check (reference): {without * 1e3:.3f} ms")
    for variant in ("plain loop", "captured"):
        t = statistics.median(times[variant])
        print(f"{variant}: {t * 1e3:.3f} ms, {(t - without) * 1e6:+.0f} us "
              f"({(t / without - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
