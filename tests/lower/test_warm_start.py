"""Note [A warm start without the joint trace] (dpfx/lower/warm.py) and Note [A trusted warm start]
(dpfx/lower/trust.py):
a second compile of the same model finds dpfx's graphs in AOTAutogradCache and skips aot_autograd's
trace. By default it runs the entry's code as it is, without the passes, the proof or the lowering,
where the entry's digest holds and its self-check passed; under ``DPFX_REPROVE=1`` it runs dpfx's
passes, proof, lowering and self-check on the loaded graphs. Either way it trains exactly as a cold
compile; a changed setting, dpfx or torch misses, a corrupted entry is rebuilt, nothing but dpfx's
own entries serves a dpfx compile, and a rebuild that fails falls back to a full one."""
import glob
import os

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import dpfx
import dpfx.backend
import dpfx.lower.inductor
import dpfx.lower.trust
import dpfx.lower.warm
from support.models import MLP, mse
from support.reference import assert_close, dp_sgd_grads, run_dpfx


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv("DPFX_REPROVE", raising=False)
    counters.clear()
    yield tmp_path / "inductor"
    torch._dynamo.reset()


def _compile(model, **settings):
    torch._dynamo.reset()
    return dpfx.compile(model, **{"max_grad_norm": 0.5, "noise_multiplier": 0.0,
                                  "expected_batch_size": 4, **settings})


def _exact(dp, model, batch, max_grad_norm=0.5, loss=mse):
    x, y = torch.randn(batch, 8), torch.randn(batch, 4)
    want = dp_sgd_grads(model, loss, x, y, max_grad_norm=max_grad_norm, expected_batch_size=4)
    assert_close(run_dpfx(dp, model, loss, x, y), want, rtol=1e-4, atol=1e-6)


def _trusted():
    return dpfx.lower.trust.state.trusted


def _no_passes(monkeypatch):
    """Make every run of dpfx's passes fail: only a trusted entry compiles."""
    def fail(*args, **kwargs):
        raise AssertionError("dpfx's passes ran")

    monkeypatch.setattr(dpfx.backend, "compile_forward", fail)
    monkeypatch.setattr(dpfx.backend, "compile_backward", fail)


def test_a_trusted_entry_runs_without_the_passes_and_stays_exact(cache, monkeypatch):
    torch.manual_seed(0)
    model = MLP()
    _exact(_compile(model), model, 4)
    assert counters["aot_autograd"]["autograd_cache_saved"] == 1
    assert len(os.listdir(cache / "dpfx_verdicts")) == 1     # the self-check's pass, left
    counters.clear()
    trusted = _trusted()
    with monkeypatch.context() as m:
        _no_passes(m)
        dp = _compile(model)
        for batch in (3, 1, 0, 5):                            # the one compile serves them all
            _exact(dp, model, batch)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    assert counters["inductor"]["fxgraph_cache_hit"] == 0     # no lowering either
    assert _trusted() == trusted + 2 and dp._dpfx_backend.compiles == 2
    # the stage texts come from the entry: dumps and dpfx.explain read the same graphs
    assert any(name.startswith("backward") for name in dp._dpfx_backend.stages.graphs)


def test_a_trusted_entry_noises_as_the_cold_compile(cache):
    """With noise, the trusted entry's release is the cold compile's under the same seed."""
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    grads = []
    for _ in range(2):
        dp = _compile(model, noise_multiplier=1.3, seed=7)
        grads.append(run_dpfx(dp, model, mse, x, y))
    assert _trusted() >= 2
    assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_reprove_runs_the_passes_on_the_entry_with_the_same_verdicts(cache, monkeypatch):
    """DPFX_REPROVE=1: the entry's graphs are proven, lowered (the same code: Inductor's
    FX-graph cache hits) and checked again; the verdicts are the trusted ones."""
    torch.manual_seed(0)
    model = MLP()
    _exact(_compile(model), model, 4)
    verdicts = sorted(os.listdir(cache / "dpfx_verdicts"))
    counters.clear()
    monkeypatch.setenv("DPFX_REPROVE", "1")
    trusted = _trusted()
    dp = _compile(model)
    _exact(dp, model, 3)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    assert counters["inductor"]["fxgraph_cache_hit"] == 2     # the same rewritten graphs
    assert _trusted() == trusted and dp._dpfx_backend.compiles == 2
    assert dp._dpfx_backend.last_backward is not None        # the passes ran: their result
    assert sorted(os.listdir(cache / "dpfx_verdicts")) == verdicts
    monkeypatch.delenv("DPFX_REPROVE")
    counters.clear()
    _exact(_compile(model), model, 2)
    assert _trusted() == trusted + 2


