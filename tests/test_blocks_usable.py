"""A model compiled with blocks stays the user's model (Note [Only dpfx's own forward calls a
compiled block] in dpfx/blocks/call.py): after a private step equal to the batch-of-one loop, the
original module's forward and a plain public step equal those of a copy never compiled,
``generate()`` (with its key/value cache) returns the copy's tokens, and a second
``dpfx.compile`` of the same model trains exactly. A layer shared across depth (ALBERT) is
refused before anything is touched (Note [A block used more than once is refused])."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from dpfx.blocks import BlockCall
from support.reference import (assert_close, loop_dp_sgd_grads, loop_example_grads,
                               per_example_norms, run_dpfx_multi)

transformers = pytest.importorskip("transformers")

VOCAB, T = 13, 4


def _loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")


class LM(nn.Module):
    """A Hugging Face causal LM called as users train it (a fresh cache each forward)."""

    def __init__(self, hf):
        super().__init__()
        self.model = hf

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).logits


def _lm(arch: str) -> LM:
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if arch == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=8, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, **common)
        build = transformers.GPT2LMHeadModel
    else:
        config = transformers.Qwen2Config(
            hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16, **common)
        build = transformers.Qwen2ForCausalLM
    config._attn_implementation = "sdpa"
    return LM(build(config))


def _batch(b: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + b)
    ids = torch.randint(1, VOCAB, (b, T), generator=g)
    return (ids, torch.ones(b, T, dtype=torch.long)), torch.randint(0, VOCAB, (b, T), generator=g)


def _private_step_is_exact(dp, model, reference, b=3, seed=0):
    inputs, y = _batch(b, seed)
    norms = per_example_norms(loop_example_grads(reference, _loss, inputs, y))
    assert bool((norms > 0.05).all()), norms        # clipping bites on every example
    got = run_dpfx_multi(dp, model, _loss, inputs, y, "sum")
    want = loop_dp_sgd_grads(reference, _loss, inputs, y, max_grad_norm=0.05,
                             loss_reduction="sum")
    assert_close(got, want, rtol=2e-4, atol=1e-6)


def _same_module_forward_and_public_step(model, plain):
    """The original module: outputs and a plain public step's gradients equal the copy's."""
    inputs, y = _batch(2, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(model(*inputs), plain(*inputs))
    grads = []
    for m in (model, plain):
        m.zero_grad(set_to_none=True)
        with dpfx.public(m):
            _loss(m(*inputs), y).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        m.zero_grad(set_to_none=True)
    assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def _same_generation(model, plain):
    """``generate()`` with its key/value cache, greedy: the copy's tokens."""
    prompt = torch.randint(1, VOCAB, (2, 3), generator=torch.Generator().manual_seed(5))
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                  pad_token_id=0)
    got = model.model.generate(prompt, **kwargs)
    want = plain.model.generate(prompt, **kwargs)
    assert got.shape == (2, 6)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("arch,backend", [("gpt2", "inductor"), ("qwen2", "eager")])
def test_the_model_stays_usable_after_blocks(arch, backend):
    """blocks="auto": a private step equals the batch-of-one loop (Inductor, self-check on, for
    GPT-2); then the original module, a public step and generate() run as on a copy never
    compiled, a second dpfx.compile of the same model trains exactly, and the first one still
    does (its blocks took their compiled path: one block op per layer in its graph)."""
    torch.manual_seed(0)
    model = _lm(arch)
    plain, reference = copy.deepcopy(model), copy.deepcopy(model)
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, loss_reduction="sum",
                      blocks="auto", backend=backend)
    _private_step_is_exact(dp, model, reference)
    assert len(dp._blocks) == 2 and all(isinstance(b.forward, BlockCall) for b in dp._blocks)
    assert dp._dpfx_backend.stages.graphs["forward"].count("dpfx.block_fwd(") == 2

    _same_module_forward_and_public_step(model, plain)
    _same_generation(model, plain)
    inputs, y = _batch(2)
    with pytest.warns(dpfx.PlainGradientWarning):    # a plain step outside dpfx.public
        _loss(model(*inputs), y).backward()
    model.zero_grad(set_to_none=True)

    again = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, loss_reduction="sum",
                         blocks=False, backend="eager")
    _private_step_is_exact(again, model, reference, b=2, seed=1)
    assert "dpfx.block_fwd(" not in again._dpfx_backend.stages.graphs["forward"]
    _private_step_is_exact(dp, model, reference, b=2, seed=2)
    assert dp.compile_count == 2, "the other compile's calls did not recompile this one"
    _same_generation(model, plain)


