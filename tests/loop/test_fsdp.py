"""DP-SGD over models sharded with FSDP2's ``fully_shard`` (gloo, processes spawned by the test).

At sigma = 0, after every step each rank's unsharded gradient (``p.grad.full_tensor()``) and
parameters equal an independent batch-of-one clipped reference over the union of the ranks'
batches (batch sizes differ across ranks, some are empty), through Inductor with the self-check
on: an MLP sharded per layer on 2 and 4 ranks, an HF Llama sharded per decoder layer with a tied
head (by default with backend="eager"), and LoRA adapters on a sharded frozen base (the noise at
sigma > 0, each rank's shard noised once, with and without blocks: test_noise_ranks.py).
Parameters, gradients and optimizer state stay DTensor shards, evaluation reshards after its
forward, and each rank's checkpoint of its shards loads into a fresh sharded run. A block that is
an FSDP unit is gathered with one collective for each of its ops.
Configurations dpfx does not support are refused on every rank with what to change (Note
[Sharded DP-SGD] in dpfx/loop/fsdp.py).
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from support import gloo_ranks
from support.models import MLP
from support.reference import clip_fraction, loop_dp_sgd_grads

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed")

C, LR, SIGMA = 0.3, 0.5, 2.0
# Each step, each rank's batch size: they differ across ranks, and some are empty.
SIZES = {2: [(3, 2), (4, 0), (1, 5)],
         4: [(3, 2, 0, 1), (0, 0, 4, 2), (1, 5, 2, 0)]}
VOCAB, T = 61, 5


# -- models and data ---------------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return MLP(8, 16, 4)


def _mlp_data(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    n = SIZES[world][step][rank]
    return torch.randn(n, 8, generator=g) * 3, torch.randn(n, 4, generator=g)


def _mse(out, y):
    return ((out - y) ** 2).flatten(1).mean(1)


class LM(nn.Module):
    """An HF Llama whose logits are the output (the loss is the test's)."""

    def __init__(self, lora: bool):
        super().__init__()
        import transformers
        torch.manual_seed(0)
        self.m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=16,
            tie_word_embeddings=True))
        assert self.m.lm_head.weight is self.m.model.embed_tokens.weight
        if lora:
            import peft
            self.m = peft.get_peft_model(self.m, peft.LoraConfig(
                r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).logits

    def layers(self):
        base = self.m.get_base_model() if hasattr(self.m, "get_base_model") else self.m
        return base.model.layers


def _lm_data(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    n = SIZES[world][step][rank]
    return torch.randint(0, VOCAB, (n, T), generator=g), torch.randint(0, VOCAB, (n, T),
                                                                        generator=g)


def _token_ce(logits, y):
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)


def _setup(name: str):
    """(model, its per-example loss, its data, its clipping bound)."""
    if name == "mlp":
        return _mlp(), _mse, _mlp_data, C
    return LM(lora=name == "lora"), _token_ce, _lm_data, 0.05


def _shard(model: nn.Module, name: str) -> None:
    from torch.distributed.fsdp import fully_shard
    if name == "mlp":
        fully_shard(model.fc1)
        fully_shard(model.fc2)
    else:
        for layer in model.layers():
            fully_shard(layer)
    fully_shard(model)


# -- what each rank runs -----------------------------------------------------------------------
def _train(name: str, world: int, reduction: str, steps: int, backend="inductor", blocks=None):
    """A sharded private run at sigma 0 on this rank: (parameters after it, every step's
    unsharded p.grad, the types of parameters, gradients and optimizer state)."""
    model, per_example, data, bound = _setup(name)
    _shard(model, name)
    D = 6
    dp = dpfx.compile(model, max_grad_norm=bound, noise_multiplier=0.0,
                      expected_batch_size=D, loss_reduction=reduction, seed=7, backend=backend,
                      blocks=blocks)
    assert dp.dp_config.noise == "optimizer"
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5), dp)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = {n: [] for n, _ in trainable}
    for step in range(steps):
        x, y = data(step % 3, dist.get_rank(), world)
        opt.zero_grad()
        terms = per_example(dp(x), y)
        (terms.mean() if reduction == "mean" else terms.sum()).backward()
        opt.step()
        for n, p in trainable:
            grads[n].append(p.grad.full_tensor())
        if name == "mlp":       # evaluation gathers, computes and goes back to shards (the
            with torch.no_grad():   # Llama's own evaluation graph would add a compile per rank)
                dp(x)
    if name == "mlp":
        _checkpoint_round_trip(model, dp, opt)
    kinds = {type(p).__name__ for _, p in model.named_parameters()} \
        | {type(p.grad).__name__ for _, p in trainable} \
        | {type(v).__name__ for s in opt.state.values() for v in s.values()}
    return ({n: p.full_tensor().detach() for n, p in model.named_parameters()},
            {n: torch.stack(g) for n, g in grads.items()}, kinds,
            sorted(place.name for place in dp._sharding.places.values()))


