"""DPTrainer over several processes (dpfx/hf/ranks.py, Note [DPTrainer over several processes]):
two gloo ranks spawned by the test, each a Trainer launched as torchrun would (RANK, WORLD_SIZE,
LOCAL_RANK in the environment).

At sigma 0, SGD at lr 1, one optimizer step changes the parameters by the DP-SGD gradient of the
union of the two ranks' batches, from a batch-of-one loop in this process (each example's token
sum, clipped with a bound that bites, summed, divided by the global expected batch size D =
q N): neither DDP's average (half of it) nor a sum of two ranks' divided sums. A replicated model
(ranks initialized differently: rank 0's parameters are broadcast) through Inductor; a model
sharded with ``fully_shard`` per block and at the root, eager; the sharded step's twin at sigma > 0
differs from it on each rank's shard by that rank's noise, std sigma C / D. With sigma > 0
every rank counts each global step once and logs the one-process epsilon for (q, sigma, steps),
and the ranks take the same steps. Unsupported launches are refused before the model changes.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import dpfx
from support import gloo_ranks
from support.noise_stats import assert_gaussian_scale, assert_uncorrelated, detectable_std_error
from support.reference import CLIP_EPS

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
hf = pytest.importorskip("dpfx.hf")

from test_trainer import _norm, _token_sum_grads, args, gpt2, lm_data  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed")

WORLD, N, PHYSICAL, ACCUMULATION = 2, 16, 2, 2
Q = PHYSICAL * ACCUMULATION * WORLD / N          # 0.5: D = q N = 8 examples a global step
TARGET, DELTA, NOISY_STEPS = 4.0, 1e-5, 2
SHARD_SIGMA = 1.0       # the sharded step's noisy twin


class _Recording(hf.DPTrainer):
    """Keeps each logical batch this rank stepped on."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        from dpfx.loss.track import untrack
        self.batches = getattr(self, "batches", []) + [
            {k: v.clone() for k, v in untrack(inputs).items()}]
        return super().training_step(model, inputs, num_items_in_batch)


def _launched_by_torchrun() -> int:
    """What torchrun puts in each worker's environment; accelerate reads it."""
    rank = dist.get_rank()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
    return rank


def _shard(model) -> None:
    from torch.distributed.fsdp import fully_shard
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)


def _full(model) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _local(model) -> dict:
    """This rank's shard of each parameter."""
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


# -- what each rank runs -----------------------------------------------------------------------
def _one_sgd_step(model, scenario: str, out: str, bound: float, sigma: float) -> _Recording:
    """One optimizer step at lr 1 on this rank's Poisson batch (one seeded sampler)."""
    trainer = _Recording(
        model=model, args=args(out, per_device_train_batch_size=PHYSICAL,
                               gradient_accumulation_steps=ACCUMULATION, max_steps=1, optim="sgd",
                               learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0,
                               warmup_steps=0),
        train_dataset=lm_data(N, seed=1), max_grad_norm=bound, noise_multiplier=sigma,
        sampler_generator=torch.Generator().manual_seed(3),
        dp_kwargs={} if scenario == "replicated" else {"backend": "eager"})
    trainer.train()
    return trainer


def _rank(scenario: str, out: str, bound: float):
    rank = _launched_by_torchrun()
    result = {}
    torch.manual_seed(rank if scenario == "replicated" else 0)    # rank 0's model is broadcast
    model = gpt2()
    if scenario == "sharded":
        _shard(model)
        result["refused"] = _refused_checkpoints(model, out)
    built = _full(model)
    trainer = _one_sgd_step(model, scenario, os.path.join(out, f"sgd{rank}"), bound, 0.0)
    result.update(built=built, after=_full(model), batches=trainer.batches,
                  sample_rate=trainer.sample_rate, expected=trainer.model.dp_config.expected_batch_size,
                  sharded=trainer.model._sharding is not None,
                  wrapped=type(trainer.model_wrapped).__name__)
    if scenario == "replicated":
        result["noisy"] = _noisy(out, rank)
    else:       # the per-rank checkpoint the refusal names
        result["noised"] = _noised_twin(out, rank, bound, _local(model), trainer.batches)
        dpfx.save_checkpoint(os.path.join(out, f"ckpt.rank{rank}.pt"), model=trainer.model,
                             optimizer=trainer.dp_optimizer)
        result["saved"] = dpfx.load_checkpoint(os.path.join(out, f"ckpt.rank{rank}.pt"),
                                               model=trainer.model,
                                               optimizer=trainer.dp_optimizer) == {}
    return result


