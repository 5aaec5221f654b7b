"""Hugging Face language models from tiny configs (random init, nothing downloaded) and the token
losses training scripts write for them, with the batch-of-one reference of their gradient: each
example's gradient of its own token sum, clipped, summed, divided by B."""
import pytest
import torch
import torch.nn.functional as F

from support.reference import bound_that_bites, clipped_sum, loop_grads, per_example_norms

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


def token_batch(n):
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


def lm_logits(model, ids, mask, labels, seq2seq=False):
    if not seq2seq:
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    decoder_ids = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1].clamp(min=0)], 1)
    return model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits


CASES = {  # model, batch loss, the same example's term on a batch of one
    "gpt2": (gpt2, per_example_token_sum, per_example_token_sum),
    "gpt2-shifted": (gpt2, shifted_causal_lm, shifted_token_sum),
    "llama": (llama, per_example_token_sum, per_example_token_sum),
    "t5": (t5, per_example_token_sum, per_example_token_sum),
}


def reference(model, term, ids, mask, labels, bound=None):
    """({name: sigma = 0 DP-SGD gradient}, bound): each example's gradient of its own ``term``
    on a batch of one, clipped to ``bound`` (by default one that clips about half the examples),
    summed, divided by B."""
    seq2seq = model.config.is_encoder_decoder

    def example_term(i):
        one = (ids[i:i + 1], mask[i:i + 1], labels[i:i + 1])
        return term(lm_logits(model, *one, seq2seq), one[2])

    g = loop_grads(model, example_term, ids.shape[0])
    bound = bound_that_bites(per_example_norms(g)) if bound is None else bound
    return clipped_sum(g, bound, ids.shape[0]), bound
