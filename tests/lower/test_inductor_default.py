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
import torch.nn.functional as F

import dpfx
from dpfx import rules
from dpfx.rules.fallback import FallbackWarning
from support.models import Families, FRONTIER_RULES, tiny_gpt2_lm
from support.reference import check_one_compiled_pair

C, D = 0.05, 4


def _count_lift_rules(monkeypatch) -> collections.Counter:
    fired = collections.Counter()
    for target, rule in list(rules.LIFT.items()):
        def lift(node, ps_args, ctx, rule=rule):
            fired[rule.name] += 1
            return rule.lift(node, ps_args, ctx)
        monkeypatch.setitem(rules.LIFT, target, dataclasses.replace(rule, lift=lift))
    return fired






def _check(dp, model, loss_fn, make, batches, reduction, tol=None):
    check_one_compiled_pair(dp, model, loss_fn, make, batches, reduction, max_grad_norm=C,
                            divisor=D, tol=tol)


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
    torch.manual_seed(0)
    model, lm_loss, make = tiny_gpt2_lm()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, loss_reduction="sum")
    _check(dp, model, lm_loss, make, [3, 0, 1], "sum")
    fired = {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}
    assert fired["model.transformer.h.0.mlp.c_fc.weight"] == ["mm"]
    assert sorted(fired["model.transformer.wte.weight"]) == ["embedding", "mm"]  # tied LM head