def _noised_twin(out: str, rank: int, bound: float, clean: dict, batches: list) -> dict:
    """The sharded step again from the same model and batches at sigma SHARD_SIGMA: this rank's
    shard of the clean step's parameters minus the noisy one's is the noise it added, over D;
    and what its accountant counted."""
    torch.manual_seed(0)
    model = gpt2()
    _shard(model)
    trainer = _one_sgd_step(model, "sharded", os.path.join(out, f"noised{rank}"), bound,
                            SHARD_SIGMA)
    assert all(torch.equal(v, batches[0][k]) for k, v in trainer.batches[0].items())
    noisy = _local(model)
    return {"noise": {n: clean[n] - noisy[n] for n in clean}, "steps": trainer.accountant.steps,
            "epsilon": trainer.get_epsilon(), "delta": trainer.delta}


def _noisy(out: str, rank: int) -> dict:
    """NOISY_STEPS steps calibrated for TARGET, with a checkpoint: sigma, the count, epsilon and
    the parameters."""
    torch.manual_seed(0)
    model = gpt2()
    trainer = hf.DPTrainer(
        model=model, args=args(os.path.join(out, "noisy"), per_device_train_batch_size=PHYSICAL,
                               gradient_accumulation_steps=ACCUMULATION, max_steps=NOISY_STEPS,
                               save_strategy="steps", save_steps=NOISY_STEPS),
        train_dataset=lm_data(N, seed=1), target_epsilon=TARGET, target_delta=DELTA,
        max_grad_norm=1.0, dp_kwargs={"backend": "eager"})
    trainer.train()
    logged = [e["epsilon"] for e in trainer.state.log_history if "loss" in e]
    dist.barrier()          # rank 0 has written the checkpoint
    with open(os.path.join(out, "noisy", f"checkpoint-{NOISY_STEPS}", hf.ACCOUNTANT_FILE)) as f:
        saved = json.load(f)["steps"]
    return {"steps": trainer.accountant.steps, "epsilon": trainer.get_epsilon(), "saved": saved,
            "sigma": trainer.noise_multiplier, "logged": logged, "params": _full(model),
            "ledger_here": trainer.dp_optimizer.privacy_ledger is not None}


def _refused_checkpoints(model, out: str) -> str:
    """Trainer checkpoints of a sharded model are refused, the model left as it was."""
    kinds = {type(p).__name__ for p in model.parameters()}
    try:
        hf.DPTrainer(model=model, args=args(os.path.join(out, "refused"), save_strategy="steps"),
                     train_dataset=lm_data(N, seed=1), noise_multiplier=1.0)
    except ValueError as e:
        said = str(e)
    else:
        said = "not refused"
    assert {type(p).__name__ for p in model.parameters()} == kinds == {"DTensor"}
    assert all(p.grad is None for p in model.parameters())
    return said


def _spawn(tmp_path, scenario: str, bound: float) -> dict:
    results, errors = gloo_ranks.spawn(tmp_path, WORLD, _rank, scenario, str(tmp_path), bound,
                                       deadline=600)
    assert not errors, errors
    assert sorted(results) == list(range(WORLD))
    return results


