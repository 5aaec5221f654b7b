"""Model families as people train them, through Inductor with the self-check on, against a
batch-of-one autograd loop (tests/support/reference.py), at batch sizes 3, 0, 1 and 8 (the sequence
length: a batch equal to another dim).

Hugging Face models come from small configs (random init, nothing downloaded) and are called the
usual way: causal LMs without an attention mask and with ``use_cache=False`` (what gradient
checkpointing forces), with ``labels=``; encoder-decoders with their default config (cache on);
BERT with ``gradient_checkpointing_enable()``. transformers' code compares the batch size with
constants on these paths (``batch_size != position_ids.shape[0]``, ``keys.numel() == 0``): each
graph then serves the sizes where the comparisons come out as at capture, and a flipped one
compiles another (Note [Deciding a branch on the batch size] in dpfx/capture/batch_branches.py); the
tests check that every size gets the model's own answer.

The default run has one model per mechanism; the wide sweep is marked slow.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from support.models import ChannelsLastLinearPool
from support.reference import assert_close, clip_fraction, loop_dp_sgd_grads, run_dpfx_multi

try:
    import transformers
except ImportError:         # the Hugging Face tests skip; the others run
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="needs transformers")

VOCAB, T, C = 97, 8, 0.05
SIZES = (3, 0, 1, T)


def batch_dp_sgd_grads(model, loss_fn, inputs, y, *, max_grad_norm, loss_reduction):
    """The DP-SGD gradient (sigma = 0) of the model as eager runs it on the whole batch: example
    i's gradient is that of its own loss in one forward of the batch (for models whose code
    branches on the batch size, a batch-of-one loop would run another branch)."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    total = {k: torch.zeros_like(p) for k, p in params.items()}
    out = model(*inputs)
    for i in range(y.shape[0]):
        g = torch.autograd.grad(loss_fn(out[i:i + 1], y[i:i + 1]), list(params.values()),
                                retain_graph=True)
        norm = torch.sqrt(sum(gi.pow(2).sum() for gi in g))
        factor = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        for k, gi in zip(params, g):
            total[k] += gi * factor
    denom = (y.shape[0] or 1) if loss_reduction == "mean" else 1
    return {k: v / denom for k, v in total.items()}


def check(model, make_input, loss_fn, make_target, *, graphs=None, backend="inductor",
          reference=None, sizes=SIZES, reductions=("mean", "sum"), want_fn=loop_dp_sgd_grads):
    """dpfx's DP-SGD gradient (sigma = 0, C small enough that clipping bites) equals the loop's
    at every size, for each loss reduction; returns dpfx's compiled module."""
    model.train()
    reference = reference or model
    for reduction in reductions:
        torch._dynamo.reset()
        dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend=backend,
                          loss_reduction=reduction,
                          expected_batch_size=4 if reduction == "mean" else None)
        for b in sizes:
            x, y = make_input(b), make_target(b)
            got = run_dpfx_multi(dp, model, loss_fn, (x,), y, reduction)
            want = want_fn(reference, loss_fn, (x,), y, max_grad_norm=C,
                           loss_reduction=reduction)
            if reduction == "mean" and b:
                want = {k: v * b / 4 for k, v in want.items()}
            try:
                assert_close(got, want, rtol=1e-4, atol=1e-6)
            except AssertionError as e:
                raise AssertionError(f"{reduction}, batch size {b}: {e}") from None
            if b == 0:
                assert all(torch.count_nonzero(g) == 0 for g in got.values())
        if graphs is not None:
            assert len(dp._dpfx_entries) == graphs, [e.decisions for e in dp._dpfx_entries]
    return dp


def token_ids(b):
    return torch.randint(1, VOCAB, (b, T), generator=torch.Generator().manual_seed(b))


def lm_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def class_target(n):
    return lambda b: torch.randint(0, n, (b,), generator=torch.Generator().manual_seed(b + 1))


def token_target(b):
    return torch.randint(0, VOCAB, (b, T), generator=torch.Generator().manual_seed(b + 2))


