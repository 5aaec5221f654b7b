"""Hugging Face models built from small configs (random init), against the torch.func reference.

GPT-2 (``GPT2LMHeadModel``: LM head tied to the token embedding, Conv1D projections, learned
positions) and BERT (``BertForSequenceClassification``: token type and position embeddings,
LayerNorms, pooler), with dropout 0 so that the reference runs the same function. Each model sits
in a small wrapper whose forward takes one tensor with the batch in dim 0 and returns logits:
token ids and the attention mask travel stacked as (B, 2, T), because the reference maps one input
over the batch. (Without a mask, transformers' mask preprocessing compares the batch size with
a constant, which dpfx decides per batch size: tests/capture/test_model_families.py.) sigma = 0
and C small enough that every example is clipped.

The reference is tests/support/reference.py's batch-of-one loop with plain autograd, not its vmap:
the sdpa path and BERT's mask preparation branch on tensor values (``mask.all()``), which vmap
rejects.
"""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from support.models import xent, xent_over_positions
from support.reference import (assert_close, clipped_sum, loop_example_grads, per_example_norms,
                               run_dpfx)

transformers = pytest.importorskip("transformers")

VOCAB, T, C = 97, 8, 0.05


class LMLogits(nn.Module):
    """(B, 2, T) ids and mask -> (B, T, V) next-token logits of GPT-2."""

    def __init__(self, attn_implementation):
        super().__init__()
        config = transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        config._attn_implementation = attn_implementation
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, x):
        return self.model(input_ids=x[:, 0], attention_mask=x[:, 1], use_cache=False).logits


class ClassifierLogits(nn.Module):
    """(B, 2, T) ids and mask -> (B, 3) logits of a BERT sequence classifier."""

    def __init__(self, attn_implementation):
        super().__init__()
        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=0)
        config._attn_implementation = attn_implementation
        self.model = transformers.BertForSequenceClassification(config)

    def forward(self, x):
        return self.model(input_ids=x[:, 0], attention_mask=x[:, 1]).logits


def inputs(batch, padded):
    """Token ids and a mask; with ``padded``, each example's last tokens are padding."""
    ids = torch.randint(1, VOCAB, (batch, T))
    mask = torch.ones(batch, T, dtype=torch.long)
    if padded:
        for i in range(batch):
            mask[i, T - i:] = 0
    return torch.stack([ids, mask], 1)


def check(model, loss_fn, x, y, backend="eager", expected=5, reference=None):
    """dpfx equals the reference for B = len(x), 0 and 1 through one compiled graph. B = 0 needs
    dpfx.capture.swaps's explicit ``view(B, -1)``: traced as is, transformers' mask code leaves a
    runtime assertion that the batch is not 0 in the graph. ``reference``: a model with the same
    weights that computes the same function another way (without gradient checkpointing)."""
    model.train()
    reference = reference or model
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=expected,
                      backend=backend)
    tol = {"rtol": 1e-4, "atol": 1e-6} if backend == "inductor" else {"rtol": 1e-5, "atol": 1e-6}
    for batch in (x.shape[0], 0, 1):
        got = run_dpfx(dp, model, loss_fn, x[:batch], y[:batch])
        g = loop_example_grads(reference, loss_fn, (x[:batch],), y[:batch])
        assert (per_example_norms(g) > C).all(), "clipping must bite on every example"
        want = clipped_sum(g, C, expected)
        if batch == 0:
            assert all(torch.count_nonzero(g) == 0 for g in got.values())
        try:
            assert_close(got, want, **tol)
        except AssertionError as e:
            raise AssertionError(f"batch size {batch}: {e}") from None
    assert dp.compile_count == 2
    return {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}


