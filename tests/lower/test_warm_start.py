"""Note [A warm start without the joint trace] (dpfx/lower/warm.py): a second compile of the same model
finds dpfx's graphs in AOTAutogradCache, skips aot_autograd's trace, runs dpfx's passes, proof,
lowering and self-check on the loaded graphs, and trains exactly as a cold compile; nothing but
dpfx's own entries serves a dpfx compile, and a rebuild that fails falls back to a full one."""
import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import dpfx
import dpfx.lower.warm
from support.models import MLP, mse
from support.reference import assert_close, dp_sgd_grads, run_dpfx


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    counters.clear()
    yield
    torch._dynamo.reset()


def _compile(model, **settings):
    torch._dynamo.reset()
    return dpfx.compile(model, **{"max_grad_norm": 0.5, "noise_multiplier": 0.0,
                                  "expected_batch_size": 4, **settings})


def _exact(dp, model, batch, max_grad_norm=0.5):
    x, y = torch.randn(batch, 8), torch.randn(batch, 4)
    want = dp_sgd_grads(model, mse, x, y, max_grad_norm=max_grad_norm, expected_batch_size=4)
    assert_close(run_dpfx(dp, model, mse, x, y), want, rtol=1e-4, atol=1e-6)


def test_warm_start_skips_the_trace_and_stays_exact(cache):
    torch.manual_seed(0)
    model = MLP()
    _exact(_compile(model), model, 4)
    assert counters["aot_autograd"]["autograd_cache_saved"] == 1
    counters.clear()
    dp = _compile(model)
    _exact(dp, model, 3)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    assert counters["inductor"]["fxgraph_cache_hit"] == 2     # the same rewritten graphs
    assert dp._dpfx_backend.compiles == 2                     # dpfx's passes ran on both
    for batch in (1, 0, 5):                                   # the one compile serves them all
        _exact(dp, model, batch)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1


def test_settings_are_not_taken_from_the_entry(cache):
    """An entry holds the graphs before dpfx's passes: a warm compile with another bound clips
    to its own bound."""
    torch.manual_seed(0)
    model = MLP()
    _exact(_compile(model), model, 4)
    counters.clear()
    _exact(_compile(model, max_grad_norm=0.05), model, 4, max_grad_norm=0.05)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1


def test_a_plain_torch_compile_entry_never_serves_dpfx(cache):
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    torch._dynamo.reset()
    mse(torch.compile(model)(x), y).backward()
    model.zero_grad(set_to_none=True)
    counters.clear()
    _exact(_compile(model), model, 4)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 0


def test_a_hit_that_dpfx_did_not_compile_is_refused(cache, monkeypatch):
    torch.manual_seed(0)
    model = MLP()
    _exact(_compile(model), model, 4)
    monkeypatch.setattr(dpfx.lower.warm.DPOutputCode, "post_compile", lambda self, *args: None)
    dp = _compile(model)
    model.zero_grad(set_to_none=True)
    with pytest.raises(dpfx.PrivacyError, match="without dpfx's passes"):
        mse(dp(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    assert all(p.grad is None for p in model.parameters())


def test_a_failed_rebuild_falls_back_to_a_full_compile(cache, monkeypatch):
    torch.manual_seed(0)
    model = MLP()
    _exact(_compile(model), model, 4)

    def fail(*args):
        raise RuntimeError("the entry no longer loads")

    monkeypatch.setattr(dpfx.lower.warm, "_rebuild", fail)
    counters.clear()
    dp = _compile(model)
    _exact(dp, model, 3)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 0
    assert dp._dpfx_backend.compiles == 2


class Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.norm = nn.LayerNorm(8)
        self.mix = nn.Linear(8, 8)

    def forward(self, idx):
        h = self.mix(self.norm(self.emb(idx)))
        return (h @ self.emb.weight.t()).mean(1)[:, :4]


def test_a_model_class_pickle_cannot_name_is_compiled_uncached(cache):
    """A graph whose metadata names a class defined inside a function cannot be serialized:
    it trains as before, without an entry."""
    class Local(MLP):
        pass

    torch.manual_seed(0)
    model = Local()
    for _ in range(2):
        counters.clear()
        _exact(_compile(model), model, 4)
        assert counters["aot_autograd"]["autograd_cache_hit"] == 0
        assert counters["aot_autograd"]["autograd_cache_saved"] == 0


def test_a_larger_model_warm(cache):
    """Tied weights, a sequence, LayerNorm: the backward's inputs (saved values, tangents) are
    rebuilt from the rebuilt forward's outputs."""
    torch.manual_seed(0)
    model = Seq()
    x, y = torch.randint(0, 11, (4, 5)), torch.randn(4, 4)
    want = dp_sgd_grads(model, mse, x, y, max_grad_norm=0.5, expected_batch_size=4)
    assert_close(run_dpfx(_compile(model), model, mse, x, y), want, rtol=1e-4, atol=1e-6)
    counters.clear()
    dp = _compile(model)
    for batch in (4, 1, 0):
        x, y = torch.randint(0, 11, (batch, 5)), torch.randn(batch, 4)
        want = dp_sgd_grads(model, mse, x, y, max_grad_norm=0.5, expected_batch_size=4)
        assert_close(run_dpfx(dp, model, mse, x, y), want, rtol=1e-4, atol=1e-6)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1


def test_an_entry_holds_the_inputs_fake_values_only(cache, monkeypatch):
    """Note [An entry holds no fake value it would not read]: the stored graphs carry their
    placeholders' fake values and no other node's; the graphs dpfx goes on to rewrite keep all
    of theirs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    stored, kept = [], []
    snapshot = dpfx.lower.warm.snapshot

    def spy(gm):
        before = {n: dict(n.meta) for n in gm.graph.nodes}
        data = snapshot(gm)
        stored.append(data)
        kept.append(all(n.meta == before[n] for n in gm.graph.nodes))
        return data

    monkeypatch.setattr(dpfx.lower.warm, "snapshot", spy)
    torch.manual_seed(0)
    model = Seq()
    x, y = torch.randint(0, 11, (4, 5)), torch.randn(4, 4)
    want = dp_sgd_grads(model, mse, x, y, max_grad_norm=0.5, expected_batch_size=4)
    assert_close(run_dpfx(_compile(model), model, mse, x, y), want, rtol=1e-4, atol=1e-6)
    assert len(stored) == 2 and all(kept)
    for data in stored:
        graph = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv())).graph
        placeholders = graph.find_nodes(op="placeholder")
        assert placeholders and all(isinstance(n.meta.get("val"), (torch.Tensor, torch.SymInt))
                                    for n in placeholders)
        inner = [n for n in graph.nodes if n.op == "call_function"]
        assert inner and not any(k in n.meta for n in inner
                                 for k in ("val", "tensor_meta", "example_value"))
