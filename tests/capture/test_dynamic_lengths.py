"""A model recompiled for a new sequence length (dynamo makes the length dynamic) still serves
every batch size, 0 included. GPT-2's ``key_states.view(*shape[:-1], -1, head_dim)`` over a
dynamic length made torch divide by the batch times the length, with a runtime assertion that
the product is not 0, which failed the empty Poisson batch: the -1 is now filled in where sympy
divides the sizes exactly (``_explicit_sizes`` in capture/swaps.py). Each step against a
batch-of-one loop through the default backend."""
import pytest
import torch
import torch.nn.functional as F

import dpfx
from support.reference import assert_close, loop_dp_sgd_grads

transformers = pytest.importorskip("transformers")
V = 31


def _token_sum(out, labels):
    return F.cross_entropy(out.logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1),
                           reduction="sum")


@pytest.mark.filterwarnings("ignore::dpfx.LossScaleWarning")
def test_a_new_sequence_length_then_an_empty_batch():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=V, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    model.config._attn_implementation = "eager"
    dp = dpfx.compile(model, max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=2)
    g = torch.Generator().manual_seed(0)
    for batch, length in ((2, 12), (3, 17), (0, 14), (1, 9)):
        ids = torch.randint(1, V, (batch, length), generator=g)
        model.zero_grad(set_to_none=True)
        dp(input_ids=ids, labels=ids).loss.backward()
        got = {k: (p.grad if p.grad is not None else torch.zeros_like(p))
               for k, p in model.named_parameters()}
        want = loop_dp_sgd_grads(model, _token_sum, (), ids, max_grad_norm=0.5,
                                 kwargs=dict(input_ids=ids), expected_batch_size=2)
        assert_close(got, want, rtol=1e-4, atol=1e-6)
