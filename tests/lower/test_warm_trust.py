"""Note [A trusted warm start] (dpfx/lower/trust.py) on its own, without a compile: which graphs
may be written for a trusted start and which entries are run as they are, by one precondition;
a trusted hit runs the entry's code without dpfx's inner compiler; an entry that fails its
digest, or whose pair is not trusted, is a miss, and the corrupted entry is forgotten.
tests/lower/test_warm_start.py runs the same paths through whole compiles."""
import os
import types

import pytest
import torch
import torch.fx as fx
from torch._functorch._aot_autograd.autograd_cache import FXGraphCacheMiss
from torch._inductor.codecache import FxGraphCache
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import dpfx.ops.blocks  # noqa: F401  (registers dpfx::block_fwd)
from dpfx.config import DPConfig
from dpfx.lower import trust, warm
from dpfx.lower.selfcheck import verdict_path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DPFX_REPROVE", raising=False)
    return tmp_path


def _config(**settings):
    return DPConfig(max_grad_norm=1.0, noise_multiplier=0.0, **settings)


def _graph(size=None, block_op=False) -> fx.GraphModule:
    """x -> x * 2 (or a block op on x); ``size``: the placeholder's fake value, a SymInt."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    if size is not None:
        x.meta["val"] = size
    if block_op:
        y = graph.call_function(torch.ops.dpfx.block_fwd.default, ("key", [x]))
    else:
        y = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    graph.output((y,))
    return fx.GraphModule(torch.nn.Module(), graph)


def _verdict(pair: str) -> None:
    os.makedirs(os.path.dirname(verdict_path(pair)), exist_ok=True)
    open(verdict_path(pair), "w").close()


REFUSED = [({"backend": "eager"}, False), ({"track_norms": True}, False),
           ({"self_check": "always"}, False), ({}, True)]


@pytest.mark.parametrize("settings,validating", REFUSED,
                         ids=["eager", "track_norms", "self_check_always", "validate"])
def test_one_precondition_refuses_both_writing_and_running(cache, settings, validating):
    config = _config(**settings)
    _verdict("pair")
    assert not trust.may_trust(config, validating)
    assert not trust.trustable(_graph(), set(), config, validating)
    assert not trust.trusts({"kind": "backward", "pair": "pair"}, config, validating)


def test_the_defaults_write_and_run_a_checked_pair(cache):
    config = _config()
    assert trust.may_trust(config, False)
    assert trust.trustable(_graph(), set(), config, False)
    plan = {"kind": "backward", "pair": "pair"}
    assert not trust.trusts(plan, config, False)          # no passed self-check yet
    _verdict("pair")
    assert trust.trusts(plan, config, False)
    assert not trust.trusts({"kind": "backward", "pair": None}, config, False)
    # with the self-check off, no verdict is asked for
    assert trust.trusts({"kind": "backward", "pair": None}, _config(self_check=False), False)


def test_a_graph_of_this_process_or_of_other_sizes_is_not_written(cache):
    """A block's kernels live in the process that compiled them; a size other than the batch
    is read at run time, so the self-check's verdict would not cover it."""
    config = _config()
    shapes = ShapeEnv()
    batch, other = shapes.create_unbacked_symint(), shapes.create_unbacked_symint()
    assert trust.trustable(_graph(batch), {batch.node.expr}, config, False)
    assert not trust.trustable(_graph(other), {batch.node.expr}, config, False)
    assert not trust.trustable(_graph(block_op=True), set(), config, False)


class _Backend:
    """What DPOutputCode asks of the backend compiling now, recorded."""

    def __init__(self, config):
        self.config, self.problems, self.calls = config, None, []

    def load_trusted(self, plan, lowered, kwargs):
        self.calls.append(("load_trusted", plan["kind"]))
        return lambda args: ["trusted", *args]

    def compile_graph(self, gm, inputs, kwargs):
        self.calls.append(("compile_graph",))
        raise AssertionError("dpfx's passes ran")


class _Lowered:
    """Stands for an entry's lowered code (Inductor's CompiledFxGraph)."""
    source_code = "def call(args): ..."
    cache_key = "key"

    def post_compile(self, *args):
        pass


def _entry(kind="forward", graph=b"the captured graph") -> warm.DPOutputCode:
    """A forward's output code as AOTAutogradCache loads it: no runner, its graph, its lowered
    code, its plan and the digest written with them."""
    code = warm.DPOutputCode(None, graph, {"is_backward": kind == "backward", "graph_id": 0})
    code.lowered, code.plan = _Lowered(), {"kind": kind, "pair": "pair"}
    code.digest = trust.digest(code.plan, code.lowered, graph)
    return code


