"""DP-SGD on scikit-learn's bundled handwritten digits (1797 8x8 images, no download).

    python examples/train_digits.py                       # CNN, epsilon 3, delta 1e-5
    python examples/train_digits.py --target-epsilon 1
    python examples/train_digits.py --non-private         # the same model and steps, no DP
    python examples/train_digits.py --plot run.png        # epsilon and clipped fraction by step

``dpfx.make_private_with_epsilon`` wires it all: Poisson-sampled batches (dpfx.loop.data), noise
calibrated to the target epsilon for the planned number of steps (dpfx.privacy, PLD accountant),
the step compiled by dpfx through Inductor, and the accountant counting every optimizer step; the
epsilon actually spent is reported from it, in the progress bar at the end of each epoch and at
the end. ``--plot run.png`` records each step (``dpfx.report.RunHistory``, with
``track_norms=True``) and draws epsilon and the clipped fraction against the step (the clipped
fraction is computed from the raw data: not private). ``--max-physical-batch-size 64`` runs
each Poisson batch as virtual batches; ``--secure-mode`` draws the noise from the OS CSPRNG.
Under torchrun (``torchrun --nproc_per_node=2 examples/train_digits.py``) every rank samples its
shard of the data, the clipped sums are all-reduced over gloo, and rank 0 adds the noise once.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset
from tqdm import tqdm

import dpfx
from dpfx.loop.data import poisson_loader


def make_model(kind: str) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.Tanh(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.GroupNorm(4, 32), nn.Tanh(),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )


def load(seed: int):
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y)
    mean, std = x_train.mean(), x_train.std()
    return TensorDataset((x_train - mean) / std, y_train), ((x_test - mean) / std, y_test)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        pred = model(x).argmax(1)
    model.train()
    return (pred == y).float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=256, help="expected (Poisson) batch size")
    ap.add_argument("--lr", type=float, default=None,
                    help="SGD learning rate (default 4.0 private, 0.05 with momentum non-private)")
    ap.add_argument("--max-grad-norm", type=float, default=0.5)
    ap.add_argument("--target-epsilon", type=float, default=3.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--non-private", action="store_true")
    ap.add_argument("--backend", choices=["inductor", "eager"], default="inductor")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-physical-batch-size", type=int, default=None,
                    help="run each Poisson batch as physical batches of at most this size "
                         "(virtual batches: noise once per logical step)")
    ap.add_argument("--secure-mode", action="store_true",
                    help="draw the noise from the OS CSPRNG (dpfx.loop.noise)")
    ap.add_argument("--plot", metavar="PNG", default=None,
                    help="write epsilon and the clipped fraction (not private) by step to PNG")
    args = ap.parse_args()
    if args.plot and args.non_private:
        ap.error("--plot draws a private run's epsilon and clipping: drop --non-private")

    distributed = "RANK" in os.environ and not args.non_private    # launched by torchrun
    if distributed:
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
    main_rank = not distributed or dist.get_rank() == 0
    torch.manual_seed(args.seed)       # the same initial model on every rank
    train, (x_test, y_test) = load(args.seed)
    n = len(train)
    model = make_model(args.model)
    generator = torch.Generator().manual_seed(args.seed)

    if args.non_private:
        q = args.batch_size / n
        steps_per_epoch, sigma = round(1 / q), 0.0
        step_model = torch.compile(model)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr or 0.05, momentum=0.9)
        loader = poisson_loader(train, q, generator=generator)
        accountant = None
    else:
        # One call wires the Poisson loader, the compiled private model, the optimizer that
        # counts steps in the accountant, and sigma calibrated for the whole run.
        private = dpfx.make_private_with_epsilon(
            model, torch.optim.SGD(model.parameters(), lr=args.lr or 4.0), train,
            batch_size=args.batch_size, target_epsilon=args.target_epsilon,
            target_delta=args.delta, epochs=args.epochs, max_grad_norm=args.max_grad_norm,
            backend=args.backend, secure_mode=args.secure_mode,
            # one seeded sampler, or per-rank OS-seeded ones (a shared seed would correlate the
            # ranks' draws; Note [Distributed Poisson sampling])
            generator=None if distributed else generator,
            max_physical_batch_size=args.max_physical_batch_size, track_norms=bool(args.plot))
        step_model, opt, loader, accountant = private
        q, steps_per_epoch, sigma = private.sample_rate, private.steps_per_epoch, \
            private.noise_multiplier
    steps = args.epochs * steps_per_epoch
    if main_rank:
        print(f"digits: {n} train / {len(y_test)} test, q={q:.4f}, {steps} steps, "
              f"sigma={sigma:.3f}, C={args.max_grad_norm}, model={args.model}"
              + (f", {dist.get_world_size()} ranks" if distributed else ""))

    history = dpfx.report.RunHistory(step_model, accountant, delta=args.delta) \
        if args.plot and main_rank else None
    if main_rank:
        print("first step: compiling the private forward and backward ...", flush=True)
    start = time.perf_counter()
    bar = None        # started after the first step, so that its rate and ETA leave the compile out
    for epoch in range(args.epochs):
        for x, y in loader:
            if not (args.non_private and x.shape[0] == 0):
                opt.zero_grad(set_to_none=True)
                out = step_model(x)
                loss = F.cross_entropy(out, y) if x.shape[0] else out.sum() * 0.0
                loss.backward()
                opt.step()
                if not args.non_private and opt._open:   # no logical step yet (virtual batches)
                    continue
            if history is not None:
                history.record()
            if bar is None:
                if main_rank:
                    print(f"first step done in {time.perf_counter() - start:.1f}s "
                          f"(compile and self-check included)", flush=True)
                bar = tqdm(total=steps, initial=1, unit="step", disable=not main_rank)
            else:
                bar.update()
        if bar is not None and main_rank:
            # epsilon after this epoch's steps, from the accountant (one PLD composition)
            eps = {} if accountant is None else {"eps": f"{accountant.get_epsilon(args.delta):.2f}"}
            bar.set_postfix(loss=f"{loss.item():.3f}",
                            test_acc=f"{accuracy(model, x_test, y_test):.3f}", **eps)
    bar.close()
    elapsed = time.perf_counter() - start

    acc = accuracy(model, x_test, y_test)
    eps = accountant.get_epsilon(args.delta) if accountant is not None else float("inf")
    if main_rank:
        print(f"test accuracy {acc:.4f}  epsilon {eps:.3f} at delta {args.delta}  "
              f"({steps} steps in {elapsed:.1f}s)")
    if history is not None:
        history.plot(args.plot)
        print(f"wrote {args.plot}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
