"""Hugging Face causal LMs called with ``labels=``: dpfx runs the model without them and computes
the model's own loss on the tracked logits, where the loss check sees it (a token mean over the
batch's non-ignored tokens, whose count dpfx divides out: each example's gradient is that of its
own token sum). The loss value equals the non-private one; the gradient equals a batch-of-one
reference.
"""
import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import dpfx
from dpfx.loss import verdicts as loss_verdicts
from support.reference import (assert_close, bound_that_bites, clipped_sum, loop_dp_sgd_grads,
                               loop_example_grads, loop_grads, per_example_norms)

transformers = pytest.importorskip("transformers")

VOCAB, T = 53, 6


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config)


def _batch(batch):
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, VOCAB, (batch, T), generator=g)
    mask = torch.ones(batch, T, dtype=torch.long)
    labels = ids.clone()
    labels[: batch // 2, T // 2:] = -100            # half the examples padded
    return ids, mask, labels


def _token_sum(out, labels):
    """Example i's own term: the sum over its shifted, non-ignored tokens."""
    return F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_gpt2_labels_loss_value_and_gradient(backend):
    # the warning below comes once per loss structure and process: forget the other backend's
    # verdicts, in the full path's cache and the steady state's
    loss_verdicts.forget()
    model = _gpt2()
    dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=0.0, backend=backend)
    for batch in (4, 1):
        ids, mask, labels = _batch(batch)
        with torch.no_grad():
            plain = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        model.zero_grad(set_to_none=True)
        out = dp(input_ids=ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(out.loss.detach().as_subclass(torch.Tensor), plain)
        # the token mean's count is divided out (warned once per loss structure)
        with pytest.warns(dpfx.LossScaleWarning) if batch == 4 else contextlib.nullcontext():
            out.loss.backward()
        got = {k: p.grad for k, p in model.named_parameters()}
        want = loop_dp_sgd_grads(model, _token_sum, (), labels, max_grad_norm=0.5,
                                 kwargs=dict(input_ids=ids, attention_mask=mask))
        assert_close(got, want, rtol=1e-4, atol=1e-6)


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))


def _bert_classifier(num_labels=3, problem_type=None):
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=num_labels, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, problem_type=problem_type))


def _bert_mlm():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _labels_for(kind, batch, g):
    if kind == "classifier":
        return torch.randint(0, 3, (batch,), generator=g)
    if kind == "regression":
        return torch.randn(batch, 1, generator=g)
    labels = torch.randint(1, VOCAB, (batch, T), generator=g)
    labels[: batch // 2 + 1, T // 2:] = -100
    return labels


MODELS = {  # kind: (model, the example's own term on a batch of one, from the model's logits)
    "t5": (_t5, lambda logits, y: F.cross_entropy(logits.view(-1, VOCAB), y.view(-1),
                                                  ignore_index=-100, reduction="sum")),
    "mlm": (_bert_mlm, lambda logits, y: F.cross_entropy(logits.view(-1, VOCAB), y.view(-1),
                                                         ignore_index=-100, reduction="sum")),
    "classifier": (_bert_classifier, lambda logits, y: F.cross_entropy(logits, y)),
    "regression": (lambda: _bert_classifier(1), lambda logits, y: F.mse_loss(logits, y)),
}


def _step_with_the_models_loss(model, dp, **call) -> None:
    """One private step on the head's own loss: ``out.loss`` is the model's value (NaN where
    the model's is), then its backward."""
    with torch.no_grad():
        plain = model(**call).loss
    model.zero_grad(set_to_none=True)
    out = dp(**call)
    torch.testing.assert_close(out.loss.detach().as_subclass(torch.Tensor), plain,
                               equal_nan=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpfx.LossScaleWarning)
        out.loss.backward()


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_hf_heads_with_labels(kind, backend):
    """Seq2seq, masked LM, sequence classification and regression heads called with labels=:
    the model's loss value, and each example's gradient of its own term (a token mean's count
    divided out) against a batch-of-one loop."""
    make, term = MODELS[kind]
    torch.manual_seed(0)
    model = make()
    model.train()
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, backend=backend)
    params = dict(model.named_parameters())
    for batch in (3, 1):
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(1, VOCAB, (batch, T), generator=g)
        mask = torch.ones(batch, T, dtype=torch.long)
        labels = _labels_for(kind, batch, g)
        _step_with_the_models_loss(model, dp, input_ids=ids, attention_mask=mask, labels=labels)

        def example_term(i):
            one = dict(input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1])
            if kind == "t5":
                one["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(
                    labels=labels[i:i + 1])
            return term(model(**one).logits, labels[i:i + 1])

        g = loop_grads(model, example_term, batch)
        assert (per_example_norms(g) > 0.05).all(), "clipping must bite"
        got = {k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in params.items()}
        assert_close(got, clipped_sum(g, 0.05, batch), rtol=1e-4, atol=1e-6)


