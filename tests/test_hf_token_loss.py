"""Hugging Face language models trained on a per-example token loss, through Inductor.

GPT-2, Llama and T5 built from tiny configs (random init, nothing downloaded), called as users call
them, and trained on the token loss as training scripts write it: per-token cross-entropy
reshaped by the labels' shape, each example's sum over its tokens, the batch mean
(``.view(y.shape).sum(1).mean()``), and transformers' own shifted causal-LM loss with
``ignore_index``. Each is exact against a batch-of-one loop (each example's gradient of its own
token sum, clipped with a bound that bites on about half the examples) at B = 3 and 1, through the
default Inductor backend with the self-check on.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

import dpfx
from support.reference import CLIP_EPS

transformers = pytest.importorskip("transformers")

VOCAB, T = 61, 6


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32))


def t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))


def _batch(n):
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(1, VOCAB, (n, T), generator=g)
    mask = torch.ones(n, T, dtype=torch.long)
    labels = torch.randint(1, VOCAB, (n, T), generator=g)
    labels[: n // 2 + 1, T - 2:] = -100                     # padded label positions
    return ids, mask, labels


def per_example_token_sum(logits, labels):
    """Per-token losses viewed by the labels' shape, each example's sum, the batch mean."""
    per_token = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1),
                                ignore_index=-100, reduction="none")
    return per_token.view(labels.shape).sum(1).mean()


def shifted_causal_lm(logits, labels):
    """transformers' ForCausalLMLoss: shifted, flattened, a token mean over non-ignored labels."""
    logits = logits[..., :-1, :].contiguous()
    labels = labels[..., 1:].contiguous()
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), labels.view(-1),
                           ignore_index=-100)


def shifted_token_sum(logits, labels):
    return F.cross_entropy(logits[..., :-1, :].reshape(-1, VOCAB), labels[..., 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")


def _logits(model, ids, mask, labels, seq2seq=False):
    if not seq2seq:
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    decoder_ids = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1].clamp(min=0)], 1)
    return model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits


def _reference(model, loss, ids, mask, labels, bound=None):
    seq2seq = model.config.is_encoder_decoder
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for i in range(ids.shape[0]):
        one = (ids[i:i + 1], mask[i:i + 1], labels[i:i + 1])
        g = torch.autograd.grad(loss(_logits(model, *one, seq2seq), one[2]), params,
                                allow_unused=True)
        grads.append([torch.zeros_like(p) if x is None else x for x, p in zip(g, params)])
    norms = sorted(float(torch.sqrt(sum(x.pow(2).sum() for x in g))) for g in grads)
    bound = bound if bound is not None else norms[len(norms) // 2] * (
        1.0 if len(norms) > 1 else 0.5)
    total = [torch.zeros_like(p) for p in params]
    for g in grads:
        factor = min(1.0, bound / (float(torch.sqrt(sum(x.pow(2).sum() for x in g))) + CLIP_EPS))
        for t, x in zip(total, g):
            t += x * factor
    return [t / ids.shape[0] for t in total], bound


CASES = {  # model, batch loss, the same example's term on a batch of one
    "gpt2": (gpt2, per_example_token_sum, per_example_token_sum),
    "gpt2-shifted": (gpt2, shifted_causal_lm, shifted_token_sum),
    "llama": (llama, per_example_token_sum, per_example_token_sum),
    "t5": (t5, per_example_token_sum, per_example_token_sum),
}


# "gpt2" compiles the same graph as "gpt2-shifted" (the loss is outside it), its token sum the
# same as Llama's and T5's: slow.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "gpt2" else n
                                  for n in sorted(CASES)])
def test_token_loss_exact_through_inductor(name):
    make, loss, term = CASES[name]
    torch.manual_seed(0)
    model = make()
    model.train()
    ids, mask, labels = _batch(3)
    want, bound = _reference(model, term, ids, mask, labels)
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    for batch in (3, 1):
        one = (ids[:batch], mask[:batch], labels[:batch])
        if batch != 3:
            want, _ = _reference(model, term, *one, bound=bound)
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dpfx.LossScaleWarning)
            loss(_logits(dp, *one, model.config.is_encoder_decoder), one[2]).backward()
        for p, w in zip(params, want):
            got = torch.zeros_like(p) if p.grad is None else p.grad
            torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-6)
