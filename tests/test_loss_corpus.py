"""Loss idioms as real training code writes them, through the plain loop.

Each per-example loss below is written the way a library or a training script writes it (the
source it follows is named), trained through dpfx's loop (``loss.backward()`` on the tracked
outputs) and compared with a batch-of-one reference: each example's gradient of its own term,
clipped with a bound that bites on about half the examples, summed, divided. The per-example
term is the loss with every scalar applied after the batch reduction removed (Note [The
per-example term] in dpfx/loss_check.py): the batch size written any way (a mean, ``size(0)``,
``len(y)``, ``shape[0]``, a Python int, ``reduction="batchmean"``), a token count, a constant
factor on the whole loss. Means over an example's own positions stay means.

Each coupled loss (a batch statistic of the outputs or of the labels that reaches a term, ranks,
top-k, a softmax over the batch) is refused with the op and the user's line.
"""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from support.reference import CLIP_EPS
from support.sweep import reductions

V, T, K = 7, 4, 3     # vocabulary, tokens per example, classes (B = 4 collides with T)
IGNORE = -100


class Net(nn.Module):
    """(B, T) ids -> token logits (B, T, V), class logits (B, K), a regression output (B, 2)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.tok = nn.Linear(8, V)
        self.cls = nn.Linear(8, K)
        self.reg = nn.Linear(8, 2)

    def forward(self, ids):
        h = torch.tanh(self.emb(ids))
        pooled = h.mean(1)
        return self.tok(h), self.cls(pooled), self.reg(pooled)


def _batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (n, T), generator=g)
    tokens = torch.randint(0, V, (n, T), generator=g)
    tokens[: n // 2, T // 2:] = IGNORE                       # half the examples padded
    labels = torch.randint(0, K, (n,), generator=g)
    multi = (torch.rand(n, K, generator=g) > 0.5).float()
    target = torch.randn(n, 2, generator=g)
    teacher = torch.randn(n, T, V, generator=g)
    weight = torch.rand(n, generator=g) + 0.5
    return ids, dict(tokens=tokens, labels=labels, multi=multi, target=target, teacher=teacher,
                     weight=weight)


# -- the idioms ------------------------------------------------------------------------------
def hf_causal_lm(tok, d):
    """transformers' ForCausalLMLoss: shift, flatten, cross-entropy with ignore_index -100."""
    logits = tok[..., :-1, :].contiguous()
    labels = d["tokens"][..., 1:].contiguous()
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), labels.view(-1),
                           ignore_index=IGNORE, reduction="mean")


