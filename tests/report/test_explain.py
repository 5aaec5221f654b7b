"""dpfx.explain and DPFX_DUMP_DIR: the report, the graphs after each pass, the pictures."""
import torch

import dpfx
from support.models import SeqModel, mse, MLP
from support.reference import run_dpfx

STAGES = ["forward", "backward.captured", "backward.per_sample", "backward.private"]


def test_explain_reports_every_parameter_and_leaves_grads_alone(tmp_path):
    model = SeqModel()
    report = dpfx.explain(model, torch.randn(2, 6, 8), max_grad_norm=1.0, noise_multiplier=1.0)
    rows = {r.name: r for r in report.rows}
    assert set(rows) == {n for n, _ in model.named_parameters()}
    assert rows["proj.weight"].rules == ["mm"] and rows["proj.weight"].strategy == "ghost"
    assert "Gram" in rows["proj.weight"].form
    assert rows["pos"].strategy == "materialize"
    # the two vector parameters summed over tokens share a norm and a clipped sum; the head's
    # bias gradient is the output gradient itself and stays on its own
    assert rows["proj.bias"].strategy == rows["gamma"].strategy == "materialize, stacked"
    assert rows["head.bias"].strategy == "materialize"
    assert rows["pos"].rules == ["sum"] and rows["pos"].shape == (1, 6, 8)
    assert "B" in rows["proj.weight"].flops
    text = str(report)
    assert "proj.weight" in text and "per-sample form" in text
    assert list(report.graphs) == STAGES
    assert "# dpfx: clip_factor" in report.graphs["backward.private"]
    assert "0x" not in report.graphs["backward.private"]  # no addresses
    paths = report.write(str(tmp_path))
    assert (tmp_path / "backward.private.png").stat().st_size > 1000
    assert (tmp_path / "report.txt").read_text().startswith("parameter")
    assert len(paths) == 2 * len(STAGES)
    assert all(p.grad is None for p in model.parameters())


def test_dump_dir_during_a_normal_run(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFX_DUMP_DIR", str(tmp_path))
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, backend="eager")
    run_dpfx(dp, model, mse, torch.randn(3, 8), torch.randn(3, 4))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.endswith("backward.private.txt") for n in names), names
    assert any(n.endswith("forward.txt") for n in names), names
