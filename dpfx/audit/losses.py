"""The audits' per-example losses: what ``dpfx.audit.run`` and ``run_steps`` backward.

    dpfx.audit.run(model, (x, y), canary, loss_fn=dpfx.audit.per_example_loss, ...)

A loss function of the audit maps (model output, targets) to one loss per example (or per user);
the audit sums or averages them itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def per_example_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for integer targets, squared error summed over features otherwise."""
    if not y.is_floating_point():
        return F.cross_entropy(out, y, reduction="none")
    return (out - y).pow(2).flatten(1).sum(1)


def per_user_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``per_example_loss`` summed over each user's k examples: the loss of a user-level audit,
    where the model is a ``dpfx.per_user`` one, ``batch`` is (users, k, ...) inputs and (users,
    k) targets, and the canary is one user's k examples (Note [User-level sampling] in
    loop/users.py)."""
    per_example = per_example_loss(out.flatten(0, 1), y.flatten(0, 1))
    return per_example.unflatten(0, (-1, y.shape[1])).sum(1)
