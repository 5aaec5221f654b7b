"""torch.distributed for a private run: the world and this rank (1 and 0 without a process
group), the check that every rank starts from the same model, and the error of a dead peer
(Notes [Noise once across ranks] and [A dead peer] in loop/optim.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from dpfx.errors import PeerError


def peer_error(steps: int, group, cause: Exception) -> PeerError:
    """Note [A dead peer]."""
    return PeerError(
        f"rank {rank_of(group)}: the all-reduce of step {steps + 1} failed: a peer rank died, or "
        f"did not reach the step within the process group's timeout (init_process_group("
        f"timeout=) bounds the wait). This rank took no step: its parameters are those of step "
        f"{steps}. Restart every rank from the last checkpoint with the same ledger= "
        f"(torchrun --max-restarts restarts them all). The backend said: {str(cause)[:300]}")


def check_same_model(model: torch.nn.Module, group) -> None:
    """Every rank must start from the same parameters, or the ranks' steps diverge (and an
    all-reduce of differently sized buffers can hang). Compares a fingerprint across ranks."""
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    fingerprint = torch.tensor(
        [len(params), sum(p.numel() for p in params),
         sum(float(p.double().sum()) for p in params),
         sum(float(p.double().square().sum()) for p in params)], dtype=torch.float64)
    device = params[0].device if params else torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = fingerprint.to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if any(not torch.equal(everyone[0], other) for other in everyone[1:]):
        raise ValueError(
            f"the ranks hold different models (parameter count, size, sum, sum of squares by "
            f"rank: {[t.tolist() for t in everyone]}); start every rank from the same "
            f"parameters (same seed, or broadcast rank 0's state_dict) before DPOptimizer")


def world_of(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def rank_of(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0
