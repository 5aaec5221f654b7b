"""Row-wise ops on a dim that merges the batch with another dim, through Inductor with the
self-check on, against the batch-of-one autograd loop of tests/reference.py.

A model may flatten each example's rows into the batch dim: HF OPT runs its last LayerNorm on
hidden states flattened to (B*T, d); augmentation multiplicity (De et al. 2022) flattens K views
of each image, (B, K, C, H, W) -> (B*K, C, H, W), runs a convolution and a GroupNorm, and averages
each example's K losses. The batch analysis follows the merged dim through the flatten (Note
[Multi-output ops inherit per output] in dpfx/passes/batch.py), the forward check proves that each
op reads only its rows (Note [Ops that read across dims they do not name] in passes/verify.py),
and the convolution rule sums each example's K rows (Note [A convolution over K rows per
example] in rules/convolution.py). Batch sizes include 1 and one equal to the merged factor (T or
K), where a shape alone cannot tell the batch from the other dim. Ops that do read across the
batch stay refused.

HF ConvNeXt hands its depthwise convolutions tensors with channels-last strides made inside the
model (Note [Channels-last strides made inside the model] in dpfx/traceable.py).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from reference import assert_close, loop_dp_sgd_grads, run_dpfx_multi

transformers = pytest.importorskip("transformers")

C = 0.05
TOL = {"rtol": 2e-4, "atol": 1e-6}


def check(model, make, loss_fn, batches, *, clip=C, backend="inductor"):
    """dpfx through ``backend`` equals the reference at every batch size, one capture for all
    (the first batch size compiles); returns {parameter: rules}."""
    dp = dpfx.compile(model, max_grad_norm=clip, noise_multiplier=0.0, backend=backend)
    for b in batches:
        inputs, y = make(b)
        got = run_dpfx_multi(dp, model, loss_fn, inputs, y)
        want = loop_dp_sgd_grads(model, loss_fn, inputs, y, max_grad_norm=clip)
        try:
            assert_close(got, want, **TOL)
        except AssertionError as e:
            raise AssertionError(f"batch size {b}: {e}") from None
    assert dp.compile_count == 2
    return {pg.name: pg.rules for pg in dp._dpfx_backend.param_grads}


# -- HF OPT: LayerNorm on (B*T, d) ------------------------------------------------------------------
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


def test_opt_layer_norm_on_flattened_hidden_states():
    torch.manual_seed(0)
    model = OPTLogits()
    make = lambda b: ((torch.randint(3, VOCAB, (b, T)),), torch.randint(3, VOCAB, (b, T)))  # noqa
    rules = check(model, make, lm_loss, [3, 1, T])
    final_ln = "model.model.decoder.layers.0.final_layer_norm"
    assert rules[f"{final_ln}.weight"] == ["sum"] and rules[f"{final_ln}.bias"] == ["sum"], rules
    assert rules["model.model.decoder.layers.0.fc1.weight"] == ["mm"], rules


# -- augmentation multiplicity: conv + GroupNorm on (B*K, C, H, W) ----------------------------------
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


# -- ops that read across the batch stay refused ----------------------------------------------------
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


# -- HF ConvNeXt: channels-last strides made inside the model ---------------------------------------
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
