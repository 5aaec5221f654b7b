"""Hugging Face models called with ``labels=``: the loss computed outside dpfx's graph.

    out = dp_model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()        # the model's own loss, on the tracked logits, checked

A Hugging Face model given ``labels=`` computes its loss inside its forward: a mean over the
batch's tokens or examples, which the forward check would refuse as mixing examples (and
rightly: the loss is not an output dpfx can clip per example). dpfx takes the labels out of the
call, runs the model without them, and applies the same loss to the tracked logits after the
graph, where the loss check proves it a sum of per-example terms and removes its normalizer
(Note [The per-example term] in loss/check.py). The value in ``out["loss"]`` is the model's.

By the model's head (its class name, or a PEFT wrapper's base model's):

- causal LM (``...ForCausalLM``, ``...LMHeadModel``): the model's own ``loss_function``
  (shifted tokens, ``ignore_index=-100``, ``num_items_in_batch`` when passed);
- masked LM (``...ForMaskedLM``) and token classification (``...ForTokenClassification``):
  cross-entropy over the flattened tokens with ``ignore_index=-100``;
- sequence-to-sequence (``...ForConditionalGeneration`` with ``config.is_encoder_decoder``):
  ``decoder_input_ids`` made from the labels by the model's own
  ``prepare_decoder_input_ids_from_labels`` (a shift within each example) when not given, then
  the token cross-entropy;
- sequence, image, audio and video classification (``...ForSequenceClassification``,
  ``...ForImageClassification``, ...): transformers' ``ForSequenceClassificationLoss``, which
  its loss mapping gives all four (regression, single- or multi-label by ``problem_type``);
- multiple choice (``...ForMultipleChoice``): cross-entropy over the (B, choices) logits;
- extractive question answering (``...ForQuestionAnswering``, called with ``start_positions=``
  and ``end_positions=`` instead of labels): transformers' ``ForQuestionAnsweringLoss`` on the
  start and end logits (the mean of the two cross-entropies, positions outside the sequence
  ignored).

Any other head given ``labels=`` is refused with the fix (call it without labels and compute the
loss on the logits).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dpfx.errors import PrivacyError

# Heads by the suffix of their class name: causal language models, and the heads whose loss is
# a cross-entropy per token (hf/users.py reads both: their losses are token means)
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")
TOKEN_HEADS = ("ForMaskedLM", "ForTokenClassification")
_CLASSIFIERS = ("ForSequenceClassification", "ForImageClassification", "ForAudioClassification",
                "ForVideoClassification")
# Heads whose loss flattens every leading dim: under ``per_user`` (a model with
# ``flattens_users``) their labels come as (U, k, ...) and the logits as (U, k, ...), and the
# loss reads the U * k rows as it reads a batch's. Sequence-to-sequence labels are shifted, and
# multiple choice and question answering index, along dim 1, which is k there: refused.
_PER_USER = CAUSAL_HEADS + TOKEN_HEADS + _CLASSIFIERS


def hf_labels_loss(model: torch.nn.Module, kwargs: dict):
    """None when the model is not a Hugging Face one or the call has neither ``labels=`` (a
    question-answering head's two positions) nor Trainer's ``num_items_in_batch``; else (kwargs for the model without them, the loss as a
    function of the model's output, or None without labels)."""
    if not hasattr(model, "config"):
        return None
    qa = _question_answering_loss(model, kwargs)
    if qa is not None:
        return qa
    labels = kwargs.get("labels")
    if not isinstance(labels, torch.Tensor):
        if "num_items_in_batch" in kwargs:
            # Trainer's count of the accumulated batch's tokens, for the model's own loss
            # normalizer: no loss here, and dpfx removes that normalizer from every example's
            # term anyway (Note [The per-example term] in loss/check.py)
            return {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}, None
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name, config = type(base).__name__, base.config
    if getattr(model, "flattens_users", False) and not name.endswith(_PER_USER):
        _refuse_per_user(name)
    kwargs = {k: v for k, v in kwargs.items() if k != "labels"}
    # Trainer's token count of the accumulated batch: the causal LM loss divides by it, every
    # other head ignores it (its normalizer is removed from each example's term either way)
    extra = {k: kwargs.pop(k) for k in ("num_items_in_batch",) if k in kwargs}
    if name.endswith(CAUSAL_HEADS) and hasattr(base, "loss_function"):
        return kwargs, lambda out: base.loss_function(
            out.logits, labels, vocab_size=config.vocab_size, **extra)
    if name.endswith(TOKEN_HEADS):
        return kwargs, lambda out: _token_cross_entropy(out.logits, labels)
    if name.endswith("ForConditionalGeneration") and getattr(config, "is_encoder_decoder", False) \
            and hasattr(base, "prepare_decoder_input_ids_from_labels"):
        if kwargs.get("decoder_input_ids") is None and kwargs.get("decoder_inputs_embeds") is None:
            kwargs["decoder_input_ids"] = base.prepare_decoder_input_ids_from_labels(labels=labels)
        return kwargs, lambda out: _token_cross_entropy(out.logits, labels)
    if name.endswith(_CLASSIFIERS):
        from transformers.loss.loss_utils import ForSequenceClassificationLoss

        return kwargs, lambda out: ForSequenceClassificationLoss(labels, out.logits, config)
    if name.endswith("ForMultipleChoice"):
        return kwargs, lambda out: F.cross_entropy(out.logits, labels)
    raise PrivacyError(
        f"{name} computes its loss from labels= inside its forward, which would mix the batch's "
        f"examples in dpfx's graph; dpfx computes it outside for causal and masked language "
        f"models, sequence-to-sequence models, sequence, token, image, audio and video "
        f"classifiers, multiple choice and question answering. Call the model without labels= "
        f"and compute the loss on out.logits.")


_QA_TARGETS = ("start_positions", "end_positions")


def _question_answering_loss(model: torch.nn.Module, kwargs: dict):
    """For a question-answering head called with both positions: (kwargs without them and
    without Trainer's token count, the model's loss on the output's start and end logits)."""
    if not all(isinstance(kwargs.get(k), torch.Tensor) for k in _QA_TARGETS):
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not type(base).__name__.endswith("ForQuestionAnswering"):
        return None
    if getattr(model, "flattens_users", False):
        _refuse_per_user(type(base).__name__)
    from transformers.loss.loss_utils import ForQuestionAnsweringLoss

    start, end = (kwargs[k] for k in _QA_TARGETS)
    kwargs = {k: v for k, v in kwargs.items() if k not in _QA_TARGETS}
    extra = {k: kwargs.pop(k) for k in ("num_items_in_batch",) if k in kwargs}
    return kwargs, lambda out: ForQuestionAnsweringLoss(out.start_logits, out.end_logits, start,
                                                        end, **extra)


def _refuse_per_user(name: str):
    raise PrivacyError(
        f"{name} under per_user was given labels=: dpfx computes the labels= loss of (users, k, "
        f"...) batches for causal and masked language models, token and sequence classifiers, "
        f"whose losses read each of the U * k rows alone. Call the model without labels= and "
        f"compute each user's loss on out.logits, masked per user (docs/users.md, \"The "
        f"loss\").")


def _token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), labels.view(-1),
                           ignore_index=-100)
