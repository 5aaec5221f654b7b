"""Row-wise ops on a dim that merges the batch with another dim, through Inductor with the
self-check on, against the batch-of-one autograd loop of tests/support/reference.py.

A model may flatten each example's rows into the batch dim: HF OPT runs its last LayerNorm on
hidden states flattened to (B*T, d); augmentation multiplicity (De et al. 2022) flattens K views
of each image, (B, K, C, H, W) -> (B*K, C, H, W), runs a convolution and a GroupNorm, and averages
each example's K losses. The batch analysis follows the merged dim through the flatten (Note
[Multi-output ops inherit per output] in dpfx/graph/batch.py), the forward check proves that each
op reads only its rows (Note [Ops that read across dims they do not name] in
passes/verify/forward.py), and the convolution rule sums each example's K rows (Note [A convolution over K rows per
example] in rules/convolution.py). Batch sizes include 1 and one equal to the merged factor (T or
K), where a shape alone cannot tell the batch from the other dim. Ops that do read across the
batch stay refused.

HF ConvNeXt hands its depthwise convolutions tensors with channels-last strides made inside the
model (Note [Channels-last strides made inside the model] in dpfx/capture/swaps.py).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from support.reference import assert_close, loop_dp_sgd_grads, run_dpfx_multi

transformers = pytest.importorskip("transformers")

C = 0.05
TOL = {"rtol": 2e-4, "atol": 1e-6}


def check(model, make, loss_fn, batches, *, clip=C, backend="inductor", graphs=1):
    """dpfx through ``backend`` equals the reference at every batch size, in ``graphs`` captures
    (one serves every size unless the model branches on the batch size); returns {parameter:
    rules}."""
    dp = dpfx.compile(model, max_grad_norm=clip, noise_multiplier=0.0, backend=backend)
    for b in batches:
        inputs, y = make(b)
        got = run_dpfx_multi(dp, model, loss_fn, inputs, y)
        want = loop_dp_sgd_grads(model, loss_fn, inputs, y, max_grad_norm=clip)
        try:
            assert_close(got, want, **TOL)
        except AssertionError as e:
            raise AssertionError(f"batch size {b}: {e}") from None
    assert dp.compile_count == 2 * graphs
    return {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}


# -- HF OPT: LayerNorm on (B*T, d) -----------------------------------------------------------------
T, VOCAB = 6, 40


class OPTLogits(nn.Module):
    """(B, T) ids -> (B, T, V) logits of a tiny OPTForCausalLM (dropout 0)."""

    def __init__(self, layers=1):
        super().__init__()
        config = transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=layers, ffn_dim=32,
            num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
            bos_token_id=0, eos_token_id=2)
        self.model = transformers.OPTForCausalLM(config)

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


def lm_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


@pytest.mark.filterwarnings("ignore::dpfx.LossScaleWarning")  # the loss's scale changed: expected
def test_opt_layer_norm_on_flattened_hidden_states():
    torch.manual_seed(0)
    model = OPTLogits()
    make = lambda b: ((torch.randint(3, VOCAB, (b, T)),), torch.randint(3, VOCAB, (b, T)))  # noqa
    rules = check(model, make, lm_loss, [3, 1, T])
    final_ln = "model.model.decoder.layers.0.final_layer_norm"
    assert rules[f"{final_ln}.weight"] == ["sum"] and rules[f"{final_ln}.bias"] == ["sum"], rules
    assert rules["model.model.decoder.layers.0.fc1.weight"] == ["mm"], rules


# -- augmentation multiplicity: conv + GroupNorm on (B*K, C, H, W) ---------------------------------
K = 2


class AugmentationMultiplicity(nn.Module):
    """(B, K, 3, H, W): K augmented views of each image, run as B*K images through a conv, a
    GroupNorm and a depthwise conv, then a Linear: (B, K, 3) logits, one row per view."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        b, k = x.shape[:2]
        h = F.relu(self.norm(self.conv(x.flatten(0, 1))))
        h = self.depthwise(h).mean((2, 3))
        return self.fc(h).view(b, k, 3)


def views_loss(out, y):
    """Each example's loss is the mean of its K views' losses; the batch's is their mean."""
    k = out.shape[1]
    per_view = F.cross_entropy(out.flatten(0, 1), y.repeat_interleave(k), reduction="none")
    return per_view.view(-1, k).mean(1).mean()