def hf_num_items(tok, d):
    """ForCausalLMLoss with ``num_items_in_batch`` (gradient accumulation): a sum divided by a
    token count handed in as a tensor."""
    labels = d["tokens"][..., 1:]
    n = (labels != IGNORE).sum()
    loss = F.cross_entropy(tok[..., :-1, :].reshape(-1, V), labels.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    return loss / n


def fairseq_label_smoothed(tok, d, epsilon=0.1):
    """fairseq's label_smoothed_nll_loss on flattened lprobs and a padding mask, summed."""
    lprobs = F.log_softmax(tok, dim=-1).view(-1, V)
    target = d["tokens"].view(-1, 1)
    pad_mask = target.eq(IGNORE)
    target = target.masked_fill(pad_mask, 0)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    nll_loss = nll_loss.masked_fill(pad_mask, 0.0)
    smooth_loss = smooth_loss.masked_fill(pad_mask, 0.0)
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll_loss.sum() + eps_i * smooth_loss.sum()
    return loss


def token_loss_view_labels(tok, d):
    """A per-example token loss reshaped by the labels' shape, summed per example, averaged."""
    y = d["tokens"]
    per_token = F.cross_entropy(tok.reshape(-1, V), y.reshape(-1), ignore_index=IGNORE,
                                reduction="none")
    return per_token.view(y.shape).sum(1).mean()


def token_loss_view_size0(tok, d):
    y = d["tokens"]
    per_token = F.cross_entropy(tok.reshape(-1, V), y.reshape(-1), ignore_index=IGNORE,
                                reduction="none")
    return per_token.view(tok.size(0), -1).sum(-1).mean()


def token_loss_python_ints(tok, d):
    """The batch size and length as Python ints in the view."""
    y = d["tokens"]
    b, t = y.shape
    per_token = F.cross_entropy(tok.view(b * t, V), y.view(b * t), ignore_index=IGNORE,
                                reduction="none")
    return per_token.view(b, t).sum(1).mean()


def token_loss_time_first(tok, d):
    """Logits transposed to (T, B, V) (seq2seq code), labels likewise, cross-entropy over the
    class dim 2 written as a permute to (B, V, T)."""
    logits = tok.transpose(0, 1)
    y = d["tokens"].t()
    return F.cross_entropy(logits.permute(1, 2, 0), y.t(), ignore_index=IGNORE,
                           reduction="sum")


def masked_token_mean(tok, d):
    y = d["tokens"]
    mask = (y != IGNORE).float()
    per_token = F.cross_entropy(tok.transpose(1, 2), y.clamp(min=0), reduction="none")
    return (per_token * mask).sum() / mask.sum()


def per_example_token_mean(tok, d):
    """Each example's mean over its own tokens, then the batch mean (a ``masked mean`` per
    row): the per-example normalizer is the example's own count."""
    y = d["tokens"]
    mask = (y != IGNORE).float()
    per_token = F.cross_entropy(tok.transpose(1, 2), y.clamp(min=0), reduction="none")
    return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


def stacked_time_steps(tok, d):
    """Per-time-step losses, stacked (char-RNN training loops)."""
    y = d["tokens"].clamp(min=0)
    steps = [F.cross_entropy(tok[:, t], y[:, t], reduction="none") for t in range(T)]
    return torch.stack(steps, dim=1).mean()


def summed_time_steps(tok, d):
    y = d["tokens"].clamp(min=0)
    loss = 0
    for t in range(T):
        loss = loss + F.cross_entropy(tok[:, t], y[:, t])
    return loss / T


def sum_over_size0(cls, d):
    return F.cross_entropy(cls, d["labels"], reduction="sum") / cls.size(0)


def sum_over_len(cls, d):
    return F.cross_entropy(cls, d["labels"], reduction="none").sum() / len(d["labels"])


def sum_over_shape0(cls, d):
    y = d["labels"]
    return F.cross_entropy(cls, y, reduction="sum") / y.shape[0]


def sum_over_batch_size(cls, d, batch_size=32):
    """``/ batch_size``: the loader's configured size, a constant."""
    return F.cross_entropy(cls, d["labels"], reduction="sum") / batch_size


def grad_accumulation(cls, d, accumulation_steps=4):
    return F.cross_entropy(cls, d["labels"]) / accumulation_steps


def times_reciprocal(cls, d):
    return F.cross_entropy(cls, d["labels"], reduction="sum") * (1.0 / len(d["labels"]))


def plain_cross_entropy(cls, d):
    return F.cross_entropy(cls, d["labels"])


def label_smoothing(cls, d):
    return F.cross_entropy(cls, d["labels"], label_smoothing=0.1)


def timm_label_smoothing(cls, d, smoothing=0.1):
    """timm's LabelSmoothingCrossEntropy."""
    logprobs = F.log_softmax(cls, dim=-1)
    nll_loss = -logprobs.gather(dim=-1, index=d["labels"].unsqueeze(1)).squeeze(1)
    smooth_loss = -logprobs.mean(dim=-1)
    loss = (1.0 - smoothing) * nll_loss + smoothing * smooth_loss
    return loss.mean()


def timm_soft_target(cls, d):
    """timm's SoftTargetCrossEntropy (mixup-style soft labels)."""
    target = F.one_hot(d["labels"], K).float() * 0.8 + 0.2 / K
    loss = torch.sum(-target * F.log_softmax(cls, dim=-1), dim=-1)
    return loss.mean()


def class_weights(cls, d):
    """A constant class-weight vector (the weighted mean divides by the batch's weight sum)."""
    return F.cross_entropy(cls, d["labels"], weight=torch.tensor([1.0, 2.0, 0.5]))


def focal(cls, d, alpha=0.25, gamma=2.0):
    """torchvision's sigmoid_focal_loss on multi-label targets, mean."""
    targets = d["multi"]
    p = torch.sigmoid(cls)
    ce_loss = F.binary_cross_entropy_with_logits(cls, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce_loss * ((1 - p_t) ** gamma)
    alpha_t = alpha * targets + (1 - alpha) * (1 - targets)
    return (alpha_t * loss).mean()


def multi_label_bce(cls, d):
    return nn.BCEWithLogitsLoss()(cls, d["multi"])


def multi_label_soft_margin(cls, d):
    return F.multilabel_soft_margin_loss(cls, d["multi"])


def distillation_batchmean(tok, d, temperature=2.0):
    """DistilBERT / Hinton distillation: KL(student || teacher) with ``batchmean``, times T^2."""
    s = F.log_softmax(tok / temperature, dim=-1)
    t = F.softmax(d["teacher"] / temperature, dim=-1)
    return F.kl_div(s, t, reduction="batchmean") * temperature ** 2


def distillation_kl_module(tok, d):
    return nn.KLDivLoss(reduction="batchmean", log_target=True)(
        F.log_softmax(tok, -1), F.log_softmax(d["teacher"], -1))


def example_weights(cls, d):
    """Per-example importance weights handed in with the batch."""
    return (F.cross_entropy(cls, d["labels"], reduction="none") * d["weight"]).mean()


def mse_regression(reg, d):
    return F.mse_loss(reg, d["target"])


def smooth_l1(reg, d):
    return F.smooth_l1_loss(reg, d["target"], beta=0.5)


def huber_sum_over_len(reg, d):
    return F.huber_loss(reg, d["target"], reduction="sum") / len(reg)


def gaussian_nll_by_hand(reg, d):
    """A heteroscedastic regression head's negative log-likelihood."""
    mean, log_var = reg[:, :1], reg[:, 1:]
    return 0.5 * (log_var + (d["target"][:, :1] - mean) ** 2 / log_var.exp()).mean()


def gaussian_nll_module(reg, d):
    """A heteroscedastic regression head through ``nn.GaussianNLLLoss`` (mean, a variance from
    the outputs), whose torch code branches on ``torch.any(var < 0)``."""
    return nn.GaussianNLLLoss()(reg[:, :1], d["target"][:, :1], reg[:, 1:].exp())


def gaussian_nll_full_sum(reg, d):
    """``F.gaussian_nll_loss`` with its constant term, summed, over ``len``; the variance one
    dim short of the input (torch's homoscedastic form, unsqueezed inside)."""
    return F.gaussian_nll_loss(reg[:, :1], d["target"][:, :1], F.softplus(reg[:, 1]),
                               full=True, reduction="sum") / len(reg)


def gaussian_nll_float_var(reg, d):
    return F.gaussian_nll_loss(reg, d["target"], 0.5)


def half_the_loss(cls, d):
    return 0.5 * F.cross_entropy(cls, d["labels"])


def negated_log_likelihood(cls, d):
    return -F.log_softmax(cls, -1).gather(1, d["labels"][:, None]).mean()


def multi_task(outs, d):
    """Two heads, constant task weights (means over examples on both)."""
    _, cls, reg = outs
    return F.cross_entropy(cls, d["labels"]) + 0.3 * F.mse_loss(reg, d["target"])


def multi_task_sums_over_len(outs, d):
    _, cls, reg = outs
    n = len(d["labels"])
    return (F.cross_entropy(cls, d["labels"], reduction="sum")
            + 0.3 * F.mse_loss(reg, d["target"], reduction="sum")) / n


def bert_pretraining(outs, d):
    """BertForPreTraining's loss: a masked-LM token mean over the masked tokens plus the
    next-sentence mean over examples; their batch-dependent scales differ (Note [Terms on their
    own scales])."""
    tok, cls, _ = outs
    mlm = F.cross_entropy(tok.view(-1, V), d["tokens"].view(-1), ignore_index=IGNORE)
    return mlm + F.cross_entropy(cls, d["labels"])


def bert_pretraining_term(outs, d):
    tok, cls, _ = outs
    return _all_tokens_sum(tok, d) + F.cross_entropy(cls, d["labels"], reduction="sum")


def lm_plus_distillation(tok, d, alpha=0.5):
    """A token loss with ignore_index plus a distillation term with ``batchmean``."""
    ce = F.cross_entropy(tok.reshape(-1, V), d["tokens"].reshape(-1), ignore_index=IGNORE)
    kd = F.kl_div(F.log_softmax(tok, -1), F.softmax(d["teacher"], -1), reduction="batchmean")
    return (1 - alpha) * ce + alpha * kd


def lm_plus_distillation_term(tok, d):
    kd = F.kl_div(F.log_softmax(tok, -1), F.softmax(d["teacher"], -1), reduction="sum")
    return _all_tokens_sum(tok, d) + kd


def ctc(tok, d):
    """CTC over (T, B, V) log-probabilities (torchaudio / wav2vec2 training code)."""
    log_probs = F.log_softmax(tok, dim=-1).transpose(0, 1)
    targets = d["tokens"][:, :2].clamp(min=1)
    n = tok.size(0)
    input_lengths = torch.full((n,), T, dtype=torch.long)
    target_lengths = torch.full((n,), 2, dtype=torch.long)
    return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0,
                      reduction="mean", zero_infinity=True)


def cosine_embedding(reg, d):
    return F.cosine_embedding_loss(reg, d["target"], torch.ones(len(reg)))


# name: (which output, the batch loss, the same example's term on a batch of one)
def _same(f):
    return f


def _token_sum(tok, d):
    y = d["tokens"][..., 1:]
    return F.cross_entropy(tok[..., :-1, :].reshape(-1, V), y.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


def _all_tokens_sum(tok, d):
    return F.cross_entropy(tok.reshape(-1, V), d["tokens"].reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


def _sum_of(f):
    def term(out, d):
        return f(out, d) * len(d["labels"])     # undo the batch mean on a batch of one
    return term


CORPUS = {
    "hf_causal_lm": ("tok", hf_causal_lm, _token_sum),
    "hf_num_items_in_batch": ("tok", hf_num_items, _token_sum),
    "fairseq_label_smoothed": ("tok", fairseq_label_smoothed,
                               lambda o, d: fairseq_label_smoothed(o, d) / (1 - 0.1 - 0.1 / 6)),
    "token_view_labels_shape": ("tok", token_loss_view_labels, _all_tokens_sum),
    "token_view_size0": ("tok", token_loss_view_size0, _all_tokens_sum),
    "token_python_ints": ("tok", token_loss_python_ints, _all_tokens_sum),
    "token_time_first": ("tok", token_loss_time_first, _all_tokens_sum),
    "masked_token_mean": ("tok", masked_token_mean, _all_tokens_sum),
    "per_example_token_mean": ("tok", per_example_token_mean, per_example_token_mean),
    "stacked_time_steps": ("tok", stacked_time_steps, stacked_time_steps),
    "summed_time_steps": ("tok", summed_time_steps, lambda o, d: summed_time_steps(o, d) * T),
    "sum_over_size0": ("cls", sum_over_size0, sum_over_size0),
    "sum_over_len": ("cls", sum_over_len, sum_over_len),
    "sum_over_shape0": ("cls", sum_over_shape0, sum_over_shape0),
    "sum_over_batch_size": ("cls", sum_over_batch_size, plain_cross_entropy),
    "grad_accumulation": ("cls", grad_accumulation, plain_cross_entropy),
    "times_reciprocal": ("cls", times_reciprocal, times_reciprocal),
    "plain_cross_entropy": ("cls", plain_cross_entropy, plain_cross_entropy),
    "label_smoothing": ("cls", label_smoothing, label_smoothing),
    "timm_label_smoothing": ("cls", timm_label_smoothing, timm_label_smoothing),
    "timm_soft_target": ("cls", timm_soft_target, timm_soft_target),
    "class_weights": ("cls", class_weights,
                      lambda o, d: F.cross_entropy(o, d["labels"], weight=torch.tensor(
                          [1.0, 2.0, 0.5]), reduction="sum")),
    "focal": ("cls", focal, focal),
    "multi_label_bce": ("cls", multi_label_bce, multi_label_bce),
    "multi_label_soft_margin": ("cls", multi_label_soft_margin, multi_label_soft_margin),
    "distillation_batchmean": ("tok", distillation_batchmean,
                               lambda o, d: distillation_batchmean(o, d) / 4.0),
    "distillation_kl_module": ("tok", distillation_kl_module, distillation_kl_module),
    "example_weights": ("cls", example_weights, example_weights),
    "mse_regression": ("reg", mse_regression, mse_regression),
    "smooth_l1": ("reg", smooth_l1, smooth_l1),
    "huber_sum_over_len": ("reg", huber_sum_over_len, huber_sum_over_len),
    "gaussian_nll_by_hand": ("reg", gaussian_nll_by_hand,
                             lambda o, d: gaussian_nll_by_hand(o, d) * 2),
    "gaussian_nll_module": ("reg", gaussian_nll_module, gaussian_nll_module),
    "gaussian_nll_full_sum": ("reg", gaussian_nll_full_sum, gaussian_nll_full_sum),
    "gaussian_nll_float_var": ("reg", gaussian_nll_float_var, gaussian_nll_float_var),
    "half_the_loss": ("cls", half_the_loss, plain_cross_entropy),
    "negated_log_likelihood": ("cls", negated_log_likelihood, negated_log_likelihood),
    "multi_task": ("all", multi_task, multi_task),
    "multi_task_sums_over_len": ("all", multi_task_sums_over_len, multi_task_sums_over_len),
    "ctc": ("tok", ctc, ctc),
    "cosine_embedding": ("reg", cosine_embedding, cosine_embedding),
    "bert_pretraining": ("all", bert_pretraining, bert_pretraining_term),
    "lm_plus_distillation": ("tok", lm_plus_distillation, lm_plus_distillation_term),
}
_OUTPUT = {"tok": 0, "cls": 1, "reg": 2}


def _apply(which, f, outs, d):
    return f(outs, d) if which == "all" else f(outs[_OUTPUT[which]], d)


def _slice(d, i):
    return {k: v[i:i + 1] for k, v in d.items()}


def _per_example(model, which, term, ids, d):
    """Each example's gradient of its own term, from a batch of one."""
    params = [p for p in model.parameters()]
    grads = []
    for i in range(ids.shape[0]):
        loss = _apply(which, term, model(ids[i:i + 1]), _slice(d, i))
        g = torch.autograd.grad(loss, params, allow_unused=True)
        grads.append([torch.zeros_like(p) if x is None else x for x, p in zip(g, params)])
    return grads


def _reference(grads, bound, denom):
    total = [torch.zeros_like(g) for g in grads[0]]
    for g in grads:
        norm = float(torch.sqrt(sum(x.pow(2).sum() for x in g)))
        factor = min(1.0, bound / (norm + CLIP_EPS))
        for t, x in zip(total, g):
            t += x * factor
    return [t / denom for t in total]


def _bites(grads):
    """A bound that clips about half the examples (a wrong per-example scale then shows)."""
    norms = sorted(float(torch.sqrt(sum(x.pow(2).sum() for x in g))) for g in grads)
    return norms[len(norms) // 2] * (1.0 if len(norms) > 1 else 0.5)


def _dpfx_step(dp, model, which, loss, ids, d):
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpfx.LossScaleWarning)
        _apply(which, loss, dp(ids), d).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]


def _assert_close(name, model, got, want):
    for (k, _), g, w in zip(model.named_parameters(), got, want):
        torch.testing.assert_close(g, w, rtol=2e-4, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_per_example_losses_match_reference(name):
    """Batch sizes 3 and 1 through one compiled model (mean), 4 (= T, sum), a bound that bites;
    an empty batch releases zeros. By default one of the two reductions (tests/sweep.py)."""
    which, loss, term = CORPUS[name]
    wanted = reductions(sorted(CORPUS), name)       # tests/sweep.py
    for batches, reduction in (((3, 1), "mean"), ((4,), "sum")):
        if reduction not in wanted:
            continue
        torch.manual_seed(0)
        model = Net()
        data = [_batch(b, seed=b) for b in batches]
        grads = [_per_example(model, which, term, ids, d) for ids, d in data]
        bound = _bites([g for per_batch in grads for g in per_batch])
        dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0,
                          loss_reduction=reduction, backend="eager")
        for batch, (ids, d), g in zip(batches, data, grads):
            got = _dpfx_step(dp, model, which, loss, ids, d)
            _assert_close(f"{name} B={batch} {reduction}", model, got,
                          _reference(g, bound, batch if reduction == "mean" else 1))
    if "sum" not in wanted:
        return          # an empty batch needs D under "mean": the sum run takes it
    ids, d = _batch(0)
    try:
        _apply(which, loss, model(ids), d)
    except (ZeroDivisionError, RuntimeError):
        return          # the idiom itself fails on an empty batch (1.0 / len(y), view(0, -1))
    got = _dpfx_step(dp, model, which, loss, ids, d)
    assert all(float(g.abs().max()) == 0 for g in got)


def test_per_example_losses_through_inductor():
    """Every idiom through Inductor on one model: with a bound no example reaches (the scale of
    each example's gradient) and with one every example exceeds (its direction)."""
    torch.manual_seed(0)
    model = Net()
    for bound in (1e6, 1e-4):
        dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0)
        for name in sorted(CORPUS):
            which, loss, term = CORPUS[name]
            for batch in (3, 1):
                ids, d = _batch(batch, seed=batch)
                grads = _per_example(model, which, term, ids, d)
                got = _dpfx_step(dp, model, which, loss, ids, d)
                _assert_close(f"{name} B={batch} C={bound}", model, got,
                              _reference(grads, bound, batch))


@pytest.mark.parametrize("name", ["hf_causal_lm", "masked_token_mean", "bert_pretraining"])
def test_a_batch_with_every_token_ignored(name):
    """A token mean over a batch whose tokens are all ignored divides by a count of 0 (the loss
    is NaN): its term is empty and left out, the others keep their scale (BERT's next-sentence
    term, clipped as on any other step), and nothing raises. Through Inductor, bound biting."""
    which, loss, term = CORPUS[name]
    torch.manual_seed(0)
    model = Net()
    ids, d = _batch(3)
    d["tokens"][:] = IGNORE
    grads = _per_example(model, which, term, ids, d)
    bound = _bites(grads)
    dp = dpfx.compile(model, max_grad_norm=max(bound, 1e-3), noise_multiplier=0.0)
    got = _dpfx_step(dp, model, which, loss, ids, d)
    _assert_close(name, model, got, _reference(grads, max(bound, 1e-3), 3))


# -- coupled losses --------------------------------------------------------------------------
def _ohem(cls, d):
    """Online hard example mining: the batch's k hardest examples."""
    per = F.cross_entropy(cls, d["labels"], reduction="none")
    return per.topk(2).values.mean()


def _batch_softmax(cls, d):
    """Attention over the batch's examples (InfoNCE written over dim 0)."""
    return -(F.log_softmax(cls, dim=0) * F.one_hot(d["labels"], K)).sum()


def _in_batch_negatives(reg, d):
    """Triplet loss with the next example as the negative."""
    return F.triplet_margin_loss(reg, d["target"], reg.roll(1, 0))


def _pairwise(reg, d):
    return torch.cdist(reg, reg).mean()


def _batch_median(cls, d):
    return F.cross_entropy(cls, d["labels"], reduction="none").median()


def _ranks(cls, d):
    per = F.cross_entropy(cls, d["labels"], reduction="none")
    return (per * per.argsort().argsort().float()).mean()


def _normalized_by_batch(reg, d):
    return F.mse_loss(reg / reg.norm(dim=0), d["target"])


def _detached_batch_scale(cls, d):
    """A batch statistic of the outputs, detached, as a weight: no gradient flows through it,
    but it rescales every example's gradient."""
    return F.cross_entropy(cls, d["labels"]) * cls.detach().abs().mean()


def _margin_ranking_neighbours(reg, d):
    return F.margin_ranking_loss(reg[:-1, 0], reg[1:, 0], torch.ones(len(reg) - 1))


def _logsumexp_batch(cls, d):
    return torch.logsumexp(cls, 0).sum()


def _gaussian_nll_batch_variance(reg, d):
    """The Gaussian NLL with the batch's variance of the predictions as every example's."""
    mean = reg[:, :1]
    return F.gaussian_nll_loss(mean, d["target"][:, :1], mean.var(0, keepdim=True).expand_as(mean))


COUPLED = {   # name: (output, loss, the op the refusal names)
    "ohem_topk": ("cls", _ohem, "topk"),
    "batch_softmax": ("cls", _batch_softmax, "amax"),
    "in_batch_negatives": ("reg", _in_batch_negatives, "index.Tensor"),
    "pairwise_cdist": ("reg", _pairwise, None),
    "batch_median": ("cls", _batch_median, "median"),
    "ranks": ("cls", _ranks, "sort"),
    "normalized_by_batch": ("reg", _normalized_by_batch, None),
    "detached_batch_scale": ("cls", _detached_batch_scale, None),
    "margin_ranking_neighbours": ("reg", _margin_ranking_neighbours, None),
    "logsumexp_batch": ("cls", _logsumexp_batch, "amax"),
    "gaussian_nll_batch_variance": ("reg", _gaussian_nll_batch_variance, None),
}


@pytest.mark.parametrize("name", sorted(COUPLED))
def test_coupled_losses_are_refused(name):
    """Refused at backward with the op and the line, before anything is written."""
    which, loss, op = COUPLED[name]
    torch.manual_seed(0)
    model = Net()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    ids, d = _batch(5)
    with pytest.raises(dpfx.PrivacyError) as info:
        _apply(which, loss, dp(ids), d).backward()
    message = str(info.value)
    assert "test_loss_corpus.py:" in message, message
    if op is not None:
        assert f"op {op}" in message, message
    assert all(p.grad is None for p in model.parameters())


def _selected_rows_mean(tok, d):
    """Token losses of the rows a boolean mask selects, averaged (``loss[mask].mean()``)."""
    per = F.cross_entropy(tok.reshape(-1, V), d["tokens"].reshape(-1).clamp(min=0),
                          reduction="none")
    return per[(d["tokens"] != IGNORE).reshape(-1)].mean()


def _masked_select_mean(tok, d):
    per = F.cross_entropy(tok.transpose(1, 2), d["tokens"].clamp(min=0), reduction="none")
    return per.masked_select(d["tokens"] != IGNORE).mean()


@pytest.mark.parametrize("loss", [_selected_rows_mean, _masked_select_mean])
def test_rows_selected_by_a_mask_are_refused_with_the_masked_form(loss):
    """Rows selected by a boolean mask have a data-dependent count, which the replay cannot
    prove per example: refused before anything is written, naming the masked form that trains
    (``masked_token_mean`` above: the same loss, proven and exact)."""
    torch.manual_seed(0)
    model = Net()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    ids, d = _batch(5)
    with pytest.raises(dpfx.PrivacyError) as info:
        loss(dp(ids)[0], d).backward()
    message = str(info.value)
    assert "test_loss_corpus.py:" in message and "(loss * mask).sum() / mask.sum()" in message, \
        message
    assert all(p.grad is None for p in model.parameters())


# -- the auditor's test ----------------------------------------------------------------------
CANARY_IDIOMS = ["sum_over_size0", "sum_over_len", "sum_over_shape0", "plain_cross_entropy",
                 "distillation_batchmean", "hf_causal_lm", "masked_token_mean",
                 "multi_task_sums_over_len", "times_reciprocal", "token_python_ints",
                 "bert_pretraining", "lm_plus_distillation", "gaussian_nll_full_sum"]


def _neighbours():
    """Eight equal examples and a different ninth (the canary)."""
    ids, d = _batch(9, seed=11)
    for v in [ids, *d.values()]:
        v[:8] = v[0]
    return ids, d


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("name", CANARY_IDIOMS)
def test_one_added_example_moves_the_release_by_at_most_C_over_D(name, reduction):
    """sigma 0: the release with and without the canary differs by at most C/D, whichever way
    the loss writes the batch size. The bound is set so that the eight equal examples are not
    clipped: a batch-size factor kept inside their terms would move all eight."""
    which, loss, term = CORPUS[name]
    torch.manual_seed(0)
    model = Net()
    ids, d = _neighbours()
    grads = _per_example(model, which, term, ids, d)
    norm = float(torch.sqrt(sum(x.pow(2).sum() for x in grads[0])))
    bound, expected = norm * 1.5, 6
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0, loss_reduction=reduction,
                      expected_batch_size=expected if reduction == "mean" else None,
                      backend="eager")
    base = _dpfx_step(dp, model, which, loss, ids[:8], _slice_to(d, 8))
    added = _dpfx_step(dp, model, which, loss, ids, d)
    moved = float(torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(added, base))))
    limit = bound / (expected if reduction == "mean" else 1)
    assert moved <= limit * (1 + 1e-4), (moved, limit)


