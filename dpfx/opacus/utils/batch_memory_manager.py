"""Opacus's ``BatchMemoryManager`` over dpfx's virtual batches (``dpfx.VirtualBatches``).

    with BatchMemoryManager(data_loader=train_loader, max_physical_batch_size=128,
                            optimizer=optimizer) as memory_safe_data_loader:
        for x, y in memory_safe_data_loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()          # steps (noise once, count epsilon) at a logical batch's end

Each logical (Poisson) batch comes as physical batches of at most ``max_physical_batch_size``
rows; the optimizer skips every ``step()`` and ``zero_grad()`` but the last one's, so the clipped
sums add up and the noise is added once per logical batch (Note [Virtual batches] in
loop/optim.py). ``len()`` is the number of logical batches, where Opacus's estimates the number
of physical ones.
"""
from __future__ import annotations

from dpfx.loop.data import VirtualBatches
from dpfx.loop.optim import DPOptimizer


class BatchMemoryManager:
    def __init__(self, *, data_loader, max_physical_batch_size: int, optimizer: DPOptimizer):
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(f"optimizer must be the DPOptimizer PrivacyEngine.make_private "
                            f"returned, got {type(optimizer).__name__}")
        if optimizer.dp_model.dp_config.noise != "optimizer":
            raise ValueError("virtual batches noise once per logical batch at the optimizer: "
                             "make the run with dpfx.opacus.PrivacyEngine, or "
                             "dpfx.make_private(max_physical_batch_size=)")
        self.data_loader = data_loader
        self.max_physical_batch_size = max_physical_batch_size
        self.optimizer = optimizer
        self._loader = VirtualBatches(data_loader, max_physical_batch_size, optimizer)

    def __enter__(self) -> VirtualBatches:
        return self._loader

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.optimizer.signal_skip_step(False)


__all__ = ["BatchMemoryManager"]