def _views(b):
    return (torch.randn(b, K, 3, 5, 5),), torch.randint(0, 3, (b,))


@pytest.mark.parametrize("clip", [C, 1e3], ids=["clipped", "unclipped"])
def test_augmentation_multiplicity(clip):
    """Clipping that bites on every example, and none (which pins the scale of each example's
    mean over its K views)."""
    torch.manual_seed(0)
    rules = check(AugmentationMultiplicity(), _views, views_loss, [3, 1, K], clip=clip)
    assert rules["conv.weight"] == ["convolution"] and rules["conv.bias"] == ["convolution"]
    assert rules["depthwise.weight"] == ["convolution"], rules
    assert rules["norm.weight"] == ["sum"] and rules["norm.bias"] == ["sum"], rules


def test_augmentation_multiplicity_ghost_falls_back_to_materialize():
    """The ghost form is not offered for K rows per example: strategy="ghost" materializes those
    convolutions (and still takes the ghost form of the Linear), with the same gradients."""
    torch.manual_seed(0)
    model = AugmentationMultiplicity()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager",
                      strategy="ghost")
    inputs, y = _views(3)
    got = run_dpfx_multi(dp, model, views_loss, inputs, y)
    assert_close(got, loop_dp_sgd_grads(model, views_loss, inputs, y, max_grad_norm=C), **TOL)


class ViewsPermutedPool(nn.Module):
    """K views as B*K images, a Linear on the channels-last permute, permuted back and pooled to
    one position: Inductor restrides the pooled mean with as_strided, whose backward scatters
    into a flat (4*B*K,) buffer (Note [as_strided reads storage] in dpfx/graph/batch.py), each
    example's K rows in its own block."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 4), \
            nn.Linear(4, 3)

    def forward(self, x):
        b, k = x.shape[:2]
        h = self.fc(self.conv(x.flatten(0, 1)).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1).view(b, k, 4).mean(1))


def test_as_strided_scatter_over_merged_rows():
    torch.manual_seed(0)
    model = ViewsPermutedPool()
    make = lambda b: ((torch.randn(b, K, 3, 4, 4),), torch.randint(0, 3, (b,)))  # noqa: E731
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager")
    for b in (3, K, 1):
        inputs, y = make(b)
        assert_close(run_dpfx_multi(dp, model, F.cross_entropy, inputs, y),
                     loop_dp_sgd_grads(model, F.cross_entropy, inputs, y, max_grad_norm=C), **TOL)
    assert "aten.as_strided_scatter(" in dp._dpfx_backend.stages.graphs["backward.private"]


class TimeMajorViews(nn.Module):
    """K views flattened view-major, (K, B, ...) -> (K*B, ...): each example's rows are not
    together, so the convolution rule refuses rather than sum the wrong rows."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 3)

    def forward(self, x):
        b, k = x.shape[:2]
        h = self.conv(x.transpose(0, 1).flatten(0, 1)).mean((2, 3))
        return self.fc(h).view(k, b, 3).transpose(0, 1)


def test_view_major_rows_are_refused_by_the_conv_rule():
    model = TimeMajorViews()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, backend="eager")
    inputs, y = _views(3)
    with pytest.raises(dpfx.UnsupportedOpError, match=r"conv\.weight(.|\n)*each example's K rows"):
        run_dpfx_multi(dp, model, views_loss, inputs, y)


# -- ops that read across the batch stay refused ---------------------------------------------------
ACROSS = {
    "conv": lambda s, h: s.conv(h.t()[None]).squeeze(0).t(),            # kernel slides over B
    "group_norm": lambda s, h: s.norm(h.t()[None]).squeeze(0).t(),      # statistics over B
    "avg_pool": lambda s, h: F.avg_pool1d(h.t()[None], 3, 1, 1).squeeze(0).t(),
    "layer_norm_over_rows": lambda s, h: F.layer_norm(h.t(), h.t().shape[-1:]).t(),
}