def _clipped_sum(grads, bound, scale):
    """sum_i clip(scale * g_i): what a release is when ``scale`` stays in each example's term."""
    total = [torch.zeros_like(x) for x in grads[0]]
    for g in grads:
        g = [x * scale for x in g]
        factor = min(1.0, bound / (float(torch.sqrt(sum(x.pow(2).sum() for x in g))) + CLIP_EPS))
        for t, x in zip(total, g):
            t += x * factor
    return total


def test_the_auditor_catches_a_batch_size_kept_in_each_term():
    """The positive control of the test above: with the 1/B of ``sum / len(y)`` kept in each
    example's term (what dpfx did before it removed scalars applied after the batch reduction),
    the same neighbours move the release by more than C; dpfx's release moves by at most C."""
    which, loss, term = CORPUS["sum_over_len"]
    torch.manual_seed(0)
    model = Net()
    ids, d = _neighbours()
    grads = _per_example(model, which, term, ids, d)
    norm = float(torch.sqrt(sum(x.pow(2).sum() for x in grads[0])))
    bound = norm / 8 * 1.01           # g/8 escapes clipping, g is clipped
    kept = [_clipped_sum(grads[:n], bound, 1.0 / n) for n in (8, 9)]
    assert float(torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(*kept)))) > bound
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0, loss_reduction="sum",
                      backend="eager")
    base = _dpfx_step(dp, model, which, loss, ids[:8], _slice_to(d, 8))
    added = _dpfx_step(dp, model, which, loss, ids, d)
    assert float(torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(added, base)))) <= \
        bound * (1 + 1e-4)
    want = _clipped_sum(grads, bound, 1.0)
    for g, w in zip(added, want):
        torch.testing.assert_close(g, w, rtol=2e-4, atol=1e-6)


