"""A private step's gradients: the clipped sums noised once, divided by D, written into p.grad.

    writer = GradWriter(dp_model, named, noise, gate, world=1, process_group=None)
    count = writer.replicated(count, steps)    # one process, or replicated ranks (all-reduce)
    count = writer.sharded(count, steps)       # fully_shard: reduce-scatter, each rank its shard
    writer.adapt(count, examples)              # one process: the count noised, the bound moved
    writer.divisor                             # the D the step divided by

``noise="optimizer"`` models only: the backward left sum_i clip(g_i) in ``dp_model.clipped_sums``.
Under adaptive clipping the count of unclipped examples travels with the sums across ranks
(Note [Adaptive clipping over several ranks]); in one CPU process each sum is noised where it
lies (Note [The optimizer's noise added where the sums lie]).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dpfx.loop.ranks import peer_error, rank_of
from dpfx.loop.step_noise import StepNoise
from dpfx.ops.noise import add_noise_keyed


def noise_std(dp_model) -> float:
    """The gradient's noise std: sigma * S, or sigma_grad * C_t under adaptive clipping."""
    config = dp_model.dp_config
    state = dp_model.adaptive_clip
    if state is None:
        return config.noise_std
    return config.grad_noise_multiplier * state.bound


class GradWriter:
    """Writes the release into p.grad (each write reported to the gate's ledger, whose check
    the inner step's pre-hooks may not get past) and resets the clipped sums."""

    def __init__(self, dp_model, named: list, noise: StepNoise, gate, *, world: int,
                 process_group):
        self.dp_model, self.named, self.noise, self.gate = dp_model, named, noise, gate
        self.world, self.process_group = world, process_group
        self.divisor: float | None = None     # D of the last write

    def replicated(self, count, steps: int):
        """The noised, divided clipped sums into p.grad. Returns the adaptive count still to be
        noised (one process), or None when it went with the sums (several ranks)."""
        model, config = self.dp_model, self.dp_model.dp_config
        sums = model.clipped_sums
        if not self.named:
            return count
        if self.world <= 1 and self.noise.mechanism is None and \
                self._write_in_place(sums, config):
            model.reset_clipped_sums()
            return count
        device = self.named[0][1].device
        examples = model.examples
        # Several ranks: the example count (and under adaptive clipping the count of unclipped
        # examples, noised on rank 0) travel in the same buffer, one collective.
        tail = []
        if self.world > 1:
            tail = self._counts_to_send(count, examples, device)
        both = torch.cat([
            (sums[n] if n in sums else torch.zeros_like(p)).reshape(-1).to(torch.float32)
            for n, p in self.named] + tail)
        flat = both[:both.numel() - sum(t.numel() for t in tail)]
        if self.world <= 1 or rank_of(self.process_group) == 0:
            self.noise.add_release(flat, noise_std(model))
        if self.world > 1:
            try:
                dist.all_reduce(both, op=dist.ReduceOp.SUM, group=self.process_group)
            except RuntimeError as e:
                raise peer_error(steps, self.process_group, e) from e
            examples = int(both[-1].item())
            self._counts_received(both[-2] if len(tail) == 2 else None, examples)
            count = None
        flat /= self._denominator(examples)
        offset = 0
        for name, p in self.named:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).to(p.dtype).clone()
            self.gate.ledger.released(name, p)     # the inner step's pre-hooks may edit it
            offset += n
        model.reset_clipped_sums()
        return count

    def adapt(self, count, examples: int) -> None:
        """noise="optimizer" under adaptive clipping: the logical batch's count of unclipped
        examples noised once, N(0, sigma_b^2), and the bound moved (Note [Adaptive clipping] in
        privacy/adaptive.py). After the gradient's release, which used the step's C_t."""
        if count is None:
            return
        state = self.dp_model.adaptive_clip
        count = count.detach().to(torch.float32).reshape(1).clone()
        self.noise.add(count, state.count_noise_multiplier)
        config = self.dp_model.dp_config
        state.released(float(count), config.expected_batch_size or examples)

    # Note [Adaptive clipping over several ranks]
    # The count of unclipped examples is a sum over the global batch like the clipped sums: each
    # rank's raw centered count travels in the sums' collective, rank 0 adding the count's noise
    # N(0, sigma_b^2) once to its own (the same draw in every row of a reduce-scatter, so that
    # every rank receives the same noised total), and every rank moves the bound from that total
    # after the gradient's release: the ranks' bounds stay equal, and the count is noised once.
    # The gradient's noise is sigma_grad C_t, of the bound the step clipped to: the sharded step
    # receives the count with its sums, so it reads the std before the bound moves (noised at
    # C_{t+1}, a shrinking bound would leave the sums under-noised; tests/loop/test_noise_ranks.py).
    def _counts_to_send(self, count, examples: int, device) -> list:
        tail = []
        if self.dp_model.adaptive_clip is not None:
            mine = torch.zeros(1, dtype=torch.float32, device=device) if count is None else \
                count.detach().to(device=device, dtype=torch.float32).reshape(1).clone()
            if rank_of(self.process_group) == 0:
                self.noise.add(mine, self.dp_model.adaptive_clip.count_noise_multiplier)
            tail.append(mine)
        tail.append(torch.tensor([float(examples)], device=device))
        return tail

    def _counts_received(self, noised_count, examples: int) -> None:
        if noised_count is not None:
            config = self.dp_model.dp_config
            self.dp_model.adaptive_clip.released(float(noised_count),
                                                 config.expected_batch_size or examples)

    # Note [The optimizer's noise added where the sums lie]
    # In one process on the CPU, each clipped sum is noised and divided in place by one call of
    # the noise kernel (one key, stream t for the t-th parameter, as the graph's release) and
    # becomes p.grad: no flat copy of the model's gradients, no second copy per parameter. HF
    # GPT-2 small (124M), B = 4, on a 2-core AMD EPYC: 4.86 s a step with the flat buffer and a
    # buffer of normals, 3.69 s with the normals added to the flat buffer in place, 3.40 s so,
    # level with the graph's noise (benchmarks/latest/optimizer_noise.md). Several ranks (one
    # collective over the flat buffer), sums that share storage, 16-bit sums, secure_mode and
    # GPUs keep the flat buffer.
    def _write_in_place(self, sums: dict, config) -> bool:
        generator = self.noise.generator
        if self.noise.secure_mode or generator is None or generator.device.type != "cpu":
            return False
        tensors = []
        for n, p in self.named:
            t = sums.get(n)
            if t is None:
                t = torch.zeros(p.shape, dtype=torch.float32)
            if t.dtype != torch.float32 or t.device.type != "cpu" or p.device.type != "cpu" \
                    or p.dtype != torch.float32:
                return False
            tensors.append(t)
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        if len(storages) != len(tensors):
            return False
        divisor = self._denominator(self.dp_model.examples)    # may refuse: nothing changed yet
        std = noise_std(self.dp_model)
        if std:
            add_noise_keyed(tensors, std, 1.0, divisor, generator)
        else:
            for t in tensors:
                t.div_(divisor)
        for (name, p), t in zip(self.named, tensors):
            p.grad = t
            self.gate.ledger.released(name, p)     # the inner step's pre-hooks may edit it
        return True

    def sharded(self, count, steps: int):
        """Note [Sharded DP-SGD] in loop/fsdp.py: one reduce-scatter of the clipped sums; this rank
        noises and writes the coordinates it owns. The adaptive count goes with them (Note
        [Adaptive clipping over several ranks])."""
        model, sharding = self.dp_model, self.dp_model._sharding
        sharding.release()
        if not self.named:
            return count
        device = self.named[0][1].device
        std = noise_std(model)      # of C_t, the bound this step clipped to, before it moves
        tail = self._counts_to_send(count, model.examples, device)
        try:
            mine, counts = sharding.reduce_scatter(model.clipped_sums, torch.cat(tail), device)
        except RuntimeError as e:
            raise peer_error(steps, sharding.group, e) from e
        examples = int(round(float(counts[-1])))
        self._counts_received(counts[0] if len(tail) == 2 else None, examples)
        divisor = self._denominator(examples)
        if self.noise.mechanism is not None:       # one state over this rank's coordinates
            flat = torch.cat([mine[name] for name in sharding.names])
            self.noise.add_release(flat, std)
            for name, part in zip(sharding.names, flat.split(
                    [mine[name].numel() for name in sharding.names])):
                mine[name] = part
        for name in sharding.names:          # this rank's coordinates, in one order on every rank
            if self.noise.mechanism is None:
                self.noise.add(mine[name], std)
            mine[name] /= divisor
        sharding.write_grads(mine, self.gate.ledger)
        model.reset_clipped_sums()
        return None

    def _denominator(self, examples: int) -> float:
        self.divisor = self._divide_by(examples)
        return self.divisor

    def _divide_by(self, examples: int) -> float:
        config = self.dp_model.dp_config
        if config.loss_reduction == "sum":
            return 1.0
        if config.expected_batch_size is not None:
            return float(config.expected_batch_size)
        if examples == 0:
            raise ValueError("empty logical batch with loss_reduction='mean' and no "
                             "expected_batch_size: DP-SGD would divide by 0. Pass "
                             "expected_batch_size to dpfx.compile (Poisson sampling's q*N)")
        return float(examples)