class Across(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op, self.fc = op, nn.Linear(4, 3)
        self.conv = nn.Conv1d(4, 4, 3, padding=1).requires_grad_(False)
        self.norm = nn.GroupNorm(2, 4, affine=False)

    def forward(self, x):
        return self.fc(self.op(self, x))


@pytest.mark.parametrize("op", ACROSS)
def test_ops_across_the_batch_are_refused(op):
    """Note [Ops that read across dims they do not name]: a frozen convolution (no rule runs for
    it) whose kernel slides along the batch, a GroupNorm or a pooling over it, a LayerNorm over
    it. A convolution and a pooling keep the shape, so only the op's meaning says it mixes
    examples; the norms without affine parameters are decomposed into statistics that reduce
    over the batch."""
    dp = dpfx.compile(Across(ACROSS[op]), max_grad_norm=C, noise_multiplier=0.0, backend="eager")
    reason = "works along the batch dim" if op in ("conv", "avg_pool") else "reduces over the batch"
    with pytest.raises(dpfx.PrivacyError, match=reason):
        dp(torch.randn(5, 4))


class SplitOtherwise(nn.Module):
    """(B, T, d) flattened to (B*T, d), then viewed as (T, B, d): the rows of one example end up
    spread over the second dim's entries, which the batch analysis cannot prove."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        b, t, d = x.shape
        h = F.layer_norm(self.fc(x.flatten(0, 1)), (d,)).view(t, b, d)
        return self.head(h.mean(0))


def test_merged_dim_split_otherwise_is_refused():
    dp = dpfx.compile(SplitOtherwise(), max_grad_norm=C, noise_multiplier=0.0, backend="eager")
    with pytest.raises(dpfx.PrivacyError, match=r"splits or scrambles the batch dim"):
        dp(torch.randn(3, 5, 4))


# -- a constant broadcast over K rows per example (multiple choice) ---------------------------------
class ChoiceRows(nn.Module):
    """(B, K, d) flattened to (B*K, d) and added to a constant buffer expanded to the B*K rows,
    as HF's multiple-choice heads expand their token_type_ids (Note [A constant broadcast over
    k rows per example] in dpfx/graph/batch.py); ``time_major`` flattens (K, B, d) instead,
    ``statistic`` expands a batch statistic of the rows rather than the buffer."""

    def __init__(self, time_major=False, statistic=False):
        super().__init__()
        self.time_major, self.statistic = time_major, statistic
        self.emb, self.fc, self.head = nn.Embedding(2, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.register_buffer("kind", torch.zeros(1, dtype=torch.long))

    def forward(self, x):
        b, k, d = x.shape
        rows = (x.transpose(0, 1) if self.time_major else x).reshape(b * k, d)
        h = torch.tanh(self.fc(rows))
        if self.statistic:
            h = h + h.mean(0, keepdim=True).expand(b * k, d)
        else:
            h = h + self.emb(self.kind.expand(b * k))
        out = self.head(h).view(k, b) if self.time_major else self.head(h).view(b, k)
        return out.t() if self.time_major else out


def _choices(b):
    return (torch.randn(b, 3, 4),), torch.randint(0, 3, (b,))


def test_constant_broadcast_over_choice_rows():
    """Batch sizes 1, 3 (= K) and 4 through Inductor against the batch-of-one loop; the
    embedding read through the broadcast rows gets each example's K rows."""
    torch.manual_seed(0)
    check(ChoiceRows(), _choices, F.cross_entropy, [1, 3, 4])


@pytest.mark.parametrize("variant", ["time_major", "statistic"])
def test_constant_broadcast_does_not_hide_a_disagreement_or_a_statistic(variant):
    """Rows flattened the other way disagree with the broadcast's batch-major layout, and a batch
    statistic expanded to the rows is no constant: both stay refused."""
    dp = dpfx.compile(ChoiceRows(**{variant: True}), max_grad_norm=C, noise_multiplier=0.0,
                      backend="eager")
    match = "disagree|mixes the batch" if variant == "time_major" else "reduces over the batch"
    with pytest.raises(dpfx.PrivacyError, match=match):
        dp(torch.randn(5, 3, 4))


# -- HF ConvNeXt: channels-last strides made inside the model --------------------------------------
class ConvNextLogits(nn.Module):
    def __init__(self):
        super().__init__()
        config = transformers.ConvNextConfig(
            num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
            drop_path_rate=0.0, num_labels=3, image_size=8)
        self.model = transformers.ConvNextForImageClassification(config)

    def forward(self, x):
        return self.model(pixel_values=x).logits


