"""A loss whose terms need their own scales may read a model output that has no gradient
history (a mask the model computes from its ids): it is a constant of each example's term, as a
label is. Through the default backend against a batch-of-one loop, with clipping that bites."""
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from support.reference import (assert_close, bound_that_bites, clipped_sum, loop_grads,
                               per_example_norms)

V, T, K = 5, 4, 3


class _WithMask(nn.Module):
    """Token logits, class logits and a mask computed from the ids (no gradient history)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.tok = nn.Linear(8, V)
        self.cls = nn.Linear(8, K)

    def forward(self, ids):
        h = torch.tanh(self.emb(ids))
        return self.tok(h), self.cls(h.mean(1)), (ids > 0).float()


def _loss(outs, tokens, labels):
    """A token mean plus a mean over examples weighted by the model's mask."""
    tok, cls, mask = outs
    return F.cross_entropy(tok.reshape(-1, V), tokens.reshape(-1), ignore_index=-100) + (
        F.cross_entropy(cls, labels, reduction="none") * mask[:, 0]).mean()


def _example_term(outs, tokens, labels):
    """Example i's own term: its token sum plus its weighted class loss."""
    tok, cls, mask = outs
    return F.cross_entropy(tok.reshape(-1, V), tokens.reshape(-1), ignore_index=-100,
                           reduction="sum") + F.cross_entropy(cls, labels) * mask[0, 0]


def _batch(batch):
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, 11, (batch, T), generator=g)
    ids[0, 0] = 0                                       # one example's mask is 0
    tokens = torch.randint(0, V, (batch, T), generator=g)
    tokens[0, :2] = -100
    return ids, tokens, torch.randint(0, K, (batch,), generator=g)


def test_a_term_weighted_by_an_output_without_gradient_history_trains():
    model = _WithMask()
    batches = {b: _batch(b) for b in (4, 1, 3)}
    each = {b: loop_grads(model, lambda i, ids=ids, tok=tok, y=y: _example_term(
        model(ids[i:i + 1]), tok[i:i + 1], y[i:i + 1]), b) for b, (ids, tok, y) in batches.items()}
    bound = bound_that_bites(torch.cat([per_example_norms(g) for g in each.values()]))
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0)
    for b, (ids, tokens, labels) in batches.items():
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dpfx.LossScaleWarning)   # the token count, removed
            _loss(dp(ids), tokens, labels).backward()
        got = {k: p.grad for k, p in model.named_parameters()}
        assert_close(got, clipped_sum(each[b], bound, b), rtol=1e-4, atol=1e-6)
