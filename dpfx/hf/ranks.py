"""``DPTrainer`` over several processes: what a launch may be, and what differs on its ranks.

    torchrun --nproc_per_node=2 train.py          # or: accelerate launch --num_processes=2

    trainer = dpfx.hf.DPTrainer(model=model, args=TrainingArguments(
        output_dir="out", per_device_train_batch_size=16, gradient_accumulation_steps=4, ...),
        train_dataset=train, noise_multiplier=1.0, max_grad_norm=1.0)
    trainer.train()         # q = 16 * 4 * world / N; every rank logs the same epsilon

# Note [DPTrainer over several processes]
Launched on W > 1 processes, Trainer would have accelerate wrap the model in
DistributedDataParallel, which all-reduces (averages) every gradient as the backward produces
it: each rank's clipped sums would be averaged before dpfx's step, and noise added per rank would
be averaged too. DPTrainer instead runs dpfx's own cross-rank step and keeps DDP out:

- **Sampling**: the expected global batch is per-device batch * accumulation steps * W, so
  q = that / N and D = round(qN); rank r samples the examples r, r + W, ... with rate q (Note
  [Distributed Poisson sampling] in loop/data.py), so that the ranks' batches together are one
  Poisson batch of the dataset, and every rank takes round(1/q) steps an epoch. A
  ``sampler_generator`` is mixed with the rank by the sampler (``rank_generator`` in
  loop/data.py): one seed on every rank would draw the same mask over every rank's partition,
  and examples r and r + 1 would join together.
- **The model**: a replicated model starts from rank 0's parameters and buffers on every rank
  (``broadcast_from_rank0``, what DDP's constructor does), then is compiled unwrapped;
  ``DPTrainer._wrap_model`` has accelerate prepare it as for evaluation (device placement,
  autocast) and marks it prepared, so accelerate's ``prepare`` never wraps it in DDP, and a
  training step refuses a DDP module. ``DPOptimizer.step()`` all-reduces the clipped sums with
  the noise added once, on rank 0 (Note [Noise once across ranks] in loop/optim.py). A model the
  user sharded with ``fully_shard`` trains through dpfx's sharded step (Note [Sharded DP-SGD] in
  loop/fsdp.py): reduce-scatter, each rank noises its shard.
- **Accounting**: every rank's ``DPOptimizer`` counts each global step once, so every rank's
  epsilon is the one-process value for (q, sigma, steps). Rank 0 keeps the privacy ledger and
  writes ``dp_accountant.json``; the steps a resumed run continues from are rank 0's, broadcast,
  so that every rank calibrates the same sigma.

Refused before the model is touched, with the change to make (``check_launch``): DeepSpeed,
accelerate's FSDP plugin (``fsdp=`` or an accelerate FSDP config: shard with ``fully_shard``
yourself), accelerate's ``parallelism_config``, one process over several GPUs (DataParallel),
a process group whose backend is neither gloo nor NCCL, and Trainer checkpoints of a sharded
model (Trainer saves from rank 0 alone; each rank must save its own shards).
(tests/hf/test_trainer_ranks.py)
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dpfx.loop import fsdp

BACKENDS = ("gloo", "nccl")


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("true", "1", "yes")


def check_launch(model: torch.nn.Module, args) -> int:
    """The number of processes of the launch, or a ValueError naming what to change for a launch
    DPTrainer cannot make private. Reads only ``args`` and the environment."""
    if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) \
            or _flag("ACCELERATE_USE_DEEPSPEED"):
        raise ValueError("DPTrainer does not run under DeepSpeed: its engine reduces and "
                         "partitions gradients itself, outside dpfx's clip and noise. Launch "
                         "with torchrun (or accelerate launch) without a DeepSpeed config; to "
                         "shard the model, fully_shard it yourself before DPTrainer")
    if getattr(args, "fsdp", None) or getattr(args, "fsdp_plugin_args", None) \
            or _flag("ACCELERATE_USE_FSDP"):
        raise ValueError("DPTrainer does not take accelerate's FSDP plugin (TrainingArguments("
                         "fsdp=...) or an accelerate FSDP config): it would shard and reduce the "
                         "gradients behind dpfx's clip and noise. Shard the model yourself with "
                         "torch.distributed.fsdp.fully_shard (each layer, then the root) before "
                         "giving it to DPTrainer, and launch without the FSDP config")
    if getattr(args, "parallelism_config", None) is not None or (getattr(model, "tp_size", None) or 1) > 1:
        raise ValueError("DPTrainer does not take accelerate's parallelism_config or a tensor-"
                         "parallel model: dpfx reduces the clipped sums over data-parallel ranks "
                         "only. Drop parallelism_config; to shard, use fully_shard yourself")
    if getattr(args, "n_gpu", 1) > 1:
        raise ValueError(f"one process sees {args.n_gpu} GPUs, and Trainer would replicate the "
                         f"model over them with DataParallel, outside dpfx's step: launch one "
                         f"process per GPU (torchrun --nproc_per_node={args.n_gpu}), or make one "
                         f"GPU visible (CUDA_VISIBLE_DEVICES)")
    world = args.world_size
    if world > 1:
        backend = str(dist.get_backend())
        if backend not in BACKENDS:
            raise ValueError(f"the process group's backend is {backend!r}; dpfx's cross-rank "
                             f"step runs over {' or '.join(BACKENDS)}: initialize the process "
                             f"group with one of them (torch.distributed.init_process_group("
                             f"'gloo') on CPUs, 'nccl' on GPUs) before TrainingArguments")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("DPTrainer got a DistributedDataParallel module: pass the bare "
                             "model (ddp.module); dpfx reduces the clipped sums across ranks "
                             "itself, and DDP's all-reduce would average them")
    if fsdp.units(model) and args.save_strategy != "no":
        raise ValueError("Trainer saves checkpoints from rank 0 alone, and a model sharded with "
                         "fully_shard holds its parameters and optimizer state in every rank's "
                         "shards: train it with save_strategy='no', and save each rank's own "
                         "shards with dpfx.save_checkpoint(f'ckpt.rank{rank}.pt', "
                         "model=trainer.model, optimizer=trainer.dp_optimizer)")
    return world


def broadcast_from_rank0(model: torch.nn.Module, device: torch.device) -> None:
    """Every rank takes rank 0's parameters and buffers, as DDP's constructor does: a head
    initialized at random on each rank would otherwise differ across ranks. Sent from
    ``device`` (NCCL sends only what lies on the GPU)."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            sent = t.data.to(device)
            dist.broadcast(sent, src=0)
            if sent is not t.data:
                t.data.copy_(sent)