def _images(b):
    return (torch.randn(b, 3, 8, 8),), torch.randint(0, 3, (b,))


@pytest.mark.slow
def test_convnext_channels_last_inside_the_model():
    torch.manual_seed(0)
    rules = check(ConvNextLogits(), _images, F.cross_entropy, [3, 1, 8])
    assert rules["model.convnext.encoder.stages.0.layers.0.dwconv.weight"] == ["convolution"]


def test_convnext_channels_last_inside_the_model_eager():
    """The same model on the eager backend: the copy is in the verified graphs."""
    torch.manual_seed(0)
    model = ConvNextLogits()
    check(model, _images, F.cross_entropy, [3, 1], backend="eager")


class PermutedLinearPool(nn.Module):
    """A Linear on the channels-last permute of a conv's output, permuted back and pooled to 2x2:
    the pooling read channels-last strides and its traced output strides were not eager's, so the
    next view failed on real tensors."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 6)
        self.head = nn.Linear(6 * 4, 3)

    def forward(self, x):
        h = self.fc(self.conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(F.adaptive_avg_pool2d(h, 2).flatten(1))


def test_pooling_of_a_permuted_activation():
    torch.manual_seed(0)
    make = lambda b: ((torch.randn(b, 3, 5, 5),), torch.randint(0, 3, (b,)))  # noqa: E731
    check(PermutedLinearPool(), make, F.cross_entropy, [3, 1, 6], backend="eager")


# -- Swin: window partition over (B * windows) rows ------------------------------------------------
def _swin_window_partition_model():
    """torchvision's Swin-T layout at toy size (shifted windows, patch merging, a permute before
    the pooled head), written out as torchvision writes it (torchvision is not a dependency)."""
    from support.swin import TinySwin
    return TinySwin()


@pytest.mark.slow
def test_swin_windows():
    torch.manual_seed(0)
    make = lambda b: ((torch.randn(b, 3, 8, 8),), torch.randint(0, 3, (b,)))  # noqa: E731
    # B = 1 gets its own graph: the pooled head's permuted input has strides eager reads
    # differently at B = 1
    # (tests/capture/test_model_families.py::test_linear_on_permuted_activation_...)
    rules = check(_swin_window_partition_model(), make, F.cross_entropy, [3, 1, 4], graphs=2)
    assert rules["blocks.1.qkv.weight"] == ["mm"] and rules["blocks.1.bias"] == ["sum"], rules


class HFSwinLogits(nn.Module):
    def __init__(self):
        super().__init__()
        config = transformers.SwinConfig(
            image_size=8, patch_size=2, num_channels=3, embed_dim=8, depths=[2, 1],
            num_heads=[2, 2], window_size=2, mlp_ratio=2.0, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=3)
        self.model = transformers.SwinForImageClassification(config)

    def forward(self, x):
        return self.model(pixel_values=x).logits


@pytest.mark.slow
def test_hf_swin():
    torch.manual_seed(0)
    make = lambda b: ((torch.randn(b, 3, 8, 8),), torch.randint(0, 3, (b,)))  # noqa: E731
    check(HFSwinLogits(), make, F.cross_entropy, [3, 1, 4])


# -- Wav2Vec2: requires_grad = True inside the forward ---------------------------------------------
class Wav2Vec2Logits(nn.Module):
    def __init__(self):
        super().__init__()
        config = transformers.Wav2Vec2Config(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4), num_feat_extract_layers=2,
            num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
            final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, num_labels=3)
        self.model = transformers.Wav2Vec2ForSequenceClassification(config)
        with torch.no_grad():   # transformers installs its output hooks once, under a lock that
            self.model(torch.randn(1, 64))  # dynamo cannot enter: let the first call be eager's

    def forward(self, x):
        return self.model(input_values=x).logits


def _audio(b):
    return (torch.randn(b, 64),), torch.randint(0, 3, (b,))


def test_wav2vec2_requires_grad_inside_the_forward():
    """Note [Setting requires_grad inside the forward] (dpfx/capture/requires_grad_skip.py): the feature
    encoder's ``hidden_states.requires_grad = True`` is skipped during capture."""
    torch.manual_seed(0)
    model = Wav2Vec2Logits().train()
    assert model.model.wav2vec2.feature_extractor._requires_grad
    rules = check(model, _audio, F.cross_entropy, [3, 1, 4], backend="eager")
    assert rules["model.wav2vec2.feature_extractor.conv_layers.0.conv.weight"] == ["convolution"]