def _checkpoint_round_trip(model, dp, opt) -> None:
    """Each rank saves its shards and the optimizer's; a fresh sharded run loads them; one path
    for every rank is refused."""
    import tempfile
    rank = dist.get_rank()
    with tempfile.TemporaryDirectory() as tmp:
        shared = os.path.join(tmp, "..", "dpfx-one-path-for-all.pt")
        try:
            dpfx.save_checkpoint(shared, model=dp, optimizer=opt)
        except ValueError as e:
            assert "its own checkpoint path" in str(e), e
        else:
            raise AssertionError("one checkpoint path for every rank was not refused")
        path = os.path.join(tmp, f"ckpt.rank{rank}.pt")
        dpfx.save_checkpoint(path, model=dp, optimizer=opt)
        fresh = _mlp()
        _shard(fresh, "mlp")
        dp2 = dpfx.compile(fresh, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=6,
                           backend="eager")
        opt2 = dpfx.DPOptimizer(torch.optim.SGD(fresh.parameters(), lr=LR, momentum=0.5), dp2)
        dpfx.load_checkpoint(path, model=dp2, optimizer=opt2)
    for (n, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), n
        assert torch.equal(opt.state[p]["momentum_buffer"].full_tensor(),
                           opt2.state[q]["momentum_buffer"].full_tensor()), n
    assert opt2.steps == opt.steps


def _refusals() -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    said = {}

    def refused(what, make):
        try:
            make()
        except ValueError as e:
            said[what] = str(e)
        else:
            said[what] = "not refused"

    def mixed():
        model = _mlp()
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=6)

    def graph_noise():
        model = _mlp()
        fully_shard(model)
        dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=6,
                     noise="graph")

    def grouped():
        model = _mlp()
        fully_shard([model.fc1, model.fc2])
        fully_shard(model)
        dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=6)

    def untouched():            # a refused compile leaves the model as it was: sharded
        model = _mlp()
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        try:
            dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=6)
        except ValueError:
            pass
        kinds = {type(p).__name__ for p in model.parameters()}
        raise ValueError(f"kinds {sorted(kinds)}")

    def optimizer_first():
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        fully_shard(model)
        dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=6)
        dpfx.DPOptimizer(opt, dp)

    refused("optimizer_first", optimizer_first)
    refused("mixed", mixed)
    refused("graph_noise", graph_noise)
    refused("grouped", grouped)
    refused("untouched", untouched)
    return said


def _counting_gathers(*args):
    """``_train(*args)`` with the all-gathers of the blocks' places counted, and the block ops
    that found their unit not gathered (those that need it gathered)."""
    from dpfx.loop import fsdp
    counts = {"gathers": 0, "ops": 0}
    gather, resident = fsdp._all_gather, fsdp.Place.resident

    def counted_gather(*a, **kw):
        counts["gathers"] += 1
        return gather(*a, **kw)

    def counted_resident(place):
        counts["ops"] += not place.filled and bool(place.params)
        return resident(place)

    fsdp._all_gather, fsdp.Place.resident = counted_gather, counted_resident
    try:
        return _train(*args), counts
    finally:
        fsdp._all_gather, fsdp.Place.resident = gather, resident