def test_a_trusted_hit_runs_the_entry_without_the_passes(cache, monkeypatch):
    _verdict("pair")
    monkeypatch.setattr(FxGraphCache, "cache_hit_post_compile",
                        staticmethod(lambda lowered, *args: (lowered, None)))
    backend = _Backend(_config())
    trusted = trust.state.trusted
    with warm.compiling(backend):
        code = _entry()
        code.post_compile([torch.ones(2)], {}, {})
        assert trust.state.trusted_forward is code.plan
    assert backend.calls == [("load_trusted", "forward")]
    assert code([1]) == ["trusted", 1] and trust.state.trusted == trusted + 1


def test_an_entry_that_fails_its_digest_is_a_miss_and_forgotten(cache, monkeypatch):
    _verdict("pair")
    loads = []
    monkeypatch.setattr(FxGraphCache, "cache_hit_post_compile",
                        staticmethod(lambda lowered, *args: loads.append(lowered)))
    code = _entry()
    code.lowered.source_code = "def call(args): return mixed(args)"     # a changed byte
    stored = cache / "aotautograd" / "entry"
    stored.parent.mkdir()
    stored.write_bytes(b"..." + code.digest.encode() + b"...")
    backend = _Backend(_config())
    trusted = trust.state.trusted
    with warm.compiling(backend), pytest.raises(FXGraphCacheMiss, match="digest"):
        code.post_compile([torch.ones(2)], {}, {})
    assert backend.calls == [] and loads == [] and trust.state.trusted == trusted
    assert not stored.exists()


def test_an_untrusted_pair_is_rebuilt_or_missed(cache, monkeypatch):
    """No verdict: the forward is rebuilt (its graph through the passes). A backward is run as
    it is only after its trusted forward; a trusted forward's backward that is not trusted
    misses, so that both are compiled again. DPFX_REPROVE=1 rebuilds every entry."""
    backend = _Backend(_config())
    with warm.compiling(backend):
        assert not trust.load(_entry(), backend, [], {}, {"is_backward": False})
        assert not trust.load(_entry("backward"), backend, [], {}, {"is_backward": True})
        trust.state.trusted_forward = {"kind": "forward"}
        with pytest.raises(FXGraphCacheMiss, match="backward is not trusted"):
            trust.load(_entry("backward"), backend, [], {}, {"is_backward": True})
        _verdict("pair")
        monkeypatch.setenv("DPFX_REPROVE", "1")
        trust.state.trusted_forward = None
        assert not trust.load(_entry(), backend, [], {}, {"is_backward": False})
    assert backend.calls == []


def test_the_trust_pairs_a_forward_with_its_backward():
    """A backward's plan is made only after its forward's, and the forward's plan then names
    the pair's verdict; a backward that cannot be trusted (noise drawn by Inductor on a GPU)
    leaves its forward unpaired."""
    from torch._inductor.output_code import CompiledFxGraph

    class Code(CompiledFxGraph):
        def __init__(self, key):
            self._fx_graph_cache_key, self.cache_key = key, key + "-code"

    trusted, stages = trust.Trust(), types.SimpleNamespace(graphs={})
    runner = {"positions": {"w": 0}, "zero_tangents": [], "adaptive": False, "padded": False}

    def forward():
        stages.graphs["forward"] = "text"
        trusted.forward(0, Code("fw"))
        return lambda args: "run forward"

    def backward(plan):
        def compile():
            trusted.backward(0, Code("bw"), None, plan)
            return lambda args: "run backward"
        return compile

    fw = warm.output_code(trusted, _graph(), {"graph_id": 0}, stages, forward)
    bw = warm.output_code(trusted, _graph(), {"graph_id": 0, "is_backward": True}, stages,
                          backward(runner))
    assert fw.plan == {"kind": "forward", "stages": {"forward": "text"}, "pair": bw.plan["pair"]}
    assert bw.plan["pair"] and bw.plan["positions"] == {"w": 0} and fw([]) == "run forward"
    fw = warm.output_code(trusted, _graph(), {"graph_id": 1}, stages,
                          lambda: trusted.forward(1, Code("fw")))
    bw = warm.output_code(trusted, _graph(), {"graph_id": 1, "is_backward": True}, stages,
                          lambda: trusted.backward(1, Code("bw"), None, None))
    assert "pair" not in fw.plan and bw.plan is None
