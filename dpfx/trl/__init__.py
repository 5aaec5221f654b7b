"""DP fine-tuning through TRL: ``DPSFTTrainer`` (supervised, on instructions and chats) and
``DPDPOTrainer`` (preference pairs), TRL's trainers with ``dpfx.hf.DPTrainer``'s DP-SGD.

    import dpfx.trl
    trainer = dpfx.trl.DPSFTTrainer(model=model, args=trl.SFTConfig(...), train_dataset=chats,
                                    processing_class=tokenizer, target_epsilon=8.0)

Needs ``trl`` (``pip install dpfx[trl]``). The unit of privacy is an example in SFT and a
preference pair in DPO: docs/alignment.md.
"""
from dpfx.trl.dpo import DPDPOTrainer
from dpfx.trl.sft import DPSFTTrainer

__all__ = ["DPDPOTrainer", "DPSFTTrainer"]