class _SharedLayer(nn.Module):
    """fc1 used twice in one forward (a layer shared across depth): no block can clip it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(torch.tanh(self.fc1(x)))))


def _fallback() -> dict:
    """A sharded model whose units blocks cannot take: by default it falls back to the one
    graph with a BlocksFallbackWarning and trains; asked for blocks, it is refused."""
    import warnings
    from torch.distributed.fsdp import fully_shard

    def sharded():
        model = _SharedLayer()
        fully_shard(model.fc1)
        fully_shard(model.fc2)
        fully_shard(model)
        return model

    said = {}
    model = sharded()
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=6,
                      backend="eager")
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), dp)
    x, y = torch.randn(5, 8) * 3, torch.randn(5, 4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.zero_grad()
        _mse(dp(x), y).mean().backward()
        opt.step()
    said["warned"] = [str(w.message) for w in seen
                      if issubclass(w.category, dpfx.BlocksFallbackWarning)]
    said["places"] = sorted(dp._sharding.places)
    said["step"] = float(sum(p.grad.full_tensor().pow(2).sum() for p in model.parameters()))
    try:
        dpfx.compile(sharded(), max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=6,
                     backend="eager", blocks="auto")(x)
    except dpfx.CaptureError as e:
        said["asked"] = str(e)
    else:
        said["asked"] = "not refused"
    return said


def _zoo_fallback(name: str) -> dict:
    """A zoo model (tests/hf/test_hf_zoo.py) sharded per block of its _no_split_modules, whose
    blocks dpfx refuses: blocks="auto" asked for is refused with the blocks' error; by default
    one step falls back to the one graph with a BlocksFallbackWarning, and its gradient
    (sigma 0, SGD with lr 0 so the step reads it) is the batch-of-one reference's."""
    import copy
    import warnings
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from hf.test_hf_zoo import ZOO, reference

    case = ZOO[name]

    def sharded():
        torch.manual_seed(0)
        model = case.build().train()
        plain = copy.deepcopy(model)
        for m in [m for m in model.modules() if type(m).__name__ in model._no_split_modules]:
            fully_shard(m)
        return fully_shard(model), plain

    kw, y = case.inputs(3, torch.Generator().manual_seed(1))
    said = {}
    model, _ = sharded()
    try:
        dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, noise="optimizer",
                     expected_batch_size=3, backend="eager", blocks="auto")(**kw, **case.static)
    except dpfx.DPFXError as e:
        said["asked"] = f"{type(e).__name__}: {e}"
    else:
        said["asked"] = "not refused"

    model, plain = sharded()
    want, said["norms"] = reference(plain, case, kw, y, 0.05)
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, noise="optimizer",
                      expected_batch_size=3, backend="eager")
    opt = dpfx.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), dp)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.zero_grad()
        case.loss(dp(**kw, **case.static).logits, y).backward()
        opt.step()
    said["warned"] = [str(w.message) for w in seen
                      if issubclass(w.category, dpfx.BlocksFallbackWarning)]
    said["units"] = sum(isinstance(m, FSDPModule) for m in model.modules()) - 1
    said["places"] = sorted(dp._sharding.places)
    said["got"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    said["want"] = want
    return said


def _scenario(scenario: str, args: tuple):
    return {"train": _train, "gathers": _counting_gathers, "refusals": _refusals,
            "fallback": _fallback, "zoo_fallback": _zoo_fallback}[scenario](*args)


def _spawn(tmp_path, world, scenario, *args, deadline=480):
    results, errors = gloo_ranks.spawn(tmp_path, world, _scenario, scenario, args,
                                       deadline=deadline)
    assert not errors, errors
    assert sorted(results) == list(range(world)), sorted(results)
    return results


# -- the reference -----------------------------------------------------------------------------
def _reference(name: str, world: int, reduction: str):
    """SGD with momentum on the union of the ranks' batches, with the batch-of-one clipped
    gradient (sigma = 0), in this process: (parameters after the run, every step's gradient).
    Shares no code with dpfx."""
    model, per_example, data, bound = _setup(name)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR,
                          momentum=0.5)
    grads = {n: [] for n, p in model.named_parameters() if p.requires_grad}
    for step in range(3):
        batches = [data(step, r, world) for r in range(world)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        assert clip_fraction(model, lambda o, t: per_example(o, t).sum(), x, y, bound) > 0 \
            if name == "mlp" else True
        want = loop_dp_sgd_grads(model, lambda o, t: per_example(o, t).sum(), (x,), y,
                                 max_grad_norm=bound, loss_reduction="sum")
        scale = 1 / 6 if reduction == "mean" else 1.0          # D = 6, the expected batch size
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.grad = want[n] * scale
                grads[n].append(p.grad.clone())
        opt.step()
    return ({n: p.detach() for n, p in model.named_parameters()},
            {n: torch.stack(g) for n, g in grads.items()})


def _check_exact(results, name, world, reduction, tol, blocks=None):
    """Every rank's run equals the reference; ``blocks``: the names of the units it ran as
    blocks (sorted; [] for the one graph)."""
    want_params, want_grads = _reference(name, world, reduction)
    for rank in range(world):
        params, grads, kinds, ran = results[rank]
        if blocks is not None:
            assert ran == blocks, ran
        assert kinds == {"DTensor"}, kinds        # parameters, gradients, momentum: shards
        assert grads.keys() == want_grads.keys()
        for n in want_grads:
            torch.testing.assert_close(grads[n], want_grads[n], **tol,
                                       msg=lambda m: f"rank {rank} gradient {n}: {m}")
        for n in want_params:
            torch.testing.assert_close(params[n], want_params[n], **tol,
                                       msg=lambda m: f"rank {rank} parameter {n}: {m}")


# -- the tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("world,reduction", [(2, "mean"), pytest.param(4, "sum",
                                                                      marks=pytest.mark.slow)])