def _slice_to(d, n):
    return {k: v[:n] for k, v in d.items()}


# -- the batch's own tensors (dpfx's loader) -------------------------------------------------
LABEL_STATISTICS = {   # computed from the batch's labels before they meet an output
    "class_balanced_weights": lambda cls, y, x: F.cross_entropy(
        cls, y, weight=1.0 / torch.bincount(y, minlength=K).clamp(min=1).float()),
    "class_balanced_gather": lambda cls, y, x: (F.cross_entropy(cls, y, reduction="none") * (
        1.0 / torch.bincount(y, minlength=K).clamp(min=1).float())[y]).mean(),
    "centered_targets": lambda cls, y, x: F.mse_loss(cls[:, 0], y.float() - y.float().mean()),
    "targets_scaled_by_batch_max": lambda cls, y, x: F.mse_loss(cls[:, 0], y.float() / y.max()),
    "labels_shuffled": lambda cls, y, x: F.cross_entropy(cls, y[torch.randperm(len(y))]),
}


def _loader_batch(n=6):
    from dpfx.data import PoissonLoader

    ids, d = _batch(n, seed=5)
    loader = PoissonLoader(torch.utils.data.TensorDataset(ids, d["labels"]),
                           batch_sampler=[list(range(n))])
    return next(iter(loader))


