"""An arange over the rows (Note [An arange over the rows] in dpfx/graph/batch.py) and the index
check (dpfx/passes/indexing.py).

HF builds its padding mask by indexing the mask's rows with ``arange(batch)``; under
``dpfx.per_user`` the rows are U * k, k per user. The arange holds no data and each of its values
is its own row's index, so indexing the rows with it reads each row's own: the tiny GPT-2 with an
attention mask trains at the user level, through Inductor with the self-check on, against the
loop over users of batch-of-one sequence gradients. An index into the batch dim by anything else
(an arange computed on, a fill) reads other rows, and is refused, at the user level and over a
plain batch alike.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from support.reference import assert_close, clipped_sum, loop_grads, per_example_norms

CLIP = 0.5


def _lm_loss(logits, ids, am):
    """Each sequence's summed next-token loss over the tokens its attention mask keeps."""
    per_token = F.cross_entropy(logits[..., :-1, :].flatten(0, -2), ids[..., 1:].flatten(),
                                reduction="none").view(ids[..., 1:].shape)
    return (per_token * am[..., 1:]).sum(-1)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_gpt2_with_attention_mask_per_user(backend):
    """Token ids and an attention mask (U, k, T), padding at the right of some sequences; one
    compiled pair for U = 3, 1 and 0; each user's summed loss over its real sequences, clipped as
    one, equals the loop over users of batch-of-one gradients (each sequence with its mask).
    Through Inductor, with the self-check on."""
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))
    k, T, expected = 2, 6, 2
    dp = dpfx.compile(dpfx.per_user(model), max_grad_norm=CLIP, noise_multiplier=0.0,
                      expected_batch_size=expected, backend=backend)
    for users in (3, 1, 0):
        ids, mask = torch.randint(0, 40, (users, k, T)), torch.ones(users, k)
        am = torch.ones(users, k, T, dtype=torch.long)
        if users:
            mask[0, 1] = 0
            am[0, 0, 4:] = 0                                     # padded at the right
            am[-1, 1, 3:] = 0
        model.zero_grad(set_to_none=True)
        tids, tam, tmask = dpfx.track_batch((ids, am, mask))
        logits = dp(input_ids=tids, attention_mask=tam).logits
        assert logits.shape == (users, k, T, 40)
        (_lm_loss(logits, tids, tam) * tmask).sum(1).mean().backward()
        got = {n: p.grad for n, p in model.named_parameters()}
        g = {n: [] for n in got}
        for u in range(users):
            real = [j for j in range(k) if mask[u, j] == 1]
            one = loop_grads(model, lambda i: _lm_loss(
                model(ids[u, real[i]][None], attention_mask=am[u, real[i]][None]).logits,
                ids[u, real[i]][None], am[u, real[i]][None]).sum(), len(real))
            for n in g:
                g[n].append(one[n].sum(0))
        want = {n: torch.stack(v) if v else torch.zeros(0, *got[n].shape) for n, v in g.items()}
        if users:                                   # clipping bites on every user
            assert per_example_norms(want).min() > CLIP
        try:
            assert_close(got, clipped_sum(want, CLIP, expected), rtol=2e-4, atol=1e-6)
        except AssertionError as e:
            raise AssertionError(f"{users} users: {e}") from None
    assert dp.compile_count == 2
    if backend == "inductor":
        done = [c for c in dp._dpfx_backend._checks.values() if c.done]
        assert len(done) == 1 and done[0].backward is not None     # the self-check ran


class IndexedRows(nn.Module):
    """A linear layer on x's rows read at ``rows(n)``, n the number of rows."""

    def __init__(self, rows):
        super().__init__()
        self.fc, self.rows = nn.Linear(5, 3), rows

    def forward(self, x):
        return self.fc(x[self.rows(x.shape[0], x.device)])


def _arange(n, device):
    return torch.arange(n, device=device)


MIXING = {
    "reversed": lambda n, device: n - 1 - torch.arange(n, device=device),    # another user's row
    "shifted": lambda n, device: (torch.arange(n, device=device) + 1).clamp_max(n - 1),
    "first-row": lambda n, device: torch.zeros(n, dtype=torch.long, device=device),
}


@pytest.mark.parametrize("name", sorted(MIXING))
@pytest.mark.parametrize("unit", ["user", "example"])
def test_an_index_into_the_rows_that_reads_other_rows_is_refused(name, unit):
    """Every row reads a row chosen by arithmetic on an arange, or a fill: rows of other users
    (or examples) are read, and the model is refused before a step, its parameters untouched."""
    model = IndexedRows(MIXING[name])
    before = {n: p.clone() for n, p in model.named_parameters()}
    wrapped, x = (dpfx.per_user(model), torch.randn(3, 2, 5)) if unit == "user" \
        else (model, torch.randn(4, 5))
    dp = dpfx.compile(wrapped, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    with pytest.raises(dpfx.PrivacyError, match="indexes the batch dim 0 .* not proven to hold "
                                                "each row's own index"):
        dp(x)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("unit", ["user", "example"])
def test_an_index_by_the_rows_own_arange_trains(unit):
    """The same model reading each row at arange(rows) trains as the model without the index
    (the positive twin of the refusals above: the index check fired and passed)."""
    torch.manual_seed(0)
    model = IndexedRows(_arange)
    wrapped, x = (dpfx.per_user(model), torch.randn(3, 2, 5)) if unit == "user" \
        else (model, torch.randn(4, 5))
    dp = dpfx.compile(wrapped, max_grad_norm=0.1, noise_multiplier=0.0, loss_reduction="sum",
                      backend="eager")
    (tx,) = dpfx.track_batch((x,))
    dp(tx).pow(2).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    rows = x.flatten(0, 1) if unit == "user" else x
    g = loop_grads(model, lambda i: model.fc(rows[i:i + 1]).pow(2).sum(), rows.shape[0])
    if unit == "user":                  # each user's k rows summed before the clip
        g = {n: v.view(3, 2, *v.shape[1:]).sum(1) for n, v in g.items()}
    assert per_example_norms(g).min() > 0.1
    assert_close(got, clipped_sum(g, 0.1))


def test_an_iota_of_one_users_rows_indexing_a_per_user_tensor_is_refused():
    """An arange over the U * k rows indexing a tensor with one row per user (U rows): row r
    would read user r's row, not its own user's (r // k). Refused, not read across users."""

    class PerUserBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x):                       # (U, k, 5)
            first = x[:, 0]                         # (U, 5): one row per user
            rows = torch.arange(x.shape[0] * x.shape[1], device=x.device) % x.shape[0]
            return self.fc(x.flatten(0, 1) + first[rows]).view(*x.shape[:2], 3)

    dp = dpfx.compile(PerUserBias(), max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    with pytest.raises(dpfx.PrivacyError, match="not proven to hold each row's own index"):
        dp(torch.randn(3, 2, 5))