def test_sharded_mlp_equals_the_reference_on_the_union(tmp_path, world, reduction):
    """The one private graph (blocks=False), which holds the whole model during the step."""
    results = _spawn(tmp_path, world, "train", "mlp", world, reduction, 3, "inductor", False)
    _check_exact(results, "mlp", world, reduction, dict(rtol=1e-4, atol=1e-6), blocks=[])


def test_a_sharded_model_compiles_its_units_as_blocks_by_default(tmp_path):
    """Note [A sharded model gets blocks by default] in dpfx/api.py: without blocks=, each
    fully_shard unit but the root (fc1, fc2) runs as a block, gathered only by its own ops, and
    the run equals the reference through Inductor."""
    results = _spawn(tmp_path, 2, "train", "mlp", 2, "mean", 3)
    _check_exact(results, "mlp", 2, "mean", dict(rtol=1e-4, atol=1e-6),
                 blocks=["fc1", "fc2"])


# Through Inductor the Llama runs take 65-70 s on 2 cores (two ranks compiling beside the other
# test worker), so they are slow; by default the Llama runs with backend="eager": the rewrite,
# the sharded clipping and the optimizer's noise are the backend's input, and the sharded path
# through Inductor is the MLP's above, HF Llama through Inductor test_hf_token_loss.py's, PEFT
# through Inductor test_trainer.py's.
@pytest.mark.parametrize("name,backend", [
    ("llama", "eager"),
    pytest.param("llama", "inductor", marks=pytest.mark.slow),
    pytest.param("lora", "inductor", marks=pytest.mark.slow)])
def test_sharded_llama_with_tied_head_and_lora(tmp_path, name, backend):
    pytest.importorskip("transformers")
    if name == "lora":
        pytest.importorskip("peft")
    results = _spawn(tmp_path, 2, "train", name, 2, "mean", 3, backend, False)
    _check_exact(results, name, 2, "mean", dict(rtol=1e-4, atol=1e-6), blocks=[])


def test_units_blocks_cannot_take_fall_back_to_one_graph_with_a_warning(tmp_path):
    """Note [A sharded model gets blocks by default] in dpfx/api.py: a unit called twice in
    one forward is no block; by default the model trains as one graph (no unit placed), warned
    once with the fix, and each step moves by at most C / D per example (sigma 0); blocks="auto"
    asked for is refused naming blocks=False."""
    results = _spawn(tmp_path, 2, "fallback")
    for rank in range(2):
        said = results[rank]
        assert len(said["warned"]) == 1 and "blocks=False" in said["warned"][0], said
        assert "called 2 times" in said["warned"][0], said
        assert said["places"] == [], said
        assert 0 < said["step"] ** 0.5 <= 10 * C / 6 * (1 + 1e-5), said     # 10 examples, D = 6
        assert "blocks=False" in said["asked"], said


