"""Golden graphs: the normalized forward and rewritten backward graphs of canonical models (a
2-layer MLP, a sequence model with a 3-D Linear input and a positional parameter, a ResNet-style
CNN with GroupNorm, a GPT-style transformer with tied embeddings, an arange positional embedding
and causal SDPA, nn.MultiheadAttention used as is with add_bias_kv, and a raw table indexed with
negative ids that is also the LM head: index_put's ghost form and the tied cross term).

Regenerate (from a clean tree, then read the diff line by line) with:

    DPFX_UPDATE_GOLDEN=1 python -m pytest tests/passes/test_golden.py

Each golden is paired with a numeric check of the same model against the torch.func reference,
so a golden that still matches cannot hide wrong maths.
"""
import os
import pathlib

import pytest
import torch
import torch.nn as nn

import dpfx
from dpfx.passes import clip_noise
from support.models import MLP, MHANet, ResNetGN, SeqModel, TiedTable, TinyGPT, mse, xent
from support.reference import assert_close, dp_sgd_grads, run_dpfx

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"
UPDATE = os.environ.get("DPFX_UPDATE_GOLDEN") == "1"


def _floats(*shape):
    return lambda b: torch.randn(b, *shape)


def _ids(vocab, *shape):
    return lambda b: torch.randint(0, vocab, (b, *shape))


CASES = {  # model factory, input factory, loss, target factory
    "mlp": (MLP, _floats(8), mse, _floats(4)),
    "seq": (SeqModel, _floats(6, 8), xent, _ids(4)),
    "resnet_gn": (ResNetGN, _floats(1, 6, 6), xent, _ids(3)),
    "gpt": (lambda: TinyGPT(vocab=7, d=8, T=4), _ids(7, 4), xent, _ids(7)),
    "mha": (lambda: MHANet(embed=8, heads=2, add_bias_kv=True), _floats(4, 8), xent, _ids(3)),
    "embedding": (lambda: nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(32, 3)),
                  _ids(50, 4), xent, _ids(3)),
    "tied_table": (lambda: TiedTable(vocab=50, dim=8, wrap=True), _ids(50, 4), xent, _ids(50)),
}
# The release as GPU graphs write it, built on CPU (clip_noise.NOISE_IN_PLACE emptied): slices
# of one normal draw; the ghost embedding's clipped sum accumulates into its noise slice.
CASES["embedding_gpu_release"] = CASES["embedding"]
GPU_RELEASE = {"embedding_gpu_release"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_graphs(name, monkeypatch):
    model_fn, inputs, loss_fn, target = CASES[name]
    if name in GPU_RELEASE:
        monkeypatch.setattr(clip_noise, "NOISE_IN_PLACE", set())
    torch.manual_seed(0)
    model = model_fn()
    report = dpfx.explain(model, inputs(3), max_grad_norm=1.0, noise_multiplier=1.0)
    for stage in ("forward", "backward.private"):
        path = GOLDEN / f"{name}.{stage}.txt"
        text = report.graphs[stage]
        if UPDATE:
            path.write_text(text)
        assert path.exists(), f"missing golden {path}; run with DPFX_UPDATE_GOLDEN=1"
        assert text == path.read_text(), f"{path} changed; regenerate and review the diff"
    # The paired numeric check.
    x, y = inputs(5), target(5)
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, backend="eager")
    assert_close(run_dpfx(dp, model, loss_fn, x, y),
                 dp_sgd_grads(model, loss_fn, x, y, max_grad_norm=0.05))
