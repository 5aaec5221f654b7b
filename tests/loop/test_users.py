"""User-level DP-SGD (``make_private(user_ids=, max_examples_per_user=)``, dpfx/loop/users.py):
users are Poisson-sampled, up to k examples of each come in (U, k, ...) batches with a mask, and
each user's summed gradient is clipped as one unit.

Every release is compared with an independent reference that loops over the batch's users,
takes each of the user's real examples' gradient by a batch-of-one autograd loop
(tests/support/reference.py), sums them, clips the sum and divides the users' sum by D. The
batches come from dpfx's own user-level loader, so the reference also checks what the loader
chose: every row one user, its real examples distinct and min(its examples, k) of them, its
padding its own.
"""
import collections
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.utils.data import DataLoader, Dataset, TensorDataset

import dpfx
import dpfx.audit
from dpfx.loop.users import UserBatchSampler, group_by_user, user_loader
from dpfx.loss.track import untrack
from support.reference import assert_close, clipped_sum, loop_grads, per_example_norms
from support.sweep import examples

CLASSES = 3


class Net(nn.Module):
    def __init__(self, d=5, hidden=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, CLASSES)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def user_data(counts, d=5, seed=0):
    """(x, y, example index) examples and one string id per example: user u holds counts[u]
    examples, shuffled among the others'."""
    g = torch.Generator().manual_seed(seed)
    ids = [f"user{u}" for u, c in enumerate(counts) for _ in range(c)]
    ids = [ids[i] for i in torch.randperm(len(ids), generator=g).tolist()]
    x = torch.randn(len(ids), d, generator=g) * 2
    y = torch.randint(0, CLASSES, (len(ids),), generator=g)
    return TensorDataset(x, y, torch.arange(len(ids))), ids


def user_loss(reduction):
    def loss(out, y, mask):
        per_example = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none")
        per_user = (per_example.view_as(mask) * mask).sum(1)
        return per_user.mean() if reduction == "mean" else per_user.sum()
    return loss


def check_rows(index, mask, ids, k):
    """Each row of a batch is one user, a different one per row: min(its examples, k) distinct
    real examples of its own, padding copies of its own."""
    count = collections.Counter(ids)
    seen = set()
    for row, real in zip(index.tolist(), mask.tolist()):
        owners = {ids[i] for i in row}
        assert len(owners) == 1, f"a row mixes users: {owners}"
        owner = owners.pop()
        assert owner not in seen, f"{owner} twice in one batch"
        seen.add(owner)
        chosen = [i for i, r in zip(row, real) if r == 1.0]
        assert len(chosen) == len(set(chosen)) == min(count[owner], k), (owner, row, real)
        assert real == sorted(real, reverse=True), "real slots first, then padding"


def user_grads(model, x, y, mask) -> dict:
    """{name: (U, *p.shape)}: each user's summed gradient over its real examples, each example's
    gradient by a batch-of-one autograd loop."""
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    per_user = {k: [] for k in names}
    for u in range(x.shape[0]):
        real = [j for j in range(x.shape[1]) if mask[u, j] == 1]
        g = loop_grads(model, lambda i: F.cross_entropy(model(x[u, real[i]][None]),
                                                        y[u, real[i]][None]), len(real))
        for k in names:
            per_user[k].append(g[k].sum(0))
    params = dict(model.named_parameters())
    return {k: torch.stack(v) if v else params[k].new_zeros((0, *params[k].shape))
            for k, v in per_user.items()}