@pytest.mark.parametrize("change", [
    {"max_grad_norm": 0.05}, {"noise_multiplier": 0.5}, {"loss_reduction": "sum"},
    {"strategy": "materialize"}])
def test_a_changed_setting_misses(cache, change):
    """The key names every private setting: an entry made under others never serves."""
    torch.manual_seed(0)
    model = MLP()
    _exact(_compile(model), model, 4)
    counters.clear()
    trusted = _trusted()
    dp = _compile(model, **change)
    reduction = change.get("loss_reduction", "mean")
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    loss = mse_sum if reduction == "sum" else mse
    got = run_dpfx(dp, model, loss, x, y, loss_reduction=reduction)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 0 and _trusted() == trusted
    if "noise_multiplier" not in change:
        want = dp_sgd_grads(model, loss, x, y, max_grad_norm=change.get("max_grad_norm", 0.5),
                            loss_reduction=reduction, expected_batch_size=4)
        assert_close(got, want, rtol=1e-4, atol=1e-6)


def _steps(dp, model, settings, batches=(5, 3)):
    """What two steps release: each parameter's gradient (or clipped sum), the adaptive bound."""
    torch.manual_seed(1)
    seen = []
    for batch in batches:
        x, y = torch.randn(batch, 8), torch.randn(batch, 4)
        model.zero_grad(set_to_none=True)
        (dp.loss(x, y) if "loss" in settings else mse(dp(x), y)).backward()
        if settings.get("noise") == "optimizer":
            seen.append({k: v.clone() for k, v in dp.clipped_sums.items()})
            dp.reset_clipped_sums()
        else:
            seen.append({k: p.grad.clone() for k, p in model.named_parameters()})
        if dp.adaptive_clip is not None:
            seen.append({"bound": torch.tensor(dp.adaptive_clip.bound)})
    return seen


@pytest.mark.parametrize("settings", [
    {"clipping": "adaptive", "noise_multiplier": 1.0, "count_noise_multiplier": 2.0, "seed": 3},
    {"noise": "optimizer"},
    {"max_grad_norm": {"fc1": 0.3, "fc2": 0.2}},
    {"loss": mse},
    {"batch_buckets": (4, 8), "clipping": "adaptive", "noise_multiplier": 1.0,
     "count_noise_multiplier": 2.0, "seed": 3},
], ids=["adaptive", "optimizer_noise", "per_layer", "captured_loss", "buckets"])
def test_a_trusted_entry_releases_what_the_cold_compile_released(cache, monkeypatch, settings):
    """Adaptive clipping (the bound as an input, the count as an output), noise at the
    optimizer, per-layer bounds, a captured loss and padded batches (the real count as an
    input): the trusted entry's releases are the cold compile's, number for number."""
    torch.manual_seed(0)
    model = MLP()
    cold = _steps(_compile(model, **settings), model, settings)
    trusted = _trusted()
    with monkeypatch.context() as m:
        _no_passes(m)
        warm = _steps(_compile(model, **settings), model, settings)
    assert _trusted() == trusted + 2
    for a, b in zip(cold, warm, strict=True):
        assert_close(b, a, rtol=0, atol=0)


def mse_sum(out, y):
    return torch.nn.functional.mse_loss(out, y, reduction="sum")


def test_another_dpfx_or_torch_misses(cache, monkeypatch):
    """dpfx's source digest and torch's version are in the key."""
    torch.manual_seed(0)
    model = MLP()
    _exact(_compile(model), model, 4)
    for patch in (lambda m: m.setattr(dpfx.lower.inductor, "_source_digest", lambda: "other"),
                  lambda m: m.setattr(torch._inductor.codecache, "torch_key", lambda: b"other")):
        with monkeypatch.context() as m:
            patch(m)
            counters.clear()
            _exact(_compile(model), model, 3)
            assert counters["aot_autograd"]["autograd_cache_hit"] == 0


