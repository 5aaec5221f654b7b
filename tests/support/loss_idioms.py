"""Loss idioms as real training code writes them, with the model and data they run on: the
per-example losses of the plain loop's corpus (``CORPUS``: the source each follows is named), the
coupled ones dpfx refuses (``COUPLED``), and their batch-of-one reference. Shared by
tests/loss/test_loss_corpus.py (the plain loop) and tests/loss/test_loss_graph.py (the captured
loss). A refusal names the user's line: for these losses, a line of this file."""
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from support.reference import (CLIP_EPS, bound_that_bites, clipped_sum, loop_grads,
                               per_example_norms)

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


class Layer(nn.Module):
    """A residual block: the repeated unit of ``BlockNet``."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, h):
        return h + torch.tanh(self.fc(self.norm(h)))


class BlockNet(Net):
    """``Net`` with two residual blocks between the embedding and the heads: the model the
    corpus runs through per-block graphs (``blocks="auto"`` takes the ModuleList's layers)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, ids):
        h = torch.tanh(self.emb(ids))
        for layer in self.layers:
            h = layer(h)
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


def stacked_time_step_sums(tok, d):
    """Per-time-step batch sums, stacked, summed, over the batch size (sequence-model training
    loops): a stack of scalars, each a sum over the batch (Note [A stack of batch sums])."""
    y = d["tokens"]
    B = tok.shape[0]
    return torch.stack([F.cross_entropy(tok[:, t], y[:, t], reduction="sum")
                        for t in range(T)]).sum() / B


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
    "stacked_time_step_sums": ("tok", stacked_time_step_sums, stacked_time_step_sums),
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
    """Each example's gradient of its own term, from a batch of one: a list per example, in the
    order of ``model.parameters()``."""
    g = loop_grads(model, lambda i: _apply(which, term, model(ids[i:i + 1]), _slice(d, i)),
                   ids.shape[0])
    return [[v[i] for v in g.values()] for i in range(ids.shape[0])]


def _stacked(grads):
    return {j: torch.stack([g[j] for g in grads]) for j in range(len(grads[0]))}


def _reference(grads, bound, denom):
    return list(clipped_sum(_stacked(grads), bound, denom).values())


def _bites(grads):
    """A bound that clips about half the examples (a wrong per-example scale then shows)."""
    return bound_that_bites(per_example_norms(_stacked(grads)))


def _dpfx_step(dp, model, which, loss, ids, d):
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpfx.LossScaleWarning)
        _apply(which, loss, dp(ids), d).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]



def _neighbours():
    """Eight equal examples and a different ninth (the canary)."""
    ids, d = _batch(9, seed=11)
    for v in [ids, *d.values()]:
        v[:8] = v[0]
    return ids, d


def _slice_to(d, n):
    return {k: v[:n] for k, v in d.items()}


def _clipped_sum(grads, bound, scale):
    """sum_i clip(scale * g_i): what a release is when ``scale`` stays in each example's term."""
    total = [torch.zeros_like(x) for x in grads[0]]
    for g in grads:
        g = [x * scale for x in g]
        factor = min(1.0, bound / (float(torch.sqrt(sum(x.pow(2).sum() for x in g))) + CLIP_EPS))
        for t, x in zip(total, g):
            t += x * factor
    return total

def _assert_close(name, model, got, want):
    for (k, _), g, w in zip(model.named_parameters(), got, want):
        torch.testing.assert_close(g, w, rtol=2e-4, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")


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


CANARY_IDIOMS = ["sum_over_size0", "sum_over_len", "sum_over_shape0", "plain_cross_entropy",
                 "distillation_batchmean", "hf_causal_lm", "masked_token_mean",
                 "multi_task_sums_over_len", "times_reciprocal", "token_python_ints",
                 "bert_pretraining", "lm_plus_distillation", "gaussian_nll_full_sum",
                 "stacked_time_step_sums"]
