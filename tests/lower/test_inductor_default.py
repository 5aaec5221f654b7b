"""Inductor (the backend users run) in the default suite, with the self-check on: every rule family
in its materialized form, and a small Hugging Face GPT-2.

``Families`` gives each rule family one parameter of its own: ``mm`` (a Linear weight),
``sum`` (biases, LayerNorm affine), ``convolution`` (Conv1d), ``embedding`` (nn.Embedding with a
padding index), a lift rule (a positional parameter sliced to the sequence, ``pos[:, :T]``:
``slice_scatter`` into zeros), and the vmap fallback (per-head weights through ``einsum``, a
``bmm`` over the batch). Each test compares dpfx with sigma = 0 against the batch-of-one reference
(tests/support/reference.py) with clipping that bites on every example, at batch sizes 0, 1 and more
through one compiled pair (the rule families with the mean loss, GPT-2 with the sum), asserts
which rules fired and that the self-check ran on the compiled pair. The LSTM through Inductor in
the default suite is tests/capture/test_rnn.py::test_inductor_char_lstm.
"""
import collections
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from dpfx import rules
from dpfx.rules.fallback import FallbackWarning
from support.models import FRONTIER_RULES, Families
from support.reference import CLIP_EPS, assert_close, loop_dp_sgd_grads, run_dpfx_multi

C, D = 0.05, 4


def _count_lift_rules(monkeypatch) -> collections.Counter:
    fired = collections.Counter()
    for target, rule in list(rules.LIFT.items()):
        def lift(node, ps_args, ctx, rule=rule):
            fired[rule.name] += 1
            return rule.lift(node, ps_args, ctx)
        monkeypatch.setitem(rules.LIFT, target, dataclasses.replace(rule, lift=lift))
    return fired


def _example_norms(model, loss_fn, inputs, y) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for i in range(y.shape[0]):
        loss = loss_fn(model(*(t[i:i + 1] for t in inputs)), y[i:i + 1])
        grads = torch.autograd.grad(loss, params)
        norms.append(float(torch.sqrt(sum(g.pow(2).sum() for g in grads))))
    return norms


def _check(dp, model, loss_fn, make, batches, reduction):
    """dpfx (noise off) against the batch-of-one reference at each batch size, one compile."""
    for b in batches:
        inputs, y = make(b)
        assert all(n > C + CLIP_EPS for n in _example_norms(model, loss_fn, inputs, y))
        got = run_dpfx_multi(dp, model, loss_fn, inputs, y, reduction)
        want = loop_dp_sgd_grads(model, loss_fn, inputs, y, max_grad_norm=C,
                                 loss_reduction="sum")
        if reduction == "mean":
            want = {k: v / D for k, v in want.items()}
        try:
            assert_close(got, want, rtol=2e-4, atol=1e-6)
        except AssertionError as e:
            raise AssertionError(f"batch size {b}: {e}") from None
    assert dp.compile_count == 2
    checks = list(dp._dpfx_backend._checks.values())
    assert checks and all(c.done and c.backward is not None for c in checks), \
        "the self-check must have run on the compiled forward and backward"


def test_every_rule_family_materialized(monkeypatch):
    fired = _count_lift_rules(monkeypatch)
    torch.manual_seed(0)
    model = Families()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=D,
                      strategy="materialize")
    assert dp.dp_config.backend == "inductor" and dp.dp_config.self_check

    def make(b):
        g = torch.Generator().manual_seed(b)
        return (torch.randint(0, 11, (b, 5), generator=g),), torch.arange(b) % 3

    with pytest.warns(FallbackWarning, match="'heads'"):
        _check(dp, model, F.cross_entropy, make, [4, 0, 1, 3], "mean")
    params = dp._dpfx_backend.param_grads
    assert {pg.name: pg.rules for pg in params} == FRONTIER_RULES
    assert {pg.strategy for pg in params} == {"materialize"}
    assert fired["scatter_into_zeros"] > 0     # pos[:, :T]


def test_gpt2_tiny():
    transformers = pytest.importorskip("transformers")
    vocab, t = 13, 4
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=vocab, n_positions=t, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = transformers.GPT2LMHeadModel(config)

        def forward(self, ids, mask):   # the mask keeps transformers off a batch-size branch
            return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    def lm_loss(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    def make(b):
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(1, vocab, (b, t), generator=g)
        return (ids, torch.ones(b, t, dtype=torch.long)), torch.randint(0, vocab, (b, t),
                                                                        generator=g)

    torch.manual_seed(0)
    model = LM()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction="sum")
    _check(dp, model, lm_loss, make, [3, 0, 1], "sum")
    fired = {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}
    assert fired["model.transformer.h.0.mlp.c_fc.weight"] == ["mm"]
    assert sorted(fired["model.transformer.wte.weight"]) == ["embedding", "mm"]  # tied LM head