def test_a_zoo_model_whose_blocks_are_refused_falls_back_to_one_graph(tmp_path):
    """T5 sharded per block on one gloo rank: its first block hands the relative position bias
    it computes to the next (a block output without the batch that receives a gradient), which
    no block can clip. By default dpfx falls back to the one graph, warned with the fix, and the
    step is the batch-of-one reference's; blocks="auto" asked for is refused."""
    pytest.importorskip("transformers")
    said = _spawn(tmp_path, 1, "zoo_fallback", "t5", deadline=900)[0]
    assert said["asked"].startswith("UnsupportedOpError") \
        and "relative_attention_bias" in said["asked"], said["asked"]
    assert len(said["warned"]) == 1 and "blocks=False" in said["warned"][0], said["warned"]
    assert "relative_attention_bias" in said["warned"][0], said["warned"]
    assert said["units"] >= 2 and said["places"] == [], said["places"]
    assert min(said["norms"]) > 0.05, said["norms"]     # clipping bites on every example
    assert said["got"].keys() == said["want"].keys()
    for n, want in said["want"].items():
        torch.testing.assert_close(said["got"][n], want, rtol=2e-4, atol=1e-6, msg=n)


def test_unsupported_sharding_is_refused_with_the_fix(tmp_path):
    results = _spawn(tmp_path, 2, "refusals")
    for rank in range(2):
        said = results[rank]
        assert "MixedPrecisionPolicy" in said["mixed"] and "autocast" in said["mixed"], said
        assert "noise='optimizer'" in said["graph_noise"], said
        assert "optimizer after sharding" in said["optimizer_first"], said
        assert "fully_shard on each" in said["grouped"], said
        assert said["untouched"] == "kinds ['DTensor']", said


# Note [Sharded blocks] in dpfx/loop/fsdp.py: each unit (fc1 and fc2; each decoder layer) is a
# block whose parameters are gathered only by its ops and whose clipped sums are
# reduce-scattered in the backward; the root unit (the Llama's embeddings, tied head and norm)
# goes through the step's reduce-scatter. Both must give the reference's gradients.
# Four ranks (two processes a core here, so slow) with the sum: each unit's shards are a quarter
# of its rows, and the Llama's tied head crosses the root unit and the embedding's.
@pytest.mark.parametrize("name,backend,world,reduction", [
    ("llama", "eager", 2, "mean"),
    pytest.param("llama", "inductor", 2, "mean", marks=pytest.mark.slow),
    pytest.param("lora", "inductor", 2, "mean", marks=pytest.mark.slow),
    pytest.param("mlp", "inductor", 4, "sum", marks=pytest.mark.slow),
    pytest.param("llama", "inductor", 4, "sum", marks=pytest.mark.slow)])
def test_sharded_blocks_equal_the_reference_on_the_union(tmp_path, name, backend, world,
                                                         reduction):
    if name != "mlp":
        pytest.importorskip("transformers")
    if name == "lora":
        pytest.importorskip("peft")
    results = _spawn(tmp_path, world, "train", name, world, reduction, 3, backend, "auto",
                     deadline=900)
    _check_exact(results, name, world, reduction, dict(rtol=1e-4, atol=1e-6))


def test_sharded_blocks_gather_each_unit_with_one_collective(tmp_path):
    """Each op of a block that is an FSDP unit (fc1, fc2: a weight and a bias each) gathers
    the unit with one all-gather, not one a parameter, and the gradients stay the reference's."""
    results = _spawn(tmp_path, 2, "gathers", "mlp", 2, "mean", 3, "eager", "auto")
    for rank in range(2):
        counts = results[rank][1]
        assert counts["ops"] > 0 and counts["gathers"] == counts["ops"], (rank, counts)
    _check_exact({r: results[r][0] for r in range(2)}, "mlp", 2, "mean",
                 dict(rtol=1e-4, atol=1e-6))