# -- the reference -----------------------------------------------------------------------------
def _bound(model, data) -> float:
    """A clipping bound that bites on about half the examples."""
    batch = {k: torch.stack([row[k] for row in data]) for k in data[0]}
    norms = sorted(_norm(g) for g in _token_sum_grads(model, batch))
    return norms[len(norms) // 2]


def _check_one_step_is_the_reference(results, reference, bound):
    """The union of the ranks' batches, each rank's from its own partition; every rank's change
    of the parameters is the DP-SGD gradient of that union over D."""
    data = lm_data(N, seed=1)
    position = {tuple(row["input_ids"].tolist()): i for i, row in enumerate(data)}
    union, drawn = {}, {}
    for rank, result in results.items():
        assert result["sample_rate"] == Q and result["expected"] == round(Q * N)
        (batch,) = result["batches"]
        rows = [position[tuple(ids.tolist())] for ids in batch["input_ids"]]
        assert all(i % WORLD == rank for i in rows), (rank, rows)   # its own partition
        drawn[rank] = sorted(i // WORLD for i in rows)
        for k, v in batch.items():
            union[k] = torch.cat([union[k], v]) if k in union else v
    # one sampler_generator on both ranks, mixed with the rank: not the same mask twice
    assert drawn[0] != drawn[1], drawn
    n = union["input_ids"].shape[0]
    assert n >= 3, "the seeded samplers should draw a few examples"
    grads = _token_sum_grads(reference, union)
    factors = [min(1.0, bound / (_norm(g) + CLIP_EPS)) for g in grads]
    assert 0 < sum(f < 1.0 for f in factors) < n, "clipping should bite on some, not all"
    initial = dict(reference.named_parameters())
    want = {name: sum(g[j] * f for g, f in zip(grads, factors)) / round(Q * N)
            for j, name in enumerate(initial)}
    for rank, result in results.items():
        for name, p in initial.items():
            torch.testing.assert_close(p.detach() - result["after"][name], want[name],
                                       rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    torch.manual_seed(0)
    reference = gpt2()
    bound = _bound(reference, lm_data(N, seed=1))
    return _spawn(tmp_path_factory.mktemp("replicated"), "replicated", bound), reference, bound


def test_replicated_step_is_the_clipped_reference_over_both_ranks(replicated):
    """Two ranks, per-device batch 2 x 2 accumulation steps: q = 8 / 16. Rank 1 built its model
    from another seed and trains rank 0's; the step is dpfx's all-reduce of the clipped sums,
    through Inductor, with the model never wrapped in DDP."""
    results, reference, bound = replicated
    assert all(r["wrapped"] != "DistributedDataParallel" and not r["sharded"]
               for r in results.values())
    assert not torch.equal(results[0]["built"]["transformer.wte.weight"],
                           results[1]["built"]["transformer.wte.weight"])      # built apart
    _check_one_step_is_the_reference(results, reference, bound)


def test_epsilon_counts_each_global_step_once(replicated):
    """NOISY_STEPS steps calibrated for target_epsilon: every rank calibrates the same sigma,
    its accountant holds NOISY_STEPS steps (not one per rank), its epsilon and every logged one
    are dpfx.privacy's for (q, sigma, steps) as in one process, the ranks hold the same
    parameters (one noise, all-reduced), and only rank 0 keeps the privacy ledger; the
    checkpoint's accountant file counts NOISY_STEPS."""
    results, _, _ = replicated
    noisy = {rank: r["noisy"] for rank, r in results.items()}
    sigma = dpfx.privacy.noise_multiplier(target_epsilon=TARGET, target_delta=DELTA,
                                          sample_rate=Q, steps=NOISY_STEPS)
    for rank, r in noisy.items():
        assert r["sigma"] == sigma, rank
        assert r["steps"] == NOISY_STEPS, rank
        want = [dpfx.privacy.epsilon(noise_multiplier=sigma, sample_rate=Q, steps=k,
                                     delta=DELTA) for k in range(1, NOISY_STEPS + 1)]
        assert r["epsilon"] == pytest.approx(want[-1]) and want[-1] <= TARGET
        assert r["logged"] == pytest.approx(want)
        assert r["ledger_here"] == (rank == 0)
        assert r["saved"] == NOISY_STEPS
    for name, p in noisy[0]["params"].items():
        assert torch.equal(p, noisy[1]["params"][name]), name


def test_sharded_step_is_the_clipped_reference_over_both_ranks(tmp_path):
    """GPT-2 sharded with fully_shard per block and at the root before DPTrainer: dpfx's sharded
    step (reduce-scatter, each rank noises its shard) equals the reference at sigma 0, and its
    twin at sigma > 0 differs from it on every rank's shard by noise of std sigma C / D (not 0:
    a shard left unnoised; not sqrt(2) times that), each rank counting the one step; Trainer checkpoints of the sharded model are
    refused first, naming per-rank dpfx.save_checkpoint, and that per-rank checkpoint of the
    trainer's model and optimizer saves and loads."""
    torch.manual_seed(0)
    reference = gpt2()
    bound = _bound(reference, lm_data(N, seed=1))
    results = _spawn(tmp_path, "sharded", bound)
    for r in results.values():
        assert r["sharded"] and r["saved"]
        assert "save each rank's own shards with dpfx.save_checkpoint" in r["refused"], r["refused"]
    _check_one_step_is_the_reference(results, reference, bound)
    std = SHARD_SIGMA * bound / round(Q * N)
    for rank, r in results.items():
        noise = r["noised"]["noise"]
        assert r["noised"]["steps"] == 1, (rank, r["noised"]["steps"])   # one global step
        assert r["noised"]["epsilon"] == pytest.approx(dpfx.privacy.epsilon(
            noise_multiplier=SHARD_SIGMA, sample_rate=Q, steps=1, delta=r["noised"]["delta"]))
        assert_gaussian_scale(torch.cat([d.flatten() for d in noise.values()]), std,
                              f"rank {rank}'s shard of the noisy step")
        for name, d in noise.items():       # each parameter whose shard resolves sqrt(2)
            if detectable_std_error(d.numel()) < 2 ** 0.5 - 1:
                assert_gaussian_scale(d, std, f"rank {rank}'s shard of {name}")
    w = "transformer.h.0.mlp.c_fc.weight"       # rows 0-7 on rank 0, 8-15 on rank 1
    assert_uncorrelated(results[0]["noised"]["noise"][w], results[1]["noised"]["noise"][w],
                        "the two ranks' shards of " + w)


# -- refusals ----------------------------------------------------------------------------------
def _untouched(model, state):
    return all(torch.equal(v, model.state_dict()[k]) for k, v in state.items()) \
        and all(p.grad is None for p in model.parameters()) \
        and not model.is_activation_checkpointing


@pytest.mark.parametrize("launch, said", [
    ({"fsdp": "full_shard"}, "Shard the model yourself with torch.distributed.fsdp.fully_shard"),
    ({"env": "ACCELERATE_USE_FSDP"}, "Shard the model yourself with torch.distributed.fsdp"),
    ({"env": "ACCELERATE_USE_DEEPSPEED"}, "does not run under DeepSpeed"),
])
def test_unsupported_launches_are_refused_before_the_model_changes(tmp_path, monkeypatch,
                                                                   launch, said):
    model = gpt2()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    training = args(tmp_path, activation_checkpointing=True, **{
        k: v for k, v in launch.items() if k != "env"})
    if "env" in launch:
        monkeypatch.setenv(launch["env"], "true")
    with pytest.raises(ValueError, match=said):
        hf.DPTrainer(model=model, args=training, train_dataset=lm_data(N), noise_multiplier=1.0)
    assert _untouched(model, state)


UNSUPPORTED_BACKEND = textwrap.dedent("""
    import os, torch, torch.distributed as dist, transformers
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import dpfx.hf
    os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=37, n_positions=16))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    data = [{"input_ids": torch.arange(1, 9), "labels": torch.arange(1, 9)}] * 16
    args = transformers.TrainingArguments(output_dir=os.environ["OUT"], use_cpu=True,
                                          report_to=[], save_strategy="no")
    try:
        dpfx.hf.DPTrainer(model=model, args=args, train_dataset=data, noise_multiplier=1.0)
    except ValueError as e:
        print("refused:", e)
    assert args.world_size == 2
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
""")


def test_a_process_group_over_another_backend_is_refused(tmp_path):
    """A process group dpfx's collectives were not written for (here torch's fake backend, two
    ranks in one process) is refused with the backends it takes, the model untouched."""
    proc = subprocess.run([sys.executable, "-c", UNSUPPORTED_BACKEND], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: the process group's backend is 'fake'" in proc.stdout, proc.stdout
    assert "over gloo or nccl" in proc.stdout
