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

import dpfx
from support.reference import assert_close
from support.token_losses import CASES, lm_logits, reference, token_batch


# "gpt2" compiles the same graph as "gpt2-shifted" (the loss is outside it), its token sum the
# same as Llama's and T5's: slow.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "gpt2" else n
                                  for n in sorted(CASES)])
def test_token_loss_exact_through_inductor(name):
    make, loss, term = CASES[name]
    torch.manual_seed(0)
    model = make()
    model.train()
    ids, mask, labels = token_batch(3)
    want, bound = reference(model, term, ids, mask, labels)
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0)
    for batch in (3, 1):
        one = (ids[:batch], mask[:batch], labels[:batch])
        if batch != 3:
            want, _ = reference(model, term, *one, bound=bound)
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dpfx.LossScaleWarning)
            loss(lm_logits(dp, *one, model.config.is_encoder_decoder), one[2]).backward()
        got = {k: torch.zeros_like(p) if p.grad is None else p.grad
               for k, p in model.named_parameters() if p.requires_grad}
        assert_close(got, want, rtol=1e-4, atol=1e-6)