@pytest.mark.parametrize("name", sorted(LABEL_STATISTICS))
def test_batch_statistics_of_the_labels_are_refused(name):
    torch.manual_seed(0)
    model = Net()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    ids, y = _loader_batch()
    with pytest.raises(dpfx.PrivacyError, match="couples examples") as info:
        LABEL_STATISTICS[name](dp(ids)[1], y, ids).backward()
    assert "test_loss_corpus.py:" in str(info.value)
    assert all(p.grad is None for p in model.parameters())


def test_inputs_computed_from_the_batch_are_refused():
    """An input standardized by the batch's statistics, or mixed with another example, couples
    examples before the graph: refused at the forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(T, 4))
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    ids, y = _loader_batch()
    x = ids.float()
    for bad in (lambda: (x - x.mean(0)) / x.std(0), lambda: 0.5 * x + 0.5 * x.flip(0)):
        with pytest.raises(dpfx.PrivacyError, match="a model input couples examples"):
            dp(bad())
    out = dp((x - 5.0) / 3.0)            # per-example arithmetic with constants: fine
    F.cross_entropy(out, y).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_per_example_label_processing_through_the_loader_matches_reference():
    """Labels moved, cast, masked and one-hot encoded per example, through dpfx's loader and
    Inductor: the same gradient as the batch-of-one reference."""
    torch.manual_seed(0)
    model = Net()
    ids, y = _loader_batch()

    def loss(cls, y):
        y = y.to(cls.device).long()
        soft = F.one_hot(y, K).float() * 0.9 + 0.1 / K
        keep = (y != 2).float()
        return (torch.sum(-soft * F.log_softmax(cls, -1), -1) * keep).sum() / len(y)

    def term(outs, d):
        return loss(outs[1], d["labels"]) * 1

    raw = {"labels": y.as_subclass(torch.Tensor)}
    plain_ids = ids.as_subclass(torch.Tensor)
    grads = _per_example(model, "all", term, plain_ids, raw)
    bound = _bites(grads)
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0)
    model.zero_grad(set_to_none=True)
    loss(dp(ids)[1], y).backward()
    got = [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
    _assert_close("loader labels", model, got, _reference(grads, bound, len(y)))


def test_grad_scaler_is_refused_not_silently_undone():
    """GradScaler.scale(loss) would be removed like any scalar on the loss, and unscale_ would
    then divide the release by the scale: refused with the fix, nothing written."""
    torch.manual_seed(0)
    model = Net()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    ids, d = _batch(3)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(dpfx.PrivacyError, match="GradScaler"):
        scaler.scale(F.cross_entropy(dp(ids)[1], d["labels"])).backward()
    assert all(p.grad is None for p in model.parameters())


def test_terms_on_their_own_scales():
    """A token mean plus a mean over examples: each term's batch-dependent scale removed on its
    own, through the loss's checked program (Note [Terms on their own scales]); a loss that
    then asks for torch.autograd.grad is refused, not computed another way."""
    which, loss, term = CORPUS["bert_pretraining"]
    torch.manual_seed(0)
    model = Net()
    dp = dpfx.compile(model, max_grad_norm=1e6, noise_multiplier=0.0)
    for batch in (3, 1):
        ids, d = _batch(batch, seed=batch)
        got = _dpfx_step(dp, model, which, loss, ids, d)
        _assert_close(f"B={batch}", model, got,
                      _reference(_per_example(model, which, term, ids, d), 1e6, batch))
    ids, d = _batch(3)
    with pytest.raises(dpfx.PrivacyError, match="loss.backward"):
        torch.autograd.grad(_apply(which, loss, dp(ids), d), list(model.parameters()))


def test_term_weights_follow_a_schedule_but_not_the_batch_size():
    """A weight annealed over steps (a VAE's KL warm-up) trains; a weight that is the batch size
    as a Python number (one term divided by len(y), the other not) is refused once the batch
    size changes, parameters untouched."""
    torch.manual_seed(0)
    model = Net()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    for step, batch in enumerate((4, 3, 5)):
        ids, d = _batch(batch, seed=step)
        beta = min(1.0, 0.1 * (step + 1))
        outs = dp(ids)
        (F.cross_entropy(outs[1], d["labels"]) + beta * outs[2].pow(2).mean()).backward()
    for step, batch in enumerate((4, 3)):
        ids, d = _batch(batch, seed=step)
        outs = dp(ids)
        loss = F.cross_entropy(outs[1], d["labels"], reduction="sum") / len(d["labels"]) + \
            outs[2].pow(2).sum()
        model.zero_grad(set_to_none=True)
        if step == 0:
            loss.backward()
            continue
        with pytest.raises(dpfx.PrivacyError, match="changed with the batch size"):
            loss.backward()
        assert all(p.grad is None for p in model.parameters())


def test_the_auditors_test_through_inductor():
    """The canary test of a few idioms on the default backend: one Inductor module, the bound
    set by the eight equal examples' own norm."""
    torch.manual_seed(0)
    model = Net()
    ids, d = _neighbours()
    names = ["sum_over_len", "token_python_ints", "bert_pretraining"]
    norms = []
    for name in names:
        which, _, term = CORPUS[name]
        g = _per_example(model, which, term, ids, d)[0]
        norms.append(float(torch.sqrt(sum(x.pow(2).sum() for x in g))))
    bound = max(norms) * 1.5
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0, loss_reduction="sum")
    for name in names:
        which, loss, _ = CORPUS[name]
        base = _dpfx_step(dp, model, which, loss, ids[:8], _slice_to(d, 8))
        added = _dpfx_step(dp, model, which, loss, ids, d)
        moved = float(torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(added, base))))
        assert moved <= bound * (1 + 1e-4), (name, moved, bound)
