"""DP preference optimization through TRL: ``DPDPOTrainer``, TRL's ``DPOTrainer`` with DP-SGD.

    trainer = dpfx.trl.DPDPOTrainer(
        model=model, args=trl.DPOConfig(output_dir="out", per_device_train_batch_size=16,
                                        loss_type="sigmoid", beta=0.1,
                                        precompute_ref_log_probs=True),
        train_dataset=pairs, processing_class=tokenizer, peft_config=LoraConfig(r=8, ...),
        target_epsilon=8.0, max_grad_norm=1.0)      # DPTrainer's options; epsilon per pair
    trainer.train()

``DPOTrainer`` prepares the pairs (prompt, chosen, rejected: tokenized, chat templates,
truncation) and the reference log-probabilities (precomputed, a frozen ``ref_model``, or the
PEFT model with its adapter off); ``DPTrainer`` plans and trains privately (Note [A TRL trainer
over DPTrainer] in _private.py), the preference pair being the unit.

# Note [A pair is one row]
TRL's collator stacks a batch's B chosen sequences and then its B rejected ones, so that pair i
is rows i and B + i of a (2B, T) batch. Here the collator's output is laid out as (B, 2, T)
(``PairRows``: row i holds pair i's chosen and rejected sequences, nothing else) and the policy
runs under ``dpfx.per_user`` with k = 2: it flattens the (B, 2, T) batch to 2B rows inside
dpfx's graph, where the batch analysis proves that what reads across the two rows of a pair
stays within the pair (the merged batch dim of docs/ARCHITECTURE.md, "Merged batch dims"), and
returns (B, 2, T, V) logits. The loss is then a function of each pair alone: the two sequences'
summed completion log-probs under the policy (``sequence_logps``), minus the reference's, into
the pair's preference loss (``PAIR_LOSSES``), averaged over the pairs; the loss check proves it
a sum of per-pair terms and removes the 1/B. Each pair's gradient, chosen and rejected
together, is clipped to C as one, and the accountant counts the pair-level q: epsilon is per
pair (``privacy_unit`` "pair").

# Note [The reference is a constant]
The reference log-probs enter each pair's loss as constants: precomputed on the dataset at
construction (``precompute_ref_log_probs=True``: a column of each pair), or computed at each step
under ``torch.no_grad`` by the frozen ``ref_model``, or by the PEFT policy with its adapter off
(the base model), each pair's rows run as rows of their own. No gradient reaches them, and each
is a function of its own pair and of a model that is not trained (or, with ``sync_ref_model``,
one made from the released policy).

# Note [What is refused in DPO]
Losses that read across the batch: ``aot`` and ``aot_unpaired`` sort the batch's log-ratios, so
a pair's loss depends on the others'. TRL's logged metrics (rewards, margins, accuracies,
log-probs) are averaged over the batch from detached values, outside the gradient; like the
loss, they are not private. Also refused: the user level (``user_column``), ``use_weighting``
(WPO's weights come from TRL's fused LM head), ``ld_alpha``, ``f_divergence_type`` other than
"reverse_kl", the loss types not in ``PAIR_LOSSES``, a Mixture-of-Experts load-balancing loss,
activation offloading and Liger kernels. Activation checkpointing (DPOConfig's default) trains:
the pair's merged rows are followed through the recomputed blocks (Note [An op run under a
saved RNG state] in graph/rng_wrappers.py). (tests/hf/test_trl_dpo.py)
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import trl

from dpfx.loss import track as loss_track
from dpfx.loss.track import untrack
from dpfx.trl._private import DPTrainerUnderTRL, PrivateTRL
from dpfx.trl.sft import _router_aux_loss

PAIR_ROWS = ("input_ids", "attention_mask", "completion_mask")


def sequence_logps(logits: torch.Tensor, input_ids: torch.Tensor,
                   completion_mask: torch.Tensor) -> torch.Tensor:
    """(..., T, V) logits -> (...): each sequence's summed log-probability of its completion
    tokens (token t + 1 predicted from position t)."""
    logp = logits[..., :-1, :].float().log_softmax(-1)
    token = logp.gather(-1, input_ids[..., 1:].unsqueeze(-1)).squeeze(-1)
    return (token * completion_mask[..., 1:]).sum(-1)


# Each pair's loss from its chosen and rejected log-ratios against the reference (c, r) and its
# completions' token counts (lc, lr), as DPOConfig's loss_type names them.
PAIR_LOSSES = {
    # DPO (Rafailov et al. 2023, eq. 7)
    "sigmoid": lambda beta, c, r, lc, lr: -F.logsigmoid(beta * (c - r)),
    # SLiC's hinge (Zhao et al. 2023)
    "hinge": lambda beta, c, r, lc, lr: torch.relu(1 - beta * (c - r)),
    # IPO (Azar et al. 2023, eq. 17), on per-token log-ratios as TRL computes it
    "ipo": lambda beta, c, r, lc, lr: (c / lc - r / lr - 1 / (2 * beta)) ** 2,
    # DPO on per-token log-ratios
    "sigmoid_norm": lambda beta, c, r, lc, lr: -F.logsigmoid(beta * (c / lc - r / lr)),
}


class PairRows:
    """TRL's preference collator with the pair as the row: (2B, T) [chosen; rejected] tensors
    become (B, 2, T), row i holding pair i's chosen and rejected sequences (Note [A pair is one
    row])."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, examples):
        batch = self.collator(examples)
        pairs = len(examples)
        return {k: v.unflatten(0, (2, pairs)).transpose(0, 1).contiguous() if k in PAIR_ROWS
                else v for k, v in batch.items()}


