"""``python -m dpfx.audit``: the canary audit (dpfx/audit/__init__.py) of a built-in model or your own.

    python -m dpfx.audit --model mlp --trials 4000 --threads 1
    python -m dpfx.audit --model mypackage.models:audit_setup --control no-clip

``module:function`` names a function returning (model, (x, y), (canary_x, canary_y)). The
audit of the model as configured runs first, then the same audit of a deliberately broken
mechanism (``--control``, default sigma/10; ``none`` skips it). Exit status 0 when the first
lower bound is at most the accounted epsilon and the control's is above it.
"""
from __future__ import annotations

import torch

from dpfx.audit import run
def builtin_setup(name: str, batch: int, seed: int = 0):
    """(model, (x, y), (x_c, y_c)) for the CLI's built-in models: random data, 4 classes, and a
    canary far from the data (an input 5x larger), whose gradient is clipped."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "linear":
        model, shape = torch.nn.Linear(16, 4), (16,)
    elif name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 4))
        shape = (16,)
    elif name == "cnn":
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.GroupNorm(2, 4),
                                    torch.nn.ReLU(), torch.nn.Flatten(),
                                    torch.nn.Linear(4 * 8 * 8, 4))
        shape = (1, 8, 8)
    else:
        raise ValueError(f"unknown built-in model {name!r} (linear, mlp, cnn, or module:function)")
    x, y = torch.randn(batch, *shape, generator=gen), torch.randint(0, 4, (batch,), generator=gen)
    canary = (5 * torch.randn(*shape, generator=gen), torch.tensor(0))
    return model, (x, y), canary


def main(argv=None) -> int:
    import argparse
    import importlib

    ap = argparse.ArgumentParser(prog="python -m dpfx.audit", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mlp", help="linear | mlp | cnn, or module:function "
                    "returning (model, (x, y), (canary_x, canary_y))")
    ap.add_argument("--batch", type=int, default=8, help="size of D (built-in models)")
    ap.add_argument("--trials", type=int, default=4000, help="private steps per side")
    ap.add_argument("--noise-multiplier", type=float, default=1.0)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--sample-rate", type=float, default=1.0)
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--control", default="sigma/10",
                    help="also audit a broken mechanism: sigma/K, no-clip, or none")
    ap.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    ap.add_argument("--seed", type=int, default=None, help="fixed noise (tests only)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads during the audit")
    args = ap.parse_args(argv)
    if ":" in args.model:
        module, fn = args.model.split(":", 1)
        model, batch, canary = getattr(importlib.import_module(module), fn)()
    else:
        model, batch, canary = builtin_setup(args.model, args.batch)
    settings = dict(max_grad_norm=args.max_grad_norm, noise_multiplier=args.noise_multiplier,
                    trials=args.trials, delta=args.delta, sample_rate=args.sample_rate,
                    confidence=args.confidence, seed=args.seed, backend=args.backend,
                    threads=args.threads)
    correct = run(model, batch, canary, **settings)
    print(correct)
    ok = correct.eps_lower_bound <= correct.eps_accounted
    if args.control != "none":
        broken = run(model, batch, canary, control=args.control, **settings)
        print(broken)
        found = broken.eps_lower_bound > broken.eps_accounted
        print(f"control {'caught' if found else 'NOT caught (more trials?)'}: lower bound "
              f"{broken.eps_lower_bound:.3f} vs accounted {broken.eps_accounted:.3f}")
        ok = ok and found
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