def _entries(cache):
    return [p for p in glob.glob(str(cache / "aotautograd" / "**" / "*"), recursive=True)
            if os.path.isfile(p)]


def test_a_corrupted_entry_is_detected_and_rebuilt(cache, monkeypatch):
    """An entry whose code changed on disk (one byte of its source) fails its digest: the
    compile misses, runs the passes, and writes the entry again, which the next one trusts."""
    torch.manual_seed(0)
    model = MLP()
    _exact(_compile(model), model, 4)
    (path,) = _entries(cache)
    data = open(path, "rb").read()
    assert data.count(b"def call(self, args)") >= 1
    with open(path, "wb") as f:
        f.write(data.replace(b"def call(self, args)", b"def call(self, argz)"))
    counters.clear()
    trusted = _trusted()
    dp = _compile(model)
    _exact(dp, model, 3)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 0
    assert counters["aot_autograd"]["autograd_cache_miss"] == 1
    assert _trusted() == trusted and dp._dpfx_backend.last_backward is not None
    assert any(b"def call(self, args)" in open(p, "rb").read() for p in _entries(cache))
    assert not any(b"def call(self, argz)" in open(p, "rb").read() for p in _entries(cache))
    with monkeypatch.context() as m:
        _no_passes(m)
        _exact(_compile(model), model, 2)
    assert _trusted() == trusted + 2


def test_an_entry_without_a_passed_self_check_is_proven_and_checked(cache):
    """The trusted path needs the self-check's verdict: without it (the marker gone) the entry
    is rebuilt, proven and checked, and the pass leaves the verdict for the next compile."""
    from dpfx.lower import selfcheck

    torch.manual_seed(0)
    model = MLP()
    _exact(_compile(model), model, 4)
    for name in os.listdir(cache / "dpfx_verdicts"):
        os.remove(cache / "dpfx_verdicts" / name)
    for name in os.listdir(cache / "dpfx_selfcheck"):
        os.remove(cache / "dpfx_selfcheck" / name)
    trusted = _trusted()
    runs = []
    check_at, run = selfcheck.GraphCheck._check_at, selfcheck.GraphCheck.run
    selfcheck.GraphCheck._check_at = lambda self, b, *a: (runs.append(b), check_at(self, b, *a))
    selfcheck.GraphCheck.run = lambda self, *a: (runs.append("run"), run(self, *a))
    try:
        dp = _compile(model)
        _exact(dp, model, 3)
    finally:
        selfcheck.GraphCheck._check_at, selfcheck.GraphCheck.run = check_at, run
    assert runs[0] == "run" and runs[1:] and _trusted() == trusted
    assert dp._dpfx_backend.last_backward is not None
    assert len(os.listdir(cache / "dpfx_verdicts")) == 1
    _exact(_compile(model), model, 2)
    assert _trusted() == trusted + 2


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
    monkeypatch.setenv("DPFX_REPROVE", "1")
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


def test_saved_activations_carry_no_dynamo_marks(cache, monkeypatch):
    """Note [Saved activations carry no dynamo marks] (dpfx/backend/__init__.py): a steady step,
    cold and warm, stamps the forward's outputs only, not the activations it saves; and the
    warm start still trains exactly."""
    from torch._functorch._aot_autograd import runtime_wrappers

    stamped = []
    mark = runtime_wrappers.mark_dynamo_propagated_dynamic_indices
    monkeypatch.setattr(runtime_wrappers, "mark_dynamo_propagated_dynamic_indices",
                        lambda t, dims: (stamped.append(tuple(t.shape)), mark(t, dims)))
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    for start in ("cold", "warm"):
        torch.manual_seed(0)
        model = MLP(8, 16, 4)
        dp = _compile(model)
        mse(dp(x), y).backward()
        stamped.clear()
        mse(dp(x), y).backward()
        # the one output (5, 4); without the note, the input, tanh's output and the other
        # activations the forward saves are stamped too
        assert stamped == [(5, 4)], (start, stamped)
        _exact(dp, model, 5)
    assert _trusted() >= 1