class DPDPOTrainer(PrivateTRL, trl.DPOTrainer, DPTrainerUnderTRL):
    """``trl.DPOTrainer`` training with DP-SGD, the preference pair as the unit of privacy: its
    arguments, and ``DPTrainer``'s keyword options (``max_grad_norm``, ``noise_multiplier`` or
    ``target_epsilon``, ``target_delta``, ``accountant``, ``clipping`` and its options,
    ``sampler_generator``, ``secure_mode``, ``ledger``, ``dp_kwargs``). The loss types of
    ``PAIR_LOSSES`` (several, with ``loss_weights``); Note [A pair is one row], Note [The
    reference is a constant], Note [What is refused in DPO]."""

    rows_per_example = 2

    def __init__(self, model=None, ref_model=None, args=None, **kwargs):
        users = sorted({"user_column", "user_ids", "max_examples_per_user"} & set(kwargs))
        if users:
            raise ValueError(
                f"DPDPOTrainer: {', '.join(users)} is not supported: the preference pair is the "
                f"unit of privacy (a pair's two sequences are the two rows dpfx clips as one, "
                f"Note [A pair is one row] in dpfx/trl/dpo.py), and user-level DPO is not "
                f"supported: remove {users[0]}")
        super().__init__(model, args, ref_model=ref_model, **kwargs)
        self.privacy_unit = "pair"
        self.data_collator = PairRows(self.data_collator)

    def check_trl_options(self, model, args, trl_kwargs: dict) -> None:
        super().check_trl_options(model, args, trl_kwargs)
        types = getattr(args, "loss_type", ["sigmoid"])
        types = [types] if isinstance(types, str) else list(types)
        across = [t for t in types if t in ("aot", "aot_unpaired")]
        if across:
            raise ValueError(
                f"DPDPOTrainer: loss_type {across[0]!r} sorts the batch's log-ratios, so one "
                f"pair's loss depends on the other pairs' and no per-pair clip bounds what one "
                f"pair changes. Use one of {sorted(PAIR_LOSSES)} (Note [What is refused in DPO] "
                f"in dpfx/trl/dpo.py)")
        unknown = [t for t in types if t not in PAIR_LOSSES]
        if unknown:
            raise ValueError(f"DPDPOTrainer trains the loss types {sorted(PAIR_LOSSES)}; "
                             f"loss_type {unknown[0]!r} is not supported")
        refused = {
            "use_weighting": getattr(args, "use_weighting", False),
            "ld_alpha": getattr(args, "ld_alpha", None) is not None,
            "f_divergence_type (other than 'reverse_kl')":
                getattr(args, "f_divergence_type", "reverse_kl") != "reverse_kl",
            "a Mixture-of-Experts load-balancing loss (router_aux_loss_coef=0.0 turns it off)":
                _router_aux_loss(model, args),
            "activation_offloading": getattr(args, "activation_offloading", False),
            "use_liger_kernel": getattr(args, "use_liger_kernel", False),
        }
        named = [k for k, on in refused.items() if on]
        if named:
            raise ValueError(f"DPDPOTrainer: {', '.join(named)} is not supported; leave it at "
                             f"its default (Note [What is refused in DPO] in dpfx/trl/dpo.py)")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Note [A pair is one row]: the mean over the pairs of each pair's loss."""
        mode = "train" if self.model.training else "eval"
        ids, completion = inputs["input_ids"], inputs["completion_mask"]
        outputs = model(input_ids=ids, attention_mask=inputs["attention_mask"], use_cache=False)
        reference = self._reference_logps(inputs)
        with loss_track.arranging():    # the trainer's own loss: the 1/B is dpfx's to remove
            logps = sequence_logps(outputs.logits, ids, completion)       # (B, 2)
            lengths = completion.sum(-1).clamp(min=1)
            ratios = logps - reference
            loss = 0.0
            for loss_type, weight in zip(self.loss_types, self.loss_weights, strict=True):
                per_pair = PAIR_LOSSES[loss_type](self.beta, ratios[:, 0], ratios[:, 1],
                                                  lengths[:, 0], lengths[:, 1])
                loss = loss + per_pair.mean() * weight
        self._log_pair_metrics(mode, untrack(logps).detach(), untrack(ratios).detach())
        return (loss, outputs) if return_outputs else loss

    @torch.no_grad()
    def _reference_logps(self, inputs) -> torch.Tensor:
        """(B, 2): each pair's reference log-probs, constants (Note [The reference is a
        constant])."""
        if "ref_chosen_logps" in inputs:
            return untrack(torch.stack([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]],
                                       dim=1)).float()
        ids, mask, completion = (untrack(inputs[k]) for k in PAIR_ROWS)
        if not ids.numel():             # an empty Poisson batch: a model may not take 0 rows
            return torch.zeros(ids.shape[:2], device=ids.device)
        rows = dict(input_ids=ids.flatten(0, 1), attention_mask=mask.flatten(0, 1),
                    use_cache=False)
        if self.ref_model is not None:
            logits = self.ref_model(**rows).logits
        else:
            from trl.trainer.utils import use_adapter

            policy = self.model._orig_mod.module       # the user's (PEFT) model
            name = "ref" if "ref" in getattr(policy, "peft_config", {}) else None
            with use_adapter(policy, adapter_name=name):
                logits = policy(**rows).logits
        return sequence_logps(logits.unflatten(0, ids.shape[:2]), ids, completion)

    def _log_pair_metrics(self, mode: str, logps, ratios) -> None:
        """DPOTrainer's reward metrics from detached values (not in the gradient)."""
        metrics = self._metrics[mode]
        if not len(logps):
            return
        rewards = self.beta * ratios
        metrics["rewards/chosen"].append(float(rewards[:, 0].mean()))
        metrics["rewards/rejected"].append(float(rewards[:, 1].mean()))
        metrics["rewards/accuracies"].append(float((rewards[:, 0] > rewards[:, 1]).float().mean()))
        metrics["rewards/margins"].append(float((rewards[:, 0] - rewards[:, 1]).mean()))
        metrics["logps/chosen"].append(float(logps[:, 0].mean()))
        metrics["logps/rejected"].append(float(logps[:, 1].mean()))
