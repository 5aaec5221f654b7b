"""The benchmark models, built from code, with their synthetic data and loss.

Every model returns logits; the loss is cross-entropy, the mean over the batch of per-example
losses (for the GPT model, each example's loss is the mean over its T positions, so the mean over
all B*T tokens is the mean over the batch of per-example losses, the contract of dpfx and Opacus).

The Hugging Face language models (``hf_gpt2``, ``hf_llama`` and their larger sizes) are called as
users call them: ``model(input_ids=ids, attention_mask=mask).logits``. Their input ``x`` is that
dict of keyword arguments; ``forward(model, x)`` is the one place that knows the difference.

``REALISTIC`` names the (model, batch size) rows at the sizes DP users train at: an MNIST-sized
MLP, a GroupNorm ResNet on CIFAR-sized images, the LSTM at B=256, small and GPT-2-small language
models at T=128.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """d_in-hidden-hidden-10: 64-512-512-10, or 784-1024-1024-10 for ``mlp_1024``."""

    def __init__(self, d_in=64, hidden=512):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class CNN(nn.Module):
    """Three stride-2 3x3 convolutions 3->32->64->64, each followed by GroupNorm and ReLU, on
    3x32x32 (32 -> 16 -> 8 -> 4), then Linear(64*4*4, 10)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, stride=2, padding=1)
        self.gn1 = nn.GroupNorm(8, 32)
        self.conv2 = nn.Conv2d(32, 64, 3, stride=2, padding=1)
        self.gn2 = nn.GroupNorm(8, 64)
        self.conv3 = nn.Conv2d(64, 64, 3, stride=2, padding=1)
        self.gn3 = nn.GroupNorm(8, 64)
        self.fc = nn.Linear(64 * 4 * 4, 10)

    def forward(self, x):
        x = torch.relu(self.gn1(self.conv1(x)))
        x = torch.relu(self.gn2(self.conv2(x)))
        x = torch.relu(self.gn3(self.conv3(x)))
        return self.fc(x.flatten(1))


class ResidualBlockGN(nn.Module):
    """Two 3x3 convolutions with GroupNorm, ReLU and a skip connection (a 1x1 convolution and
    GroupNorm where the block changes the width or the resolution)."""

    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(8, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(8, c_out)
        self.skip = None
        if stride != 1 or c_in != c_out:
            self.skip = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                      nn.GroupNorm(8, c_out))

    def forward(self, x):
        out = self.gn2(self.conv2(torch.relu(self.gn1(self.conv1(x)))))
        return torch.relu(out + (x if self.skip is None else self.skip(x)))