@pytest.mark.filterwarnings("ignore::dpfx.LossScaleWarning")  # the loss's scale changed: expected
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2(attn):
    """Every parameter has a rule: the tied wte gets ``embedding`` + ``mm`` (the head), wpe a
    ``sum`` over the batch, GPT-2's Conv1D weights (x @ W + b via addmm) ``mm``."""
    torch.manual_seed(0)
    model = LMLogits(attn)
    x = inputs(3, padded=False)
    rules = check(model, xent_over_positions, x, torch.randint(0, VOCAB, (3, T)))
    assert sorted(rules["model.transformer.wte.weight"]) == ["embedding", "mm"], rules
    assert rules["model.transformer.wpe.weight"] == ["sum"], rules
    assert rules["model.transformer.h.0.attn.c_attn.weight"] == ["mm"], rules
    assert not any(r.startswith("vmap-fallback") for rs in rules.values() for r in rs), rules


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bert_classifier(attn):
    """BERT with padded examples: token, position and token-type tables, LayerNorms, pooler."""
    torch.manual_seed(0)
    model = ClassifierLogits(attn)
    x = inputs(3, padded=True)
    rules = check(model, xent, x, torch.randint(0, 3, (3,)))
    assert rules["model.bert.embeddings.word_embeddings.weight"] == ["embedding"], rules
    assert rules["model.classifier.weight"] == ["mm"], rules


def checkpointed(make):
    """A model with HF gradient checkpointing on, and one with the same weights without it."""
    torch.manual_seed(0)
    model = make()
    model.model.gradient_checkpointing_enable()
    torch.manual_seed(0)
    return model, make()


class GPT2LogitsDefaultCache(LMLogits):
    """use_cache left at its default: with checkpointing in training, GPT-2 logs that it turns the
    cache off (a logger call inside the forward)."""

    def forward(self, x):
        return self.model(input_ids=x[:, 0], attention_mask=x[:, 1]).logits


def test_gpt2_gradient_checkpointing():
    """``gradient_checkpointing_enable()`` (torch.utils.checkpoint around every block, captured as
    dynamo's checkpoint region): the same DP-SGD gradient as the model without it; the logger
    warning inside the forward does not break the graph."""
    model, plain = checkpointed(lambda: GPT2LogitsDefaultCache("sdpa"))
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    x = inputs(3, padded=False)
    rules = check(model, xent_over_positions, x, torch.randint(0, VOCAB, (3, T)), reference=plain)
    assert rules["model.transformer.h.1.mlp.c_fc.weight"] == ["mm"], rules


def test_bert_gradient_checkpointing():
    model, plain = checkpointed(lambda: ClassifierLogits("eager"))
    x = inputs(3, padded=True)
    check(model, xent, x, torch.randint(0, 3, (3,)), reference=plain)


def test_bert_gradient_checkpointing_after_an_earlier_capture(monkeypatch):
    """transformers adds ``warning_once`` to logging.Logger when it is imported, which may come
    after dpfx captured another model in the process: BERT's checkpointing warning (a
    ``warning_once`` inside the forward) is skipped all the same, after torch._dynamo.reset().
    dynamo's own set of skipped functions is a fresh one, as in a new process."""
    with torch._dynamo.config.patch(ignore_logging_functions=set()):
        with monkeypatch.context() as before_transformers:
            for name in ("warning_once", "info_once", "warning_advice"):
                before_transformers.delattr(logging.Logger, name, raising=False)
            first = nn.Linear(4, 3)
            dp = dpfx.compile(first, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
            F.cross_entropy(dp(torch.randn(4, 4)), torch.arange(4) % 3).backward()
        torch._dynamo.reset()
        model, plain = checkpointed(lambda: ClassifierLogits("eager"))
        check(model, xent, inputs(3, padded=True), torch.randint(0, 3, (3,)), reference=plain)


@pytest.mark.slow
def test_gpt2_inductor():
    torch.manual_seed(0)
    model = LMLogits("sdpa")
    check(model, xent_over_positions, inputs(3, padded=False), torch.randint(0, VOCAB, (3, T)),
          backend="inductor")
