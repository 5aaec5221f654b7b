"""The benchmark harness's Opake peer (benchmarks/methods.py) takes the harness's DP-SGD step.

    python -m pytest -q tests/bench/test_opake_peer.py

At sigma 0 and lr 1, one Opake step changes the parameters by the clipped, averaged gradient of
the batch-of-one loop (methods.loop_eager, plain autograd); at sigma 1 it adds noise of std
sigma * C / B per coordinate; the rows it cannot run are refused with their reason
(methods._check_opake_applies); a model with an attention mask runs under Opake's model patches, in
a process of its own. Skipped where Opake is not installed (it comes with the ``bench`` extra only).
"""
import os
import subprocess
import sys
import textwrap

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


def test_an_attention_mask_runs_under_opakes_patches_in_a_process_of_its_own():
    """Opake's patches are process-wide, so this runs in a child process: the batch-of-one loop
    first, unpatched, then Opake's step with methods.OPAKE_PATCHES set (run.py's
    ``--opake-patches`` worker), on a Llama whose padded positions are masked and whose
    examples' gradients all exceed C."""
    pytest.importorskip("transformers")
    bench = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks")
    child = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.abspath(bench)!r})
        import torch, methods, models
        methods.SIGMA, methods.LR, methods.C = 0.0, 1.0, {CLIP}

        def update(method):
            model, x, y = models.build("hf_llama", 4)
            assert "attention_mask" in x and not bool(x["attention_mask"].all())
            before = {{k: p.detach().clone() for k, p in model.named_parameters()}}
            methods.make(method, model, 4, x, y).step(x, y)
            return torch.cat([(before[k] - p.detach()).flatten()
                              for k, p in model.named_parameters()])

        model, x, y = models.build("hf_llama", 4)
        for i in range(4):
            one = {{k: v[i:i + 1] for k, v in x.items()}}
            g = torch.autograd.grad(models.loss_fn(models.forward(model, one), y[i:i + 1]),
                                    list(model.parameters()))
            assert torch.cat([t.flatten() for t in g]).norm() > {CLIP}   # clipping acts
        ref = update("loop_eager")
        methods.OPAKE_PATCHES = True
        ours = update("opake_eager")
        assert ours.abs().max() > 0
        print("relative", float((ours - ref).abs().max() / ref.abs().max()))
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    relative = float(done.stdout.split("relative")[-1])
    assert relative <= 1e-4


def test_per_example_gradients_beyond_memory_are_refused(monkeypatch):
    monkeypatch.setattr(methods, "_available_bytes", lambda device: 2**20)
    model, x, y = models.build("mlp", B)
    with pytest.raises(MemoryError, match="per-example gradient"):
        methods.make("opake_compile", model, B, x, y)


def test_a_row_of_its_own_process_takes_its_ratios_against_the_baseline_timed_there():
    import report

    def row(method, ms, **extra):
        return {"method": method, "status": "ok", "median_ms": ms, "first_step_s": ms / 10,
                "step_peak_mb": ms, **extra}

    own = {"method": "compile", "label": "non-private torch.compile", "median_ms": 5.0,
           "first_step_s": 1.0, "step_peak_mb": 2.0}
    rows = [row("eager", 20.0), row("compile", 8.0), row("dpfx", 9.0),
            row("opake_compile", 10.0, own_baseline=own)]
    assert methods.own_process("opake_compile", "hf_llama_256")
    assert not methods.own_process("opake_compile", "hf_gpt2_256")   # no mask: shared
    assert not methods.own_process("dpfx", "hf_llama_256")
    report.add_ratios("hf_llama_256", rows)
    dpfx, opake = rows[2], rows[3]
    assert dpfx["ratio_to_baseline"] == pytest.approx(9.0 / 8.0)
    assert opake["ratio_to_baseline"] == opake["ratio_to_compile"] == pytest.approx(10.0 / 5.0)
    assert "ratio_to_eager" not in opake          # eager ran in another process
    assert opake["first_step_ratio"] == pytest.approx(1.0 / 1.0)
    assert opake["memory_ratio"] == pytest.approx(10.0 / 2.0)