@pytest.mark.slow
def test_wav2vec2_inductor():
    torch.manual_seed(0)
    check(Wav2Vec2Logits().train(), _audio, F.cross_entropy, [3, 1, 4])


class SetsRequiresGrad(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.fc, self.value = nn.Linear(4, 3), value

    def forward(self, x):
        h = x * 2
        h.requires_grad = self.value if isinstance(self.value, bool) else bool(x.sum() > 0)
        return self.fc(h)


@pytest.mark.parametrize("value", [False, "computed"])
def test_other_requires_grad_assignments_are_refused(value):
    """Only the constant True is skipped: False detaches (gradients change), and a value computed
    from the data is not known at capture."""
    dp = dpfx.compile(SetsRequiresGrad(value), max_grad_norm=C, noise_multiplier=0.0,
                      backend="eager")
    with pytest.raises(dpfx.CaptureError):
        dp(torch.randn(3, 4))


def test_requires_grad_true_is_a_no_op_for_the_gradients():
    torch.manual_seed(0)
    make = lambda b: ((torch.randn(b, 4),), torch.randint(0, 3, (b,)))  # noqa: E731
    check(SetsRequiresGrad(True), make, F.cross_entropy, [3, 1], backend="eager")


# -- slices over the batch dim ----------------------------------------------------------------------
class EmbeddingAndBag(nn.Module):
    """nn.Embedding and nn.EmbeddingBag on the same ids: ``bag(ids)[:, None]`` slices dim 0 whole,
    and its backward is a slice_scatter over the batch dim (Note [A slice over the whole batch
    dim] in dpfx/passes/verify/forward.py)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 8, padding_idx=0)
        self.bag = nn.EmbeddingBag(12, 8, mode="mean")
        self.fc = nn.Linear(8, 3)

    def forward(self, ids):
        return self.fc(torch.cat([self.emb(ids), self.bag(ids)[:, None]], 1).mean(1))


def test_embedding_and_bag_on_the_same_ids():
    torch.manual_seed(0)
    make = lambda b: ((torch.randint(0, 12, (b, 8)),), torch.randint(0, 3, (b,)))  # noqa: E731
    rules = check(EmbeddingAndBag(), make, F.cross_entropy, [8, 2, 1], backend="eager")
    assert rules["emb.weight"] == ["embedding"] and rules["bag.weight"] == ["embedding"], rules


class ShiftedByOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        return torch.cat([h[1:], h[:1]])     # example i's output is example i + 1's


def test_partial_slice_over_the_batch_is_refused():
    dp = dpfx.compile(ShiftedByOne(), max_grad_norm=C, noise_multiplier=0.0, backend="eager")
    with pytest.raises(dpfx.PrivacyError, match="mixes the batch|works along the batch"):
        dp(torch.randn(3, 4))


# -- tensors the model holds -----------------------------------------------------------------------
def test_causal_mask_held_in_a_closure():
    """Note [Tensors the model holds are not inputs] (dpfx/backend/inputs.py): the decoder
    layer's causal mask is read from a closure cell, a constant to the graph, not a batch
    input."""
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    causal = nn.Transformer.generate_square_subsequent_mask(4)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer, self.fc = layer, nn.Linear(8, 3)

        def forward(self, x, memory):
            return self.fc(self.layer(x, memory, tgt_mask=causal).mean(1))

    def make(b):
        return (torch.randn(b, 4, 8), torch.randn(b, 5, 8)), torch.randint(0, 3, (b,))
    check(Decoder(), make, F.cross_entropy, [4, 1, 5], backend="eager")


def _attention_graph(batch_dim: int):
    """The forward and backward of GPU's fused (efficient) attention, traced on meta tensors with
    symbolic sizes: query, key and value hold the batch in ``batch_dim``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    aten = torch.ops.aten

    def f(x, g):
        q = x.transpose(0, batch_dim)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, q * 2, q * 3, None, True, 0.0, True)
        grads = aten._scaled_dot_product_efficient_attention_backward(
            g.transpose(0, batch_dim), q, q * 2, q * 3, None, out, lse, seed, offset, 0.0,
            [True, True, True, False], True)
        return out, grads[0], grads[1], grads[2], seed, offset

    x = torch.randn(3, 2, 5, 4, device="meta")
    return make_fx(f, tracing_mode="symbolic")(x, x.clone())