class ResNetGN(nn.Module):
    """ResNet-style CNN with GroupNorm (no BatchNorm: DP-SGD needs per-example independence) on
    3x32x32: a 3x3 stem 3->16, one residual block per stage at widths 16, 32, 64 (32 -> 16 -> 8),
    global average pooling, Linear(64, 10). 9 convolutions, 78k parameters."""

    def __init__(self, widths=(16, 32, 64), n_classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, widths[0], 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(8, widths[0])
        blocks, c = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(ResidualBlockGN(c, w, stride=1 if i == 0 else 2))
            c = w
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c, n_classes)

    def forward(self, x):
        x = self.blocks(torch.relu(self.gn(self.stem(x))))
        return self.fc(x.mean((2, 3)))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.reshape(B, T, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """2-layer GPT-style decoder: d=128, T=64, 4 heads, vocab 256; a learned positional
    nn.Parameter(1, T, d) added to the token embeddings (no arange embedding lookup)."""

    def __init__(self, vocab=256, d=128, T=64, heads=4, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, T, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class EmbeddingBag(nn.Module):
    """nn.Embedding(20000, 64) on (B, 32) indices, mean over the 32 positions, Linear(64, 10)."""

    def __init__(self, vocab=20000, d=64, n_classes=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, n_classes)

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(1))


class LSTMClassifier(nn.Module):
    """Text classifier: Embedding(10000, 64) on (B, 32) token ids, a stock nn.LSTM(64, 128,
    batch_first), Linear(128, 2) on the last hidden state. Opacus cannot train nn.LSTM: its
    methods get the model after ``ModuleValidator.fix``, which swaps in Opacus's DPLSTM with the
    same weights. dpfx and the other methods train the nn.LSTM as it is."""

    def __init__(self, vocab=10000, d=64, hidden=128, n_classes=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, n_classes)

    def forward(self, idx):
        _, (h, _) = self.lstm(self.emb(idx))
        return self.fc(h[-1])


def _hf_gpt2(d=64, layers=2, heads=4, vocab=256, T=32):
    """GPT2LMHeadModel from a config (default d=64, 2 layers, 4 heads, vocab 256), LM head tied
    to the token embedding, dropout 0 (so that every method computes the same function)."""
    import transformers

    config = transformers.GPT2Config(n_layer=layers, n_head=heads, n_embd=d, vocab_size=vocab,
                                     n_positions=T, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _hf_llama(d=64, ffn=176, layers=2, heads=4, vocab=256, T=32):
    """LlamaForCausalLM from a config (default d=64, 2 layers, 4 heads, SwiGLU 176): RMSNorm,
    rotary positions, untied head."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=d, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=heads, vocab_size=vocab,
                                      max_position_embeddings=T, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


def _hf_data(B, g, vocab=256, T=32, mask=True):
    """Token ids and the next-token labels (every position counts, so each example's loss is its
    own mean); with ``mask``, an attention mask with each example's last 0 to T/2 - 1 positions
    padded."""
    ids = torch.randint(0, vocab, (B, T + 1), generator=g)
    x = torch.empty(B, T, dtype=ids.dtype).copy_(ids[:, :-1])
    y = torch.empty(B, T, dtype=ids.dtype).copy_(ids[:, 1:])
    if not mask:
        return {"input_ids": x}, y
    lengths = T - torch.randint(0, T // 2, (B,), generator=g)
    return {"input_ids": x, "attention_mask": (torch.arange(T) < lengths[:, None]).long()}, y


def forward(model, x):
    """The model's logits, called as its users call it."""
    if isinstance(x, dict):
        return model(**x).logits
    return model(x)


def _mlp_data(B, g, d_in=64):
    return torch.randn(B, d_in, generator=g), torch.randint(0, 10, (B,), generator=g)


def _cnn_data(B, g):
    return torch.randn(B, 3, 32, 32, generator=g), torch.randint(0, 10, (B,), generator=g)


def _gpt_data(B, g):
    seq = torch.randint(0, 256, (B, 65), generator=g)
    # Fresh row-major tensors: for B = 0, seq[:, :-1].contiguous() keeps the stride 65 of its
    # parent (an empty tensor counts as contiguous), and a stride guard would recompile.
    x = torch.empty(B, 64, dtype=seq.dtype).copy_(seq[:, :-1])
    y = torch.empty(B, 64, dtype=seq.dtype).copy_(seq[:, 1:])
    return x, y


def _emb_data(B, g):
    return torch.randint(0, 20000, (B, 32), generator=g), torch.randint(0, 10, (B,), generator=g)


def _lstm_data(B, g):
    return torch.randint(0, 10000, (B, 32), generator=g), torch.randint(0, 2, (B,), generator=g)


# name -> (constructor, data(B, generator), full-run batch sizes, short description)
MODELS = {
    "mlp": (MLP, _mlp_data, (64, 256), "MLP 64-512-512-10, input (B, 64)"),
    "cnn": (CNN, _cnn_data, (32, 64), "3-conv GroupNorm CNN on 3x32x32"),
    "gpt": (GPT, _gpt_data, (16, 32), "2-layer GPT, d=128, T=64, 4 heads, vocab 256"),
    "embedding": (EmbeddingBag, _emb_data, (64, 256), "Embedding(20000, 64) on (B, 32) -> mean -> Linear"),
    "lstm": (LSTMClassifier, _lstm_data, (32, 64),
             "LSTM text classifier: Embedding(10000, 64), nn.LSTM(64, 128), T=32, Linear(128, 2)"),
    "hf_gpt2": (_hf_gpt2, _hf_data, (8, 32),
                "Hugging Face GPT2LMHeadModel, d=64, 2 layers, vocab 256 (tied head), T=32, "
                "attention mask"),
    "hf_llama": (_hf_llama, _hf_data, (8, 32),
                 "Hugging Face LlamaForCausalLM, d=64, 2 layers, vocab 256, T=32, attention mask"),
}
# what run.py and kernels.py run unless told otherwise; the models below run with --realistic
DEFAULT_MODELS = tuple(MODELS)

MODELS.update({
    "mlp_1024": (partial(MLP, 784, 1024), partial(_mlp_data, d_in=784), (1024,),
                 "MLP 784-1024-1024-10, input (B, 784)"),
    "resnet_gn": (ResNetGN, _cnn_data, (256,),
                  "ResNet-style GroupNorm CNN on 3x32x32: stem and 3 residual blocks at widths "
                  "16, 32, 64, 9 convolutions"),
    "hf_gpt2_256": (partial(_hf_gpt2, d=256, layers=4, heads=4, vocab=8192, T=128),
                    partial(_hf_data, vocab=8192, T=128, mask=False), (16,),
                    "Hugging Face GPT2LMHeadModel, d=256, 4 layers, 4 heads, vocab 8192 (tied "
                    "head), T=128, no attention mask"),
    "hf_llama_256": (partial(_hf_llama, d=256, ffn=688, layers=4, heads=4, vocab=8192, T=128),
                     partial(_hf_data, vocab=8192, T=128), (16,),
                     "Hugging Face LlamaForCausalLM, d=256, 4 layers, 4 heads, SwiGLU 688, vocab "
                     "8192, T=128, attention mask"),
    "hf_gpt2_124m": (partial(_hf_gpt2, d=768, layers=12, heads=12, vocab=50257, T=128),
                     partial(_hf_data, vocab=50257, T=128, mask=False), (4,),
                     "Hugging Face GPT-2 small (124M; GPT2Config's sizes: d=768, 12 layers, 12 "
                     "heads, vocab 50257, tied head; n_positions 128), T=128, no attention mask"),
    **{f"hf_gpt2_d128_l{n}": (
        partial(_hf_gpt2, d=128, layers=n, heads=4, vocab=2048, T=64),
        partial(_hf_data, vocab=2048, T=64, mask=False), (8,),
        f"Hugging Face GPT2LMHeadModel, d=128, {n} layers, 4 heads, vocab 2048 (tied head), "
        f"T=64, no attention mask (deep models' first step)") for n in (2, 12)},
    **{f"hf_gpt2_d128_l{n}_v50k": (
        partial(_hf_gpt2, d=128, layers=n, heads=4, vocab=50257, T=64),
        partial(_hf_data, vocab=50257, T=64, mask=False), (8,),
        f"Hugging Face GPT2LMHeadModel, d=128, {n} layers, 4 heads, GPT-2's vocab 50257 (tied "
        f"head), T=64, no attention mask (deep models' warm-up with a real vocabulary)")
       for n in (2, 12)},
    "hf_llama_106m": (partial(_hf_llama, d=768, ffn=2048, layers=8, heads=12, vocab=32000,
                              T=128),
                      partial(_hf_data, vocab=32000, T=128, mask=False), (4,),
                      "Hugging Face LlamaForCausalLM, 106M parameters (d=768, 8 layers, 12 "
                      "heads, SwiGLU 2048, vocab 32000, untied head), T=128, no attention mask"),
})

MODELS["mlp_host"] = (partial(MLP, 8, 8), partial(_mlp_data, d_in=8), (1,),
                     "MLP 8-8-8-10, input (B, 8): kernels that cost next to nothing, so that a "
                     "step's time is its host time (run.py --host-time)")

# (model, batch size): the steady step's host time, run by ``run.py --host-time``: the step of a
# model whose kernels cost next to nothing is the Python around them (dynamo's guards,
# aot_autograd's runtime, dpfx's checks and hooks), which on a GPU is the step's floor.
HOST_TIME = [("mlp_host", 1), ("hf_gpt2", 1)]

# (model, batch size): the sizes DP users train at, run by ``run.py --realistic``; the heaviest
# last, so that an interrupted run keeps the others.
REALISTIC = [("mlp_1024", 1024), ("resnet_gn", 256), ("lstm", 256), ("hf_gpt2_256", 16),
             ("hf_llama_256", 16), ("hf_gpt2_124m", 4)]

# The non-private step each model's DP step is measured against (Note [The LSTM's baseline]).
BASELINE = {"lstm": "compile_unrolled"}

# Note [The LSTM's baseline]
# torch.compile does not trace nn.LSTM: its "non-private torch.compile" step is ATen's fused LSTM
# kernel. dpfx trains the same layer through its written-out recurrence (one step per time step,
# dpfx/capture/rnn.py), so the fair baseline for dpfx's DP cost is that unrolled graph compiled without
# DP (methods.nonprivate_compile_unrolled); both are reported.


def loss_fn(out, y):
    """Mean over the batch of per-example losses (handles the empty batch: zero loss)."""
    if out.shape[0] == 0:
        return out.sum() * 0.0
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def captured_loss(out, y):
    """``loss_fn`` as ``dpfx.compile(model, loss=...)`` takes it: on the model's own output (an
    HF ``ModelOutput``'s logits), never called on an empty batch."""
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def build(name: str, B: int, seed: int = 0):
    ctor, data, _, _ = MODELS[name]
    torch.manual_seed(seed)
    model = ctor()
    x, y = data(B, torch.Generator().manual_seed(seed + 1))
    return model, x, y


def make_data(name: str, B: int, seed: int):
    return MODELS[name][1](B, torch.Generator().manual_seed(seed))


def has_attention_mask(name: str) -> bool:
    """Whether the model's input is a dict with an attention mask (Hugging Face rows)."""
    x, _ = make_data(name, 1, 0)
    return isinstance(x, dict) and "attention_mask" in x
