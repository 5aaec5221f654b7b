"""``opacus.utils`` over dpfx: ``batch_memory_manager.BatchMemoryManager``."""
