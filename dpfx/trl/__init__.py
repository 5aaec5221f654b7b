"""DP fine-tuning through TRL: ``DPSFTTrainer`` (supervised, on instructions and chats) and
``DPDPOTrainer`` (preference pairs), TRL's trainers with ``dpfx.hf.DPTrainer``'s DP-SGD.

    import dpfx.trl
    trainer = dpfx.trl.DPSFTTrainer(model=model, args=trl.SFTConfig(...), train_dataset=chats,
                                    processing_class=tokenizer, target_epsilon=8.0)

Needs ``trl`` (``pip install dpfx[trl]``). The unit of privacy is an example in SFT and a
preference pair in DPO: docs/alignment.md.
"""
try:
    import trl  # noqa: F401
except ImportError as e:
    raise ImportError("dpfx.trl needs TRL: pip install 'dpfx[trl]' (trl==1.16.0)") from e

from dpfx.trl.dpo import DPDPOTrainer  # noqa: E402
from dpfx.trl.sft import DPSFTTrainer  # noqa: E402

__all__ = ["DPDPOTrainer", "DPSFTTrainer"]