def _bert_qa():
    return transformers.BertForQuestionAnswering(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_question_answering_with_positions(backend):
    """An extractive QA head called with start_positions= and end_positions= (SQuAD training):
    the model's loss value, and each example's gradient of its own term, the sum of its start
    and end cross-entropies (the mean of the two and their batch means divided out), against a
    batch-of-one loop. Example 0's start lies outside the sequence (ignored): at B = 3 the two
    terms' counts differ, and at B = 1 the start term is empty (the model's loss is NaN) and
    only the end term is released, on the same scale."""
    torch.manual_seed(0)
    model = _bert_qa()
    model.train()
    bound = 4.0
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0, backend=backend)
    params = dict(model.named_parameters())
    clipped = unclipped = 0
    for batch in (3, 1):
        g = torch.Generator().manual_seed(batch)
        ids = torch.randint(1, VOCAB, (batch, T), generator=g)
        mask = torch.ones(batch, T, dtype=torch.long)
        start, end = (torch.randint(0, T, (batch,), generator=g) for _ in range(2))
        start[0] = T + 3
        positions = dict(start_positions=start, end_positions=end)
        _step_with_the_models_loss(model, dp, input_ids=ids, attention_mask=mask, **positions)

        def example_term(i):
            one = model(input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1])
            return sum(F.cross_entropy(logits, pos[i:i + 1].clamp(0, T), ignore_index=T,
                                       reduction="sum")
                       for logits, pos in ((one.start_logits, start), (one.end_logits, end)))

        g = loop_grads(model, example_term, batch)
        norms = per_example_norms(g)
        clipped, unclipped = clipped + (norms > bound).sum(), unclipped + (norms <= bound).sum()
        got = {k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in params.items()}
        assert_close(got, clipped_sum(g, bound, batch), rtol=1e-4, atol=1e-6)
    assert clipped and unclipped, "the bound must clip some examples and not others"


IMAGE_CLASSIFIERS = {
    "vit": lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)),
    "convnext": lambda: transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
        num_labels=3)),
}


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", sorted(IMAGE_CLASSIFIERS))
def test_image_classifiers_with_labels(kind, backend):
    """Image classification heads (ViT, ConvNeXt: fine-tuning on CIFAR-style data) called with
    pixel_values= and labels=: the model's loss value, and each example's gradient of its own
    cross-entropy against a batch-of-one loop, the bound clipping some examples."""
    torch.manual_seed(0)
    model = IMAGE_CLASSIFIERS[kind]()
    model.train()
    bound = {"convnext": 5.0, "vit": 5.8}[kind]     # between the examples' norms
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0, backend=backend)
    params = dict(model.named_parameters())
    norms = []
    for batch in (3, 1):
        g = torch.Generator().manual_seed(batch)
        pixels = torch.randn(batch, 3, 8, 8, generator=g)
        labels = torch.randint(0, 3, (batch,), generator=g)
        _step_with_the_models_loss(model, dp, pixel_values=pixels, labels=labels)
        g = loop_example_grads(model, lambda out, y: F.cross_entropy(out.logits, y), (), labels,
                               kwargs=dict(pixel_values=pixels))
        norms += per_example_norms(g).tolist()
        got = {k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in params.items()}
        assert_close(got, clipped_sum(g, bound, batch), rtol=1e-4, atol=1e-6)
    assert min(norms) < bound < max(norms), norms


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_multiple_choice_with_labels(backend):
    """A multiple-choice head (SWAG, RACE) called with (B, choices, T) ids and labels=: the
    model flattens the choices into the rows, (B * choices, T), and expands its default
    token_type_ids buffer to them (Note [A constant broadcast over k rows per example] in
    dpfx/graph/batch.py). The model's loss value, and each example's gradient of its own
    cross-entropy against a batch-of-one loop, the bound clipping some examples."""
    torch.manual_seed(0)
    model = transformers.BertForMultipleChoice(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    model.train()
    params = dict(model.named_parameters())
    data = []
    for batch in (3, 1):
        g = torch.Generator().manual_seed(batch)
        data.append((torch.randint(1, VOCAB, (batch, 3, T), generator=g),
                     torch.randint(0, 3, (batch,), generator=g)))
    grads = [loop_example_grads(model, lambda out, y: F.cross_entropy(out.logits, y), (), y,
                                kwargs=dict(input_ids=ids)) for ids, y in data]
    bound = bound_that_bites(torch.cat([per_example_norms(g) for g in grads]))
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0, backend=backend)
    for (ids, y), g in zip(data, grads):
        _step_with_the_models_loss(model, dp, input_ids=ids, labels=y)
        got = {k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in params.items()}
        assert_close(got, clipped_sum(g, bound, len(y)), rtol=1e-4, atol=1e-6)


def test_other_hf_heads_with_labels_refused():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32)
    model = transformers.BertForNextSentencePrediction(config)
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    ids = torch.randint(1, VOCAB, (3, T))
    with pytest.raises(dpfx.PrivacyError, match="without labels= and compute the loss on "
                                                "out.logits"):
        dp(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([0, 1, 0]))
