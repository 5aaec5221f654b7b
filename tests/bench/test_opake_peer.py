"""The benchmark harness's Opake peer (benchmarks/methods.py) takes the harness's DP-SGD step.

    python -m pytest -q tests/bench/test_opake_peer.py

At sigma 0 and lr 1, one Opake step changes the parameters by the clipped, averaged gradient of
the batch-of-one loop (methods.loop_eager, plain autograd); at sigma 1 it adds noise of std
sigma * C / B per coordinate; the rows it cannot run are refused with their reason
(methods._check_opake_applies). Skipped where Opake is not installed (it comes with the ``bench`` extra only).
"""
import os
import sys

import pytest
import torch

pytest.importorskip("opake")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
import methods  # noqa: E402
import models  # noqa: E402

B = 8
CLIP = 0.05   # below every example's gradient norm on the MLP: the clipping acts


def update(method, monkeypatch, sigma, name="mlp"):
    monkeypatch.setattr(methods, "SIGMA", sigma)
    monkeypatch.setattr(methods, "LR", 1.0)
    monkeypatch.setattr(methods, "C", CLIP)
    model, x, y = models.build(name, B)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    methods.make(method, model, B, x, y).step(x, y)
    return {k: before[k] - p.detach() for k, p in model.named_parameters()}


def flat(d):
    return torch.cat([v.flatten() for v in d.values()])


def test_opake_step_is_the_clipped_mean(monkeypatch):
    model, x, y = models.build("mlp", B)
    mean_grad = torch.autograd.grad(models.loss_fn(model(x), y), list(model.parameters()))
    assert torch.cat([g.flatten() for g in mean_grad]).norm() > CLIP   # clipping changes it
    ref = flat(update("loop_eager", monkeypatch, 0.0))
    ours = flat(update("opake_eager", monkeypatch, 0.0))
    assert ours.abs().max() > 0                                         # Opake's step ran
    assert ref.norm() <= CLIP * (1 + 1e-5)
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_opake_noise_has_std_sigma_c_over_b(monkeypatch):
    noised = flat(update("opake_eager", monkeypatch, 1.0))
    noise = noised - flat(update("opake_eager", monkeypatch, 0.0))
    std = CLIP / B
    assert noise.numel() > 100_000
    assert noise.mean().abs() < 0.02 * std
    assert noise.std() == pytest.approx(std, rel=0.01)


def test_an_attention_mask_is_refused_with_the_reason():
    pytest.importorskip("transformers")
    model, x, y = models.build("hf_gpt2", 2)
    assert "attention_mask" in x
    with pytest.raises(NotImplementedError, match="apply_model_patches"):
        methods.make("opake_eager", model, 2, x, y)


def test_per_example_gradients_beyond_memory_are_refused(monkeypatch):
    monkeypatch.setattr(methods, "_available_bytes", lambda device: 2**20)
    model, x, y = models.build("mlp", B)
    with pytest.raises(MemoryError, match="per-example gradient"):
        methods.make("opake_compile", model, B, x, y)