# -- Hugging Face ----------------------------------------------------------------------------------
class CausalLM(nn.Module):
    """ids -> logits, no attention mask, no cache; ``labels=`` passed when asked (the model's own
    loss is computed and left unused here: test_hf_labels.py checks losses computed inside the
    model)."""

    def __init__(self, model, labels=False):
        super().__init__()
        self.model, self.labels = model, labels

    def forward(self, ids):
        labels = ids if self.labels else None
        return self.model(input_ids=ids, use_cache=False, labels=labels).logits


def gpt2(**kw):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **kw))


def llama(**kw):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64, **kw))


@needs_transformers
def test_causal_lm_without_mask():
    """transformers' masking code asks ``batch_size != 1``; B = 1 gets its
    own graph (two in all), every size the model's own answer. ("sum": the slow sweep.)"""
    torch.manual_seed(0)
    dp = check(CausalLM(gpt2()), token_ids, lm_loss, token_target, graphs=2,
               reductions=("mean",))
    decided = [str(d) for e in dp._dpfx_entries for d in e.decisions]
    assert all("masking_utils.py" in d and "Ne(u0, 1)" in d for d in decided), decided


class Classifier(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, attention_mask=(ids > 3).long()).logits


def bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3))


@needs_transformers
def test_bert_gradient_checkpointing():
    """Case 2: the self-check meets the recomputed region's size symbol and saved RNG state."""
    torch.manual_seed(0)
    model, plain = bert(), bert()
    plain.load_state_dict(model.state_dict())
    model.gradient_checkpointing_enable()
    check(Classifier(model), token_ids, F.cross_entropy, class_target(3),
          reference=Classifier(plain), graphs=1, sizes=(3, 0, 1), reductions=("mean",))


# -- vision blocks ---------------------------------------------------------------------------------
class ConvNeXtBlock(nn.Module):
    """torchvision's CNBlock: depthwise conv, Linear on a channels-last permute, layer scale,
    stochastic depth (identity in this test: p = 0 keeps the reference deterministic), then
    adaptive average pooling and a LayerNorm head."""

    def __init__(self, dim=8, classes=3):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), 0.5))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = self.dw(x).permute(0, 2, 3, 1)
        h = self.fc2(F.gelu(self.fc1(self.norm(h)))).permute(0, 3, 1, 2)
        x = x + self.layer_scale * h
        return self.head(self.head_norm(self.pool(x).flatten(1)))


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_convnext_block(backend):
    """Case 4: channels-last Linear, layer scale, adaptive pooling."""
    torch.manual_seed(0)
    check(ConvNeXtBlock(), lambda b: torch.randn(b, 8, 6, 6), F.cross_entropy, class_target(3),
          graphs=1, backend=backend,
          reductions=("mean",) if backend == "eager" else ("mean", "sum"))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_linear_on_permuted_activation_then_pooling(backend):
    """tests/support/models.py's ChannelsLastLinearPool (Note [as_strided reads storage] in
    dpfx/graph/batch.py): the backward's scatter and read keep each example's gradient in its
    own block of the flat buffer (a batch of 6 equals the hidden width). The pooling takes its
    memory format from the permuted input's strides, which eager reads otherwise at B = 0 and
    B = 1 (a size-1 dim's stride is free): three graphs, the general one compiled last."""
    torch.manual_seed(0)
    model, image = ChannelsLastLinearPool(), lambda b: torch.randn(b, 3, 5, 5)
    assert clip_fraction(model, F.cross_entropy, image(6), class_target(3)(6), C) == 1.0
    dp = check(model, image, F.cross_entropy, class_target(3), graphs=3, backend=backend,
               sizes=(0, 1, 3, 6), reductions=("mean",) if backend == "eager" else ("mean", "sum"))
    rules = {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}
    assert rules["fc.weight"] == ["mm"] and rules["conv.weight"] == ["convolution"], rules
    verified = dp._dpfx_backend.stages.graphs["backward.private"]
    assert "aten.as_strided_scatter(" in verified and "aten.as_strided(" in verified, verified


class TimeFirstEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16, padding_idx=0)
        self.rnn_in = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        h = torch.tanh(self.rnn_in(self.emb(ids.t())))    # (T, B, d): time-first
        return self.head(h.mean(0))


@pytest.mark.filterwarnings("ignore::dpfx.LossScaleWarning")  # the loss's scale changed: expected
def test_time_first_embedding():
    """Case 5: the embedding's index carries the batch in dim 1."""
    torch.manual_seed(0)
    dp = check(TimeFirstEmbedding(), token_ids, F.cross_entropy, class_target(3), graphs=1,
               reductions=("sum",))
    rules = {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}
    assert rules["emb.weight"] == ["embedding"], rules


# -- the mechanism on a model of our own -----------------------------------------------------------
class SingleExampleBranch(nn.Module):
    """Model code that treats a batch of one, and one of T, differently (as eager runs it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(T, 3)

    def forward(self, x):
        h = self.fc(x)
        if x.shape[0] == 1:
            h = h * 3.0
        if x.shape[0] == x.shape[1]:
            h = torch.tanh(h)
        return h


def test_batch_branch_routing():
    """Note [Deciding a branch on the batch size]: sizes 3 and 5 share a graph; 1 and T (= 8)
    each flip a decision and get their own, with the model's answer; 0 shares the first."""
    torch.manual_seed(0)
    dp = check(SingleExampleBranch(), lambda b: torch.randn(b, T), F.cross_entropy,
               class_target(3), backend="eager", sizes=(3, 0, 1, T, 5, 1), graphs=3,
               want_fn=batch_dp_sgd_grads)
    where = {d.where.split(":")[0] for e in dp._dpfx_entries for d in e.decisions}
    assert where == {__file__}, where


class LoopOverExamples(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        h = self.fc(x)
        return torch.stack([h[i] * 2 for i in range(x.shape[0])])


def test_batch_as_python_number_is_a_clear_error():
    """Case 6: the CaptureError names the model's line, the expression and the fix that
    applies (not another construct's)."""
    model = LoopOverExamples()
    before = [p.detach().clone() for p in model.parameters()]
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    with pytest.raises(dpfx.CaptureError) as e:
        dp(torch.randn(3, 3))
    message = str(e.value)
    assert "Python number (u0)" in message and "tensor ops" in message, message
    assert f"{__file__}:" in message and "for i in range(x.shape[0])" in message, message
    assert "h @ W" not in message
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


# -- the wide sweep --------------------------------------------------------------------------------
class Seq2Seq(nn.Module):
    def __init__(self, model, labels=False):
        super().__init__()
        self.model, self.labels = model, labels

    def forward(self, ids):
        if self.labels:
            return self.model(input_ids=ids, labels=ids).logits
        return self.model(input_ids=ids, decoder_input_ids=ids).logits


def t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))


@pytest.mark.slow
@pytest.mark.parametrize("make", [
    lambda: CausalLM(llama()), lambda: CausalLM(gpt2(), labels=True),
    lambda: CausalLM(llama(), labels=True), lambda: Seq2Seq(t5()),
    lambda: Seq2Seq(t5(), labels=True)],
    ids=["llama", "gpt2-labels", "llama-labels", "t5-default", "t5-labels"])
@needs_transformers
def test_hf_family(make):
    """T5 with its cache on (its code asks ``keys.numel() == 0``), LMs with ``labels=``."""
    torch.manual_seed(0)
    check(make(), token_ids, lm_loss, token_target)


@pytest.mark.slow
@needs_transformers
def test_causal_lm_without_mask_sum():
    torch.manual_seed(0)
    check(CausalLM(gpt2()), token_ids, lm_loss, token_target, graphs=2, reductions=("sum",))


@pytest.mark.slow
@needs_transformers
def test_gpt2_gradient_checkpointing_without_mask():
    torch.manual_seed(0)
    model, plain = gpt2(), gpt2()
    plain.load_state_dict(model.state_dict())
    model.gradient_checkpointing_enable()
    check(CausalLM(model), token_ids, lm_loss, token_target, reference=CausalLM(plain))