@pytest.mark.parametrize("batch_dim", [0, 1, 2, 3])
def test_fused_attention_kernels(batch_dim):
    """Note [Attention kernels keep the leading dims apart]: the fused attention op and its
    backward keep examples apart when the batch is in a leading (batch or head) dim, its RNG
    state outputs are no reduction over the batch, and attention along a dim that holds the batch
    is refused."""
    from dpfx.graph.batch import BatchAnalysis
    from dpfx.passes.verify import mixing_ops

    gm = _attention_graph(batch_dim)
    x = next(iter(gm.graph.find_nodes(op="placeholder")))
    batch = x.meta["val"].shape[0].node.expr
    found = mixing_ops(gm, BatchAnalysis(gm.graph, {batch}, {}), skip=set())
    if batch_dim < 2:
        assert found == []
    else:
        refused = {str(n.target) for n, why in found if "attends across the batch" in why}
        assert refused == {"aten._scaled_dot_product_efficient_attention.default",
                           "aten._scaled_dot_product_efficient_attention_backward.default"}


def test_fused_attention_side_outputs_are_left_out_of_the_self_check():
    """Note [Attention kernels' side outputs are not compared]: the forward's outputs that are the
    kernel's RNG seed and offset (never written without dropout) are marked, and the self-check's
    comparison leaves them out, while it still refuses any other output that differs."""
    from dpfx.passes import Stages, compile_forward
    from dpfx.lower.selfcheck.compare import compare as _compare

    gm = _attention_graph(0)
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    info = compile_forward(gm, {n: 0 for n in names}, Stages())
    assert info.side_outputs == {4, 5}       # (out, grads x 3, seed, offset)
    seed = [torch.tensor(7), torch.tensor(9)]
    out = [torch.ones(2, 3), torch.ones(2, 3)]
    _compare("forward", 2, ["out", "seed"], [out[0], seed[0]], [out[1], seed[1]],
             skip={1})
    with pytest.raises(dpfx.PrivacyError, match="disagrees with its verified graph on output seed"):
        _compare("forward", 2, ["out", "seed"], [out[0], seed[0]], [out[1], seed[1]])
    with pytest.raises(dpfx.PrivacyError, match="on output out"):
        _compare("forward", 2, ["out", "seed"], [out[0], seed[0]], [out[1] * 2, seed[1]],
                 skip={1})


def test_batch_analysis_reads_each_shape_once(monkeypatch):
    """Note [Shapes are read once] (dpfx/graph/batch.py): a value read by many nodes has its sizes
    converted once per analysis, each query gets its own list, and the layouts are those of the
    value's readers as before."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dpfx.graph.batch import BatchAnalysis, BatchDim

    def f(x, w):
        h = x @ w
        return (h.relu() + h.sigmoid() + h.tanh() + h * 2).sum(-1)

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(3, 5), torch.randn(5, 4))
    x = next(iter(gm.graph.find_nodes(op="placeholder")))
    batch = x.meta["val"].shape[0].node.expr
    converted = []
    size = BatchAnalysis.size
    monkeypatch.setattr(BatchAnalysis, "size", lambda self, s: converted.append(s) or size(self, s))
    an = BatchAnalysis(gm.graph, {batch}, {x.name: BatchDim(0)})
    values = {id(n.meta["val"]): n.meta["val"] for n in gm.graph.nodes
              if isinstance(n.meta.get("val"), torch.Tensor)}
    assert len(converted) == sum(v.dim() for v in values.values())
    mm = next(iter(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default)))
    assert all(an.layout(n) == BatchDim(0) for n in mm.users)
    first = an.shape(mm.meta["val"])
    first.append("changed")
    assert an.shape(mm.meta["val"]) == first[:-1] and len(first) == 3