@pytest.mark.slow
def test_two_compiles_with_blocks_each_take_their_own():
    """A second blocks="auto" compile of the same model installs its blocks over the first's:
    each model's private forward takes its own compiled blocks (a chain), both train exactly,
    and the original module still runs as the copy."""
    torch.manual_seed(0)
    model = _lm("gpt2")
    plain, reference = copy.deepcopy(model), copy.deepcopy(model)
    first = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, loss_reduction="sum",
                         blocks="auto", backend="eager")
    _private_step_is_exact(first, model, reference)
    second = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, loss_reduction="sum",
                          blocks="auto", backend="eager")
    _private_step_is_exact(second, model, reference, b=2, seed=1)
    for block in second._blocks:
        assert block.forward.owner == second._private_forward.token
        assert block.forward.replaced.owner == first._private_forward.token
    _private_step_is_exact(first, model, reference, b=2, seed=2)
    for dp in (first, second):
        assert dp._dpfx_backend.stages.graphs["forward"].count("dpfx.block_fwd(") == 2
    _same_module_forward_and_public_step(model, plain)


def _albert():
    config = transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=8, hidden_size=16, num_hidden_layers=3,
        num_attention_heads=2, intermediate_size=24, max_position_embeddings=8,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)

    class MLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = transformers.AlbertForMaskedLM(config)

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask).logits

    return MLM()


def test_a_layer_shared_across_depth_is_refused_with_the_fix():
    """ALBERT's one layer group runs at every depth: blocks="auto" refuses it at the first call,
    naming the block and blocks=False, with the model untouched; compiled without blocks, the
    same model trains exactly (the shared layer's gradient summed over its uses, clipped)."""
    from dpfx.errors import CaptureError

    torch.manual_seed(0)
    model = _albert()
    reference = copy.deepcopy(model)
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, loss_reduction="sum",
                      blocks="auto", backend="eager")
    inputs, y = _batch(3)
    with pytest.raises(CaptureError, match=r"albert_layer_groups\.0 \(AlbertLayerGroup\) is "
                                           r"called 3 times.*blocks=False"):
        dp(*inputs)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(*inputs), reference(*inputs))
    one_graph = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0,
                             loss_reduction="sum", blocks=False, backend="eager")
    _private_step_is_exact(one_graph, model, reference)


# The architectures whose original module failed after blocks="auto". By default each runs
# once: through Inductor (self-check on) the two whose blocks differ most, a Llama-style decoder
# layer (Qwen2: grouped-query attention, rotary positions, q/k/v biases) and Whisper's encoder
# and decoder layers (cross-attention, two kinds of block in one model); the others on the eager
# backend (the rewrite, the block ops and their install are the backend's input). The rest of
# the Inductor sweep is slow (`make test-all`).
USABLE_ZOO = ["qwen2", "mistral", "phi3", "gemma", "gpt_neox", "whisper"]
INDUCTOR_BY_DEFAULT = {"qwen2", "whisper"}


@pytest.mark.parametrize("name,backend", [
    *[(n, "inductor") for n in USABLE_ZOO if n in INDUCTOR_BY_DEFAULT],
    *[(n, "eager") for n in USABLE_ZOO if n not in INDUCTOR_BY_DEFAULT],
    *[pytest.param(n, "inductor", marks=pytest.mark.slow)
      for n in USABLE_ZOO if n not in INDUCTOR_BY_DEFAULT]])
def test_zoo_models_stay_usable_after_blocks(name, backend):
    """A zoo model (tests/hf/test_hf_zoo.py) through blocks="auto": a private step equals its
    batch-of-one reference (clipping bites on every example) with every block on its compiled
    path (one block op per block in the model's graph); then the model called as users call it
    (with its key/value cache) and ``generate()`` equal a copy never compiled, and the private
    step is still exact after them."""
    from hf.test_hf_zoo import C, TOL, ZOO, reference, run

    case = ZOO[name]
    torch.manual_seed(0)
    model = case.build().train()
    plain = copy.deepcopy(model)
    kw, y = case.inputs(3, torch.Generator().manual_seed(1))
    want, norms = reference(model, case, kw, y, C)
    assert min(norms) > C, norms
    tol = (case.tol or TOL) if backend == "inductor" else TOL
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=0.0, blocks="auto",
                      backend=backend)
    assert_close(run(dp, model, case, kw, y), want, **tol)
    assert dp._blocks and all(isinstance(b.forward, BlockCall) for b in dp._blocks)
    assert dp._dpfx_backend.stages.graphs["forward"].count("dpfx.block_fwd(") == len(dp._blocks)

    with torch.no_grad():
        torch.testing.assert_close(model(**kw).logits, plain(**kw).logits)
    if name == "whisper":
        prompt = {"input_features": kw["input_features"]}
    else:
        prompt = {"input_ids": kw["input_ids"][:, :3],
                  "attention_mask": torch.ones(3, 3, dtype=torch.long)}
    generated = [m.generate(**prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
                 for m in (model, plain)]
    assert generated[0].shape[1] >= 3
    torch.testing.assert_close(generated[0], generated[1])
    assert_close(run(dp, model, case, kw, y), want, **tol)