def user_bound(model, data, ids, k) -> float:
    """A clipping bound that clips about half the users (their first k examples' gradients):
    the lower median of their norms (half the one norm of a single user)."""
    x, y, _ = data.tensors
    rows = [idx[:k].tolist() for idx in group_by_user(ids, len(ids))]
    index = torch.tensor([r + [r[0]] * (k - len(r)) for r in rows])
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (k - len(r)) for r in rows])
    norms = sorted(per_example_norms(user_grads(model, x[index], y[index], mask)).tolist())
    return norms[(len(norms) - 1) // 2] * (1.0 if len(norms) > 1 else 0.5)


def train_and_compare(model, private, ids, k, clip, reduction, steps, captured=False, tol=None):
    """Runs ``steps`` steps of the user-level loader (sigma 0) and compares each release with
    the per-user reference; returns the sizes U seen and the users' norms."""
    loss_fn, sizes, norms = user_loss(reduction), [], []
    divisor = private.model.dp_config.expected_batch_size if reduction == "mean" else 1
    batches = iter(private.loader)
    for _ in range(steps):
        try:
            x, y, index, mask = next(batches)
        except StopIteration:
            batches = iter(private.loader)
            x, y, index, mask = next(batches)
        assert x.shape[1:] == (k, 5) and mask.shape == (x.shape[0], k) == y.shape
        check_rows(index, mask, ids, k)
        private.optimizer.zero_grad()
        loss = private.model.loss(x, y, mask) if captured else loss_fn(private.model(x), y, mask)
        loss.backward()
        got = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        private.optimizer.step()
        g = user_grads(model, *untrack((x, y, mask)))      # plain tensors, as any caller's
        norms += per_example_norms(g).tolist()
        try:
            assert_close(got, clipped_sum(g, clip, divisor), **(tol or {}))
        except AssertionError as e:
            raise AssertionError(f"{x.shape[0]} users: {e}") from None
        sizes.append(x.shape[0])
    return sizes, norms


# -- 1. exactness at sigma 0 -----------------------------------------------------------------------
COUNTS = [1, 2, 3, 5, 7, 1]          # k = 3: users with 1 to k examples and with more than k
K = 3


@pytest.mark.parametrize("reduction,captured", [("mean", False), ("sum", True)],
                         ids=["mean-plain-loop", "sum-captured-loss"])
def test_user_level_release_equals_the_per_user_reference(reduction, captured):
    """Through Inductor with the self-check on: one compiled pair serves 0, 1 and more users;
    clipping bites on some users and not on others."""
    torch.manual_seed(0)
    model = Net()
    data, ids = user_data(COUNTS)
    clip = user_bound(model, data, ids, K)
    private = dpfx.make_private(
        dpfx.per_user(model), torch.optim.SGD(model.parameters(), lr=0.0), data, batch_size=1,
        user_ids=ids, max_examples_per_user=K, max_grad_norm=clip, noise_multiplier=0.0,
        loss_reduction=reduction, generator=torch.Generator().manual_seed(3),
        loss=user_loss(reduction) if captured else None)
    assert private.sample_rate == pytest.approx(1 / len(COUNTS)) and private.privacy_unit == "user"
    assert private.model.dp_config.expected_batch_size == 1
    sizes, norms = train_and_compare(model, private, ids, K, clip, reduction, steps=12,
                                     captured=captured, tol={"rtol": 2e-4, "atol": 1e-6})
    assert {0, 1} <= set(sizes) and max(sizes) >= 2, sizes
    assert min(norms) < clip < max(norms), "clipping must bite on some users only"
    # one compiled pair serves every number of users; the captured loss compiles the empty batch
    # apart, as for examples (tests/loss/test_loss_graph.py)
    assert private.model.compile_count == (4 if captured else 2)
    # the self-check ran on the pair that serves U > 0 (a pair for U = 0 alone has no rows to check)
    done = [c for c in private.model._dpfx_backend._checks.values() if c.done]
    assert len(done) == 1 and done[0].backward is not None
    assert private.accountant.history == [(0.0, pytest.approx(1 / len(COUNTS)), 12)]


@settings(max_examples=examples(10), deadline=None)
@given(counts=st.lists(st.integers(1, 6), min_size=1, max_size=5), k=st.integers(1, 4),
       hidden=st.integers(1, 6), users=st.integers(1, 5),
       reduction=st.sampled_from(["mean", "sum"]), seed=st.integers(0, 2**16))
def test_user_level_sweep_eager(counts, k, hidden, users, reduction, seed):
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = Net(hidden=hidden)
    data, ids = user_data(counts, seed=seed)
    clip = user_bound(model, data, ids, k)
    private = dpfx.make_private(
        dpfx.per_user(model), torch.optim.SGD(model.parameters(), lr=0.0), data,
        batch_size=min(users, len(counts)), user_ids=ids, max_examples_per_user=k,
        max_grad_norm=clip, noise_multiplier=0.0, loss_reduction=reduction, backend="eager",
        generator=torch.Generator().manual_seed(seed))
    train_and_compare(model, private, ids, k, clip, reduction, steps=3)
    assert private.model.compile_count == 2


# Note [A dropout that keeps every element]
# Dropout's mask is drawn inside the compiled graph, by Inductor's generator, so no eager reference
# can draw the same one. At p = 1e-30 the draw and the comparison stay in the graph while the mask
# keeps every element: a float32 uniform draw is 0 or at least 2**-24 (> p), and 1 / (1 - p) is
# 1.0 in float32; the step must then equal the reference without dropout.
KEEPS_ALL = 1e-30


class DropoutNet(Net):
    def __init__(self, p):
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def _draws_in_forward(private) -> bool:
    return "inductor_random" in private.model._dpfx_backend.stages.graphs["forward"]


def test_dropout_under_per_user_equals_the_per_user_reference():
    """Dropout draws its mask over the merged k*U rows (Note [A random draw holds no example] in
    dpfx/graph/batch.py): through Inductor with the self-check on, the step at sigma 0 equals
    the per-user clipped reference (Note [A dropout that keeps every element])."""
    torch.manual_seed(0)
    model = DropoutNet(KEEPS_ALL)
    data, ids = user_data(COUNTS)
    clip = user_bound(model, data, ids, K)
    private = dpfx.make_private(
        dpfx.per_user(model), torch.optim.SGD(model.parameters(), lr=0.0), data, batch_size=2,
        user_ids=ids, max_examples_per_user=K, max_grad_norm=clip, noise_multiplier=0.0,
        generator=torch.Generator().manual_seed(3))
    sizes, norms = train_and_compare(model, private, ids, K, clip, "mean", steps=4,
                                     tol={"rtol": 2e-4, "atol": 1e-6})
    assert max(sizes) >= 2 and min(norms) < clip < max(norms), (sizes, norms)
    assert _draws_in_forward(private)


def test_dropout_under_per_user_trains_and_each_user_moves_the_step_by_at_most_C():
    """At p = 0.1 (a real mask): sigma 0, sum over users, SGD at lr 1: the step is a sum of U
    clipped user gradients, so its norm is at most U C, and it moves the weights."""
    torch.manual_seed(0)
    model, clip = DropoutNet(0.1), 0.05
    data, ids = user_data(COUNTS)
    private = dpfx.make_private(
        dpfx.per_user(model), torch.optim.SGD(model.parameters(), lr=1.0), data,
        batch_size=len(COUNTS), user_ids=ids, max_examples_per_user=K, max_grad_norm=clip,
        noise_multiplier=0.0, loss_reduction="sum")
    x, y, _, mask = next(iter(private.loader))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    private.optimizer.zero_grad()
    user_loss("sum")(private.model(x), y, mask).backward()
    private.optimizer.step()
    step = before - torch.cat([p.detach().flatten() for p in model.parameters()])
    assert 0 < float(step.norm()) <= x.shape[0] * clip * (1 + 1e-5)
    assert _draws_in_forward(private)


def test_ops_that_mix_one_users_rows_are_accepted():
    """A model on (U, k, d) itself that centres each user's k rows: each user's gradient is that
    of its own loss on a batch of that one user, clipped as one."""

    class CentredPerUser(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, CLASSES)

        def forward(self, x):                           # (U, k, 4)
            h = torch.tanh(self.fc1(x))
            return self.fc2(h - h.mean(1, keepdim=True))

    torch.manual_seed(0)
    model = CentredPerUser()
    x, y, mask = torch.randn(4, 3, 4) * 2, torch.randint(0, CLASSES, (4, 3)), torch.ones(4, 3)
    mask[1, 2] = 0
    loss_fn = user_loss("sum")
    dp = dpfx.compile(model, max_grad_norm=0.3, noise_multiplier=0.0, loss_reduction="sum",
                      backend="eager")
    tx, ty, tmask = dpfx.track_batch((x, y, mask))     # as the loader's batches are
    loss_fn(dp(tx), ty, tmask).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    g = loop_grads(model, lambda u: loss_fn(model(x[u:u + 1]), y[u:u + 1], mask[u:u + 1]), 4)
    assert per_example_norms(g).max() > 0.3
    assert_close(got, clipped_sum(g, 0.3))


def test_gpt2_per_user():
    """A tiny GPT-2 LM under ``per_user``: token ids (U, k, T) in, a ModelOutput with (U, k, T, V)
    logits out, one compiled pair for U = 3, 1 and 0; each user's summed next-token loss over its
    real sequences, clipped as one, against the batch-of-one loop over sequences."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))
    k, T, expected = 2, 6, 2
    dp = dpfx.compile(dpfx.per_user(model), max_grad_norm=0.5, noise_multiplier=0.0,
                      expected_batch_size=expected, backend="eager")
    for users in (3, 1, 0):
        ids, mask = torch.randint(0, 40, (users, k, T)), torch.ones(users, k)
        if users:
            mask[0, 1] = 0
        model.zero_grad(set_to_none=True)
        tids, tmask = dpfx.track_batch((ids, mask))
        logits = dp(input_ids=tids).logits
        assert logits.shape == (users, k, T, 40)
        per_sequence = F.cross_entropy(logits[..., :-1, :].flatten(0, 2), tids[..., 1:].flatten(),
                                       reduction="none").view(-1, k, T - 1).sum(2)
        (per_sequence * tmask).sum(1).mean().backward()
        got = {n: p.grad for n, p in model.named_parameters()}
        g = {n: [] for n in got}
        for u in range(users):
            real = [j for j in range(k) if mask[u, j] == 1]
            one = loop_grads(model, lambda i: F.cross_entropy(
                model(ids[u, real[i]][None]).logits[0, :-1], ids[u, real[i], 1:],
                reduction="sum"), len(real))
            for n in g:
                g[n].append(one[n].sum(0))
        want = {n: torch.stack(v) if v else torch.zeros(0, *got[n].shape) for n, v in g.items()}
        if users:                                   # clipping bites on every user
            assert per_example_norms(want).min() > 0.5
        assert_close(got, clipped_sum(want, 0.5, expected), rtol=1e-4, atol=1e-6)
    assert dp.compile_count == 2


# -- 2. a user added moves the release by at most C / D --------------------------------------------
def test_one_added_user_moves_the_release_by_at_most_C_over_D():
    """A canary user of k examples with huge gradients (k different ones; k copies of one) moves
    the user-level release by C / D (clipped to C as one unit). Clipped as k examples, the k
    copies would move it by k C / D."""
    torch.manual_seed(0)
    model, k, clip, expected = Net(), 4, 0.05, 3
    x, y = torch.randn(3, k, 5), torch.randint(0, CLASSES, (3, k))
    mask = torch.ones(3, k)
    mask[0, 1:] = 0                                    # a user of one example beside full ones
    loss_fn = user_loss("mean")
    dp = dpfx.compile(dpfx.per_user(model), max_grad_norm=clip, noise_multiplier=0.0,
                      expected_batch_size=expected, backend="eager")

    def release(dp, loss, *batch):
        model.zero_grad(set_to_none=True)
        batch = dpfx.track_batch(batch)                # as the loader's batches are
        loss(dp(batch[0]), *batch[1:]).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    different = torch.randn(1, k, 5) * 10, torch.randint(0, CLASSES, (1, k))
    copies = (torch.randn(1, 1, 5) * 10).expand(1, k, 5).clone(), torch.zeros(1, k).long()
    for x_c, y_c in (different, copies):
        assert float(per_example_norms(user_grads(model, x_c, y_c, torch.ones(1, k)))) > 20 * clip
        moved = release(dp, loss_fn, torch.cat([x, x_c]), torch.cat([y, y_c]),
                        torch.cat([mask, torch.ones(1, k)])) - release(dp, loss_fn, x, y, mask)
        assert float(moved.norm()) <= clip / expected * (1 + 1e-5)
        assert float(moved.norm()) == pytest.approx(clip / expected, rel=1e-4)

    per_example = dpfx.compile(model, max_grad_norm=clip, noise_multiplier=0.0,
                               expected_batch_size=expected, backend="eager")
    flat_x, flat_y = x[mask == 1], y[mask == 1]
    moved = release(per_example, F.cross_entropy, torch.cat([flat_x, copies[0][0]]),
                    torch.cat([flat_y, copies[1][0]])) \
        - release(per_example, F.cross_entropy, flat_x, flat_y)
    assert float(moved.norm()) == pytest.approx(k * clip / expected, rel=1e-4)


def test_user_level_audit():
    """dpfx.audit on a per-user model: the canary is one user of k examples (``per_user_loss``);
    the step stays below the accounted epsilon, and a sigma/10 control is caught."""
    torch.manual_seed(0)
    model, k = Net(), 3
    batch = (torch.randn(4, k, 5), torch.randint(0, CLASSES, (4, k)))
    canary = (torch.randn(k, 5) * 5, torch.randint(0, CLASSES, (k,)))
    settings = dict(max_grad_norm=1.0, noise_multiplier=1.0, seed=0, threads=1,
                    backend="eager", loss_fn=dpfx.audit.per_user_loss)
    correct = dpfx.audit.run(dpfx.per_user(model), batch, canary, trials=400, **settings)
    assert correct.verdict.startswith("consistent"), correct
    broken = dpfx.audit.run(dpfx.per_user(model), batch, canary, control="sigma/10",
                            trials=800, **settings)      # fewer cannot bound epsilon above 4.4
    assert broken.eps_lower_bound > broken.eps_accounted, broken


# -- 3. sampling -----------------------------------------------------------------------------------
def _users(counts):
    ids = [u for u, c in enumerate(counts) for _ in range(c)]
    return ids, group_by_user(ids, len(ids))


@pytest.mark.parametrize("secure_mode", [False, True])
def test_each_user_joins_with_probability_q_and_its_examples_together(secure_mode):
    counts, k, q, steps = [1, 2, 4, 6, 3, 1, 2, 8], 3, 0.3, 3000
    ids, users = _users(counts)
    sampler = UserBatchSampler(users, k, q, steps=steps, secure_mode=secure_mode,
                               generator=None if secure_mode else torch.Generator().manual_seed(0))
    joined, picked = collections.Counter(), collections.Counter()
    for slots in sampler:
        assert len(slots) % k == 0
        for start in range(0, len(slots), k):
            row = slots[start:start + k]
            owners = {ids[i] for i, _ in row}
            assert len(owners) == 1
            user = owners.pop()
            joined[user] += 1
            real = [i for i, r in row if r]
            assert len(real) == len(set(real)) == min(counts[user], k)
            picked.update(real)
    sd = math.sqrt(steps * q * (1 - q))
    for user in range(len(counts)):
        assert abs(joined[user] - steps * q) < 5 * sd, (user, joined[user])
        share = min(1.0, k / counts[user])         # each of its examples, given the user joined
        for i in users[user].tolist():
            n = joined[user]
            assert abs(picked[i] - n * share) <= 5 * math.sqrt(n * share * (1 - share)) + 1e-9


def test_ranks_partition_the_users():
    ids, users = _users([2, 1, 3, 2, 2])
    seen = []
    for rank in range(2):
        sampler = UserBatchSampler(users, 2, 1.0, steps=1, rank=rank, world_size=2,
                                   generator=torch.Generator().manual_seed(0))
        seen.append({ids[i] for i, _ in next(iter(sampler))})
    assert seen[0] | seen[1] == set(ids) and not seen[0] & seen[1]


def _user_level_rank(clip):
    """One step of a user-level run on this rank, every user sampled (q = 1): its batch and the
    released gradient."""
    torch.manual_seed(0)
    model = Net()
    data, ids = user_data(COUNTS)
    private = dpfx.make_private(
        dpfx.per_user(model), torch.optim.SGD(model.parameters(), lr=0.0), data,
        batch_size=len(COUNTS), user_ids=ids, max_examples_per_user=K, max_grad_norm=clip,
        noise_multiplier=0.0, backend="eager")
    x, y, index, mask = next(iter(private.loader))
    private.optimizer.zero_grad()
    user_loss("mean")(private.model(x), y, mask).backward()
    private.optimizer.step()
    return {"index": index.as_subclass(torch.Tensor), "mask": mask.as_subclass(torch.Tensor),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def test_two_ranks_partition_the_users_and_release_the_union(tmp_path):
    """Under two gloo ranks each rank samples its own users (r, r + 2, ...); the released
    gradient, the same on both, is the reference's over the union of their users, divided by
    the global D."""
    from support import gloo_ranks

    torch.manual_seed(0)
    model = Net()
    data, ids = user_data(COUNTS)
    clip = user_bound(model, data, ids, K)
    results, errors = gloo_ranks.spawn(tmp_path, 2, _user_level_rank, clip, deadline=240,
                                       timeout=60)
    assert not errors, errors
    index = torch.cat([results[r]["index"] for r in range(2)])
    mask = torch.cat([results[r]["mask"] for r in range(2)])
    check_rows(index, mask, ids, K)
    assert len(index) == len(COUNTS) and all(len(results[r]["index"]) == 3 for r in range(2))
    x, y, _ = data.tensors
    want = clipped_sum(user_grads(model, x[index], y[index], mask), clip, len(COUNTS))
    for rank in range(2):
        assert_close(results[rank]["grads"], want)


def test_accountant_counts_the_user_level_q():
    torch.manual_seed(0)
    model = Net()
    data, ids = user_data([3, 1, 2, 4, 2, 2, 1, 5])          # 8 users, 20 examples
    private = dpfx.make_private(
        dpfx.per_user(model), torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=2,
        user_ids=ids, max_examples_per_user=2, max_grad_norm=1.0, noise_multiplier=1.1,
        backend="eager")
    assert private.sample_rate == pytest.approx(2 / 8) and private.steps_per_epoch == 4
    assert private.model.dp_config.expected_batch_size == 2
    loss_fn = user_loss("mean")
    for x, y, _, mask in private.loader:
        private.optimizer.zero_grad()
        loss_fn(private.model(x), y, mask).backward()
        private.optimizer.step()
    assert private.accountant.history == [(1.1, pytest.approx(0.25), 4)]
    assert private.accountant.get_epsilon(1e-5) == pytest.approx(dpfx.privacy.epsilon(
        noise_multiplier=1.1, sample_rate=0.25, steps=4, delta=1e-5))


def test_a_checkpoint_restores_the_user_sampler(tmp_path):
    """A seeded sampler's state is saved with the run: the users and the examples chosen after a
    restore are those chosen after the save."""
    model = Net()
    data, ids = user_data([3, 1, 2, 4, 2, 2, 1, 5])
    private = dpfx.make_private(
        dpfx.per_user(model), torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=3,
        user_ids=ids, max_examples_per_user=2, max_grad_norm=1.0, noise_multiplier=1.0,
        backend="eager", generator=torch.Generator().manual_seed(0))
    dpfx.save_checkpoint(tmp_path / "run.ckpt", private)
    first = [index.tolist() for _, _, index, _ in private.loader]
    dpfx.load_checkpoint(tmp_path / "run.ckpt", private)
    assert [index.tolist() for _, _, index, _ in private.loader] == first


def test_virtual_batches_and_secure_mode_split_users():
    """max_physical_batch_size counts users; secure mode samples them from os.urandom."""
    model = Net()
    data, ids = user_data([3, 1, 2, 4, 2, 2, 1, 5])
    private = dpfx.make_private(
        dpfx.per_user(model), torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=4,
        user_ids=ids, max_examples_per_user=2, max_grad_norm=1.0, noise_multiplier=1.0,
        max_physical_batch_size=1, secure_mode=True, backend="eager")
    assert private.model.dp_config.noise == "optimizer"
    assert private.loader.loader.batch_sampler.secure_mode
    loss_fn = user_loss("mean")
    for x, y, index, mask in private.loader:
        assert x.shape[0] <= 1 and x.shape[1:] == (2, 5)
        check_rows(index, mask, ids, 2)
        private.optimizer.zero_grad()
        loss_fn(private.model(x), y, mask).backward()
        private.optimizer.step()
    assert private.accountant.steps == private.optimizer.steps == 2


class Dicts(Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return {"x": torch.full((2,), float(i)), "i": i}


def test_batch_layout():
    """Tuples get the mask appended, anything else comes as (batch, mask); an empty batch keeps
    the trailing shapes."""
    ids, users = _users([2, 3])
    x, i, mask = next(iter(user_loader(TensorDataset(torch.randn(5, 4), torch.arange(5)),
                                       users, 4, 1.0, steps=1)))
    assert x.shape == (2, 4, 4) and i.shape == mask.shape == (2, 4)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert i.tolist() == [[0, 1, 0, 0], [2, 3, 4, 2]]
    batch, mask = next(iter(user_loader(Dicts(), users, 2, 1.0, steps=1)))
    assert batch["x"].shape == (2, 2, 2) and mask.shape == (2, 2)
    empty = user_loader(TensorDataset(torch.randn(5, 4), torch.arange(5)), users, 3, 1e-9,
                        steps=1)
    x, i, mask = next(iter(empty))
    assert x.shape == (0, 3, 4) and i.shape == mask.shape == (0, 3)


# -- 4. an op that mixes users is refused ----------------------------------------------------------
def test_an_op_across_users_is_refused():
    class MixesRows(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, CLASSES)

        def forward(self, x):                          # (U * k, 5): a mean over all users' rows
            h = self.fc(x)
            return h - h.mean(0, keepdim=True)

    dp = dpfx.compile(dpfx.per_user(MixesRows()), max_grad_norm=1.0, noise_multiplier=0.0,
                      backend="eager")
    with pytest.raises(dpfx.PrivacyError, match="aten.mean.dim .* reduces over the batch dim"):
        dp(torch.randn(3, 2, 5))


# -- 5. bad arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(user_ids=list(range(7)), max_examples_per_user=2), "one id per example"),
    (dict(user_ids=[0] * 10, max_examples_per_user=0), "max_examples_per_user must be an int"),
    (dict(user_ids=[0] * 10, max_examples_per_user=1.5), "max_examples_per_user must be an int"),
    (dict(user_ids=[0] * 10), "needs max_examples_per_user"),
    (dict(max_examples_per_user=2), "needs user_ids"),
    (dict(user_ids=torch.zeros(2, 5), max_examples_per_user=2), "1-D"),
    (dict(user_ids=[[0]] * 10, max_examples_per_user=2), "not hashable"),
    (dict(user_ids=[0, 1] * 5, max_examples_per_user=2, batch_size=3), "number of users = 2"),
    (dict(user_ids=[0, 1] * 5, max_examples_per_user=2, batch_size=None), "exactly one of"),
])
def test_bad_arguments_leave_the_model_untouched(kwargs, match):
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = DataLoader(TensorDataset(torch.randn(10, 5), torch.randint(0, 3, (10,))),
                      batch_size=4)
    settings = dict(batch_size=1, max_grad_norm=1.0, noise_multiplier=1.0, backend="eager")
    settings.update(kwargs)
    if settings["batch_size"] is None:
        del settings["batch_size"]
    with pytest.raises(ValueError, match=match):
        dpfx.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, **settings)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
