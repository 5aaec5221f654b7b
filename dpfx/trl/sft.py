"""DP supervised fine-tuning through TRL: ``DPSFTTrainer``, TRL's ``SFTTrainer`` with DP-SGD.

    trainer = dpfx.trl.DPSFTTrainer(
        model=model, args=trl.SFTConfig(output_dir="out", per_device_train_batch_size=16,
                                        gradient_accumulation_steps=4, num_train_epochs=2),
        train_dataset=chats, processing_class=tokenizer, peft_config=LoraConfig(r=8, ...),
        target_epsilon=8.0, max_grad_norm=1.0)      # DPTrainer's options
    trainer.train()

``SFTTrainer`` prepares the data as it always does (conversational or prompt-completion
datasets, chat templates, completion-only and assistant-only labels, truncation, PEFT);
``DPTrainer`` plans and trains privately (Note [A TRL trainer over DPTrainer] in _private.py):
Poisson batches over the prepared examples, q, sigma for ``target_epsilon``, gradient
accumulation as a virtual batch, every clip function, checkpoints with the accountant and the
budget kept on resume.

# Note [The SFT loss, per example]
SFTTrainer's loss is the negative log-likelihood of the batch's label tokens (the completion's
or the assistant's: the prompt is labelled -100) divided by their count. ``compute_loss``
computes it as the causal LM ``labels=`` loss of the compiled model's logits (loss/hf_labels.py):
the same tokens, the same shift, the same count. The loss check proves it a sum of per-example
terms (each example's summed token losses) and divides the batch's token count out (Note [The
per-example term] in loss/check.py): each example's gradient is the gradient of its own token
sum, clipped to C, and the step divides the noised sum by the expected batch size, as for any
``labels=`` loss. TRL's metrics (mean token accuracy, entropy, tokens seen) are computed from
the detached logits for the logs, outside the gradient; like the logged loss, they are not
private.

# Note [Packing is refused]
``packing=True`` concatenates several examples into one row, and ``padding_free=True`` the whole
batch into one row: dpfx's unit, a row, would then be several examples, clipped together, while
the accountant counts one. (Made private, this is user-level DP with the row as the user.)
Both are refused, as are the losses that read across the batch or outside the per-token
likelihood: ``loss_type="dft"``, label smoothing, ``compute_loss_func`` and a Mixture-of-Experts
router's load-balancing loss (over all the batch's tokens), and activation offloading and Liger
kernels, which replace parts of the forward dpfx compiles.
(tests/hf/test_trl_sft.py)
"""
from __future__ import annotations

import torch
import trl

from dpfx.loss.track import untrack
from dpfx.trl._private import DPTrainerUnderTRL, PrivateTRL


class DPSFTTrainer(PrivateTRL, trl.SFTTrainer, DPTrainerUnderTRL):
    """``trl.SFTTrainer`` training with DP-SGD: its arguments, and ``DPTrainer``'s keyword
    options (``max_grad_norm``, ``noise_multiplier`` or ``target_epsilon``, ``target_delta``,
    ``accountant``, ``clipping`` and its options, ``sampler_generator``, ``secure_mode``,
    ``ledger``, ``dp_kwargs``). The per-example term is the example's summed label-token loss
    (Note [The SFT loss, per example]); packing is refused (Note [Packing is refused])."""

    def check_trl_options(self, model, args, trl_kwargs: dict) -> None:
        super().check_trl_options(model, args, trl_kwargs)
        if getattr(args, "packing", False):
            raise ValueError(
                "DPSFTTrainer: packing=True puts several examples in one row, which dpfx would "
                "clip as one while the accountant counts one example. Set packing=False in the "
                "SFTConfig (Note [Packing is refused] in dpfx/trl/sft.py)")
        if getattr(args, "padding_free", False):
            raise ValueError(
                "DPSFTTrainer: padding_free=True flattens the whole batch into one row, which "
                "dpfx would clip as one example. Set padding_free=False in the SFTConfig")
        refused = {
            "loss_type='dft'": getattr(args, "loss_type", "nll") == "dft",
            "label_smoothing_factor": getattr(args, "label_smoothing_factor", 0) > 0,
            "a Mixture-of-Experts load-balancing loss (router_aux_loss_coef=0.0 turns it off)":
                _router_aux_loss(model, args),
            "activation_offloading": getattr(args, "activation_offloading", False),
            "use_liger_kernel": getattr(args, "use_liger_kernel", False),
            "compute_loss_func": trl_kwargs.get("compute_loss_func") is not None,
        }
        named = [k for k, on in refused.items() if on]
        if named:
            raise ValueError(
                f"DPSFTTrainer trains the per-token negative log-likelihood (loss_type='nll'), "
                f"each example's term its own token sum; {', '.join(named)} is not supported: "
                f"leave it at its default (Note [Packing is refused] in dpfx/trl/sft.py)")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Note [The SFT loss, per example]."""
        mode = "train" if self.model.training else "eval"
        kwargs = {k: v for k, v in inputs.items() if k not in ("labels", "seq_lengths")}
        outputs = model(**kwargs, labels=inputs["labels"], use_cache=False)
        self._log_token_metrics(mode, untrack(outputs.logits).detach(),
                                untrack(inputs["labels"]), untrack(inputs.get("attention_mask")))
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    @torch.no_grad()
    def _log_token_metrics(self, mode: str, logits, labels, attention_mask) -> None:
        """SFTTrainer's logged metrics, from the detached logits (not in the gradient)."""
        labels = labels[..., 1:]
        logits = logits[..., :-1, :].float()
        valid = labels != -100
        count = int(valid.sum())
        log_p = torch.log_softmax(logits, dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        correct = (logits.argmax(-1) == labels) & valid
        metrics = self._metrics[mode]
        metrics["entropy"].append(float(entropy[valid].sum()) / count if count else 0.0)
        metrics["mean_token_accuracy"].append(float(correct.sum()) / count if count else 0.0)
        if mode == "train" and attention_mask is not None:
            self._total_train_tokens += int(attention_mask.sum())
        metrics["num_tokens"] = [self._total_train_tokens]


def _router_aux_loss(model, args) -> bool:
    """Whether SFTTrainer would add a MoE router's load-balancing loss (over all the batch's
    tokens) to the loss."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None else None
    if text is None or not hasattr(text, "output_router_logits"):
        return False
    coef = getattr(args, "router_aux_loss_coef", None)
    return (getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef) != 0.0
