"""dpfx's graph cache (dpfx/graph_cache.py): a second process reads the rewritten backward graph
instead of rewriting it, re-proves it, and Inductor's FX-graph cache then hits for it; an entry
that fails the proof, or that does not parse, is not used (Note [The graph cache trusts nothing it
reads]). Every step here runs through Inductor at sigma 0, against the batch-of-one reference."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import dpfx
from dpfx import graph_cache
from reference import assert_close, clip_fraction, dp_sgd_grads, run_dpfx

ROOT = Path(__file__).resolve().parents[1]
C = 0.1
B = 6

STEP = """
import json, sys, torch, torch.nn.functional as F
from torch._dynamo.utils import counters
import dpfx
sys.path.insert(0, {tests!r})
from test_warm_cache import build
model, x, y = build()
dp = dpfx.compile(model, max_grad_norm={C!r}, noise_multiplier=0.0)
F.cross_entropy(dp(x), y).backward()
grads = {{k: p.grad.tolist() for k, p in model.named_parameters()}}
print("RESULT " + json.dumps({{"dpfx": dict(counters["dpfx"]),
                              "inductor": dict(counters["inductor"]), "grads": grads}}))
"""


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(B, 8, generator=g), torch.randint(0, 3, (B,), generator=g)


def reference(c=C) -> dict:
    model, x, y = build()
    assert clip_fraction(model, F.cross_entropy, x, y, c) > 0    # the clip bites
    return dp_sgd_grads(model, F.cross_entropy, x, y, max_grad_norm=c)


def step_in_subprocess(dirs: dict) -> dict:
    env = {**os.environ, "DPFX_GRAPH_CACHE": str(dirs["graphs"]),
           "TORCHINDUCTOR_CACHE_DIR": str(dirs["inductor"]),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = STEP.format(tests=str(ROOT / "tests"), C=C)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    out["grads"] = {k: torch.tensor(v) for k, v in out["grads"].items()}
    return out


def step_here(c=C) -> dict:
    """One step in this process, dynamo reset (a fresh capture, as a new process makes)."""
    torch._dynamo.reset()
    counters.clear()
    model, x, y = build()
    dp = dpfx.compile(model, max_grad_norm=c, noise_multiplier=0.0)
    grads = run_dpfx(dp, model, F.cross_entropy, x, y)
    return {"dpfx": dict(counters["dpfx"]), "grads": grads}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    dirs = {"graphs": tmp_path / "graphs", "inductor": tmp_path / "inductor"}
    monkeypatch.setenv("DPFX_GRAPH_CACHE", str(dirs["graphs"]))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(dirs["inductor"]))
    first = step_here()
    counts = first.pop("dpfx")
    assert counts == {"graph_cache_miss": 1, "graph_cache_stored": 1}, counts
    assert_close(first["grads"], reference(), rtol=1e-4, atol=1e-6)
    (entry,) = dirs["graphs"].glob("*.json")
    dirs["entry"] = entry
    return dirs


def test_second_process_reads_the_graph_and_inductor_hits(cache):
    second = step_in_subprocess(cache)
    assert second["dpfx"] == {"graph_cache_hit": 1}, second["dpfx"]
    assert second["inductor"].get("fxgraph_cache_hit") == 2, second["inductor"]
    assert not second["inductor"].get("fxgraph_cache_miss"), second["inductor"]
    assert_close(second["grads"], reference(), rtol=1e-4, atol=1e-6)


def test_entry_without_the_clip_is_refused_and_rewritten(cache, caplog):
    body = json.loads(cache["entry"].read_text())
    unclipped = {r["name"]: r["args"]["tuple"][0] for r in body["nodes"]
                 if r["tags"].get("dpfx") == "clip_apply"}
    masks = [r for r in body["nodes"] if r["tags"].get("dpfx") == "finite_mask"
             and r["args"]["tuple"][1].get("node") in unclipped]
    assert masks
    for r in masks:            # each clipped sum adds the per-sample gradients, not clipped
        r["args"]["tuple"][1] = unclipped[r["args"]["tuple"][1]["node"]]
    cache["entry"].write_text(json.dumps(body))
    again = step_here()
    assert again["dpfx"] == {"graph_cache_rejected": 1, "graph_cache_stored": 1}, again["dpfx"]
    assert "PrivacyError: clipped sum" in caplog.text     # refused by the proof
    assert_close(again["grads"], reference(), rtol=1e-4, atol=1e-6)
    assert "clip_apply" in cache["entry"].read_text()     # the rewrite replaced the entry
    assert step_here()["dpfx"] == {"graph_cache_hit": 1}


@pytest.mark.parametrize("damage", ["truncated", "unknown target", "other symbol"])
def test_damaged_entry_is_rewritten(cache, damage):
    text = cache["entry"].read_text()
    if damage == "truncated":
        text = text[: len(text) // 2]
    elif damage == "unknown target":
        text = text.replace('["op", "aten", "mm", "default"]', '["operator", "system"]')
    else:
        text = text.replace('{"node": "primals_3"}', '{"symint": ["Symbol", "u99"]}')
    cache["entry"].write_text(text)
    again = step_here()
    assert again["dpfx"] == {"graph_cache_rejected": 1, "graph_cache_stored": 1}, again["dpfx"]
    assert_close(again["grads"], reference(), rtol=1e-4, atol=1e-6)


def test_another_max_grad_norm_misses(cache):
    other = step_here(c=2 * C)
    assert other["dpfx"] == {"graph_cache_miss": 1, "graph_cache_stored": 1}, other["dpfx"]
    assert_close(other["grads"], reference(2 * C), rtol=1e-4, atol=1e-6)
    assert len(list(cache["graphs"].glob("*.json"))) == 2


def test_off_turns_the_cache_off(cache, monkeypatch):
    monkeypatch.setenv("DPFX_GRAPH_CACHE", "off")
    assert graph_cache.directory() is None
    assert step_here()["dpfx"] == {}


def test_only_torch_ops_and_operators_are_named():
    for target in (["operator", "system"], ["op", "os", "system", "default"],
                   ["hop", "__class__"], ["op", "aten", "mm"], "eval"):
        with pytest.raises(graph_cache.CacheEntryError):
            graph_cache._decode_target(target)
    assert graph_cache._decode_target(["op", "aten", "mm", "default"]) is torch.ops.aten.mm.default
