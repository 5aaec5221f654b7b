"""Per-block private graphs (dpfx/blocks.py, passes/block.py, rules/block.py, ops/blocks.py):
one compiled block shared by identical blocks, its parameters clipped by the whole model's
factor, against torch.func and the batch-of-one loop."""
import copy
import gc
import math
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.func import functional_call, grad, vmap

import dpfx
from dpfx.blocks import compile_block, install, uninstall
from dpfx.config import DPConfig
from dpfx.ops import blocks as ops_blocks
from dpfx.ops.blocks import graph_operands, graph_reads, kernels, operands
from support.reference import (assert_close, loop_dp_sgd_grads, loop_example_grads,
                                     per_example_norms, run_dpfx_multi)


class Block(nn.Module):
    """A pre-norm residual block with attention over the sequence and an MLP."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5).softmax(-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(torch.tanh(self.fc1(self.ln2(x))))


class Net(nn.Module):
    def __init__(self, layers=3, vocab=11, d=8, tied=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


def _token_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")


def _with_blocks(net, backend, batch=2, seq=5):
    """Every block of ``net`` calling one compiled block (captured on the first)."""
    torch.manual_seed(1)
    h = torch.randn(batch, seq, net.emb.embedding_dim)
    out = pytree.tree_flatten(net.blocks[0](h))
    config = DPConfig(max_grad_norm=1.0, noise_multiplier=0.0, backend=backend)
    key = compile_block(net.blocks[0], (h,), {}, {0}, config)
    for b in net.blocks:
        install(b, key, out, [h])
    return key


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_block_ops_against_vmap(backend):
    """The block's ops alone: its forward, each parameter's squared per-sample norms, the
    clipped sums for given coefficients and masks, and the plain gradients, at batch sizes 3, 0,
    1 and 5 (5 is the sequence length)."""
    torch.manual_seed(0)
    block = Block()
    config = DPConfig(max_grad_norm=1.0, noise_multiplier=0.0, backend=backend)
    key = compile_block(block, (torch.randn(2, 5, 8),), {}, {0}, config)
    k = kernels(key)
    names = [n for n, _ in block.named_parameters()]
    params = [p.detach() for _, p in block.named_parameters()]
    assert k.params == names
    tol = {"rtol": 1e-4, "atol": 1e-5}
    for b in (3, 0, 1, 5):
        x, g = torch.randn(b, 5, 8), torch.randn(b, 5, 8)
        outs = torch.ops.dpfx.block_fwd(key, [x] + params)
        torch.testing.assert_close(outs[0], block(x), **tol)

        def term(ps, xi, gi):
            return (functional_call(block, dict(zip(names, ps)), (xi[None],))[0] * gi).sum()

        per_example = vmap(grad(term), in_dims=(None, 0, 0))(params, x, g)
        assert len(outs) == k.num_outputs + 1     # the saved activations' handle
        reads = [outs[k.num_outputs]] + [[x, *params][i] if kind == "arg" else g for kind, i in
                                         (k.backward_reads[n] for n in graph_reads(k))]
        bwd = torch.ops.dpfx.block_bwd(key, reads)
        assert len(bwd) == k.norms + 2            # the held operands' handle
        want = torch.stack([p.flatten(1).pow(2).sum(1) for p in per_example])
        torch.testing.assert_close(bwd[k.norms], want, **tol)
        coefs = [torch.rand(b) for _ in params]
        keeps = [torch.rand(b) > 0.3 for _ in params]
        ops = [bwd[n] if kind == "out" else reads[n] for kind, n in graph_operands(k)]
        clipped = torch.ops.dpfx.block_clip(key, coefs, keeps, ops)
        for j, p in enumerate(per_example):
            w = (coefs[j] * keeps[j]).view(-1, *[1] * (p.dim() - 1))
            torch.testing.assert_close(clipped[j], (w * p).sum(0), **tol)
        # autograd through the op: the block's own gradients
        xr, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        got = torch.autograd.grad((torch.ops.dpfx.block_fwd(key, [xr] + [
            p.requires_grad_() for p in params])[0] * g).sum(), [xr] + params)
        want = torch.autograd.grad((functional_call(block, dict(zip(names, params)), (xe,))
                                    * g).sum(), [xe] + params)
        for a, w in zip(got, want):
            torch.testing.assert_close(a, w, **tol)
        for p in params:
            p.requires_grad_(False)


@pytest.mark.filterwarnings("ignore::dpfx.LossScaleWarning")  # the loss's scale changed: expected
@pytest.mark.parametrize("backend,reduction,tied", [
    ("eager", "sum", False), ("eager", "mean", True), ("inductor", "mean", False),
    ("inductor", "sum", True)])
def test_model_of_blocks_against_the_loop(backend, reduction, tied):
    """dpfx.compile over a model whose three blocks call one compiled block: sigma 0 against
    the batch-of-one loop, clipping biting on every example, batch sizes 3, 0, 1 and 5 (the
    sequence length) through one compiled pair, self-check on under Inductor; the tied
    embedding and head stay in the model's own graph."""
    torch.manual_seed(0)
    net = Net(tied=tied)
    reference = copy.deepcopy(net)
    _with_blocks(net, backend)
    dp = dpfx.compile(net, max_grad_norm=0.05, noise_multiplier=0.0, loss_reduction=reduction,
                      expected_batch_size=4 if reduction == "mean" else None, backend=backend)

    def make(b):
        g = torch.Generator().manual_seed(b)
        return (torch.randint(0, 11, (b, 5), generator=g),), torch.randint(0, 11, (b, 5),
                                                                           generator=g)

    for b in (3, 0, 1, 5):
        inputs, y = make(b)
        if b:
            norms = per_example_norms(loop_example_grads(reference, _token_loss, inputs, y))
            assert bool((norms > 0.05).all()), norms
        got = run_dpfx_multi(dp, net, _token_loss, inputs, y, reduction)
        want = loop_dp_sgd_grads(reference, _token_loss, inputs, y, max_grad_norm=0.05,
                                 loss_reduction="sum")
        if reduction == "mean":
            want = {k: v / 4 for k, v in want.items()}
        assert_close(got, want, rtol=2e-4, atol=1e-6)
        # the saved activations and operands the ops held are freed with the step's graphs
        gc.collect()
        assert not ops_blocks._HELD, f"{len(ops_blocks._HELD)} handles outlived the step"
    assert dp.compile_count == 2, "one compiled pair serves every batch size"
    if backend == "inductor":
        checks = list(dp._dpfx_backend._checks.values())
        assert checks and all(c.done and c.backward is not None for c in checks)
    for b in net.blocks:
        uninstall(b)


def test_a_handle_holds_its_tensors_while_it_lives():
    """Note [A block's own tensors stay out of the model's graph] (ops/blocks.py): block_fwd
    returns one handle after its outputs, whose entry holds the block's saved activations
    until the handle is freed; a copy of a handle is refused, not read as another entry."""
    torch.manual_seed(0)
    block = Block()
    config = DPConfig(max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    key = compile_block(block, (torch.randn(2, 5, 8),), {}, {0}, config)
    k = kernels(key)
    params = [p.detach() for p in block.parameters()]
    gc.collect()
    before = len(ops_blocks._HELD)
    x = torch.randn(3, 5, 8)
    outs = torch.ops.dpfx.block_fwd(key, [x] + params)
    handle = outs[k.num_outputs]
    assert handle.dtype == torch.int64 and handle.shape == (1,) and int(handle) == 0
    assert len(ops_blocks._HELD) == before + 1
    saved = ops_blocks._held(handle)
    assert saved and all(isinstance(t, torch.Tensor) for t in saved)
    reads = [[x, *params][i] if kind == "arg" else torch.randn(3, 5, 8) for kind, i in
             (k.backward_reads[n] for n in graph_reads(k))]
    with pytest.raises(RuntimeError, match="not a block op's own"):
        torch.ops.dpfx.block_bwd(key, [handle.clone()] + reads)
    bwd = torch.ops.dpfx.block_bwd(key, [handle] + reads)
    assert len(ops_blocks._HELD) == before + 2
    del outs, handle, saved, bwd
    gc.collect()
    assert len(ops_blocks._HELD) == before


def test_identical_blocks_share_one_capture():
    """Three blocks, one key: the root graph calls dpfx::block_fwd three times, and no block's
    layers are in it."""
    torch.manual_seed(0)
    net = Net()
    key = _with_blocks(net, "eager")
    dp = dpfx.compile(net, max_grad_norm=1.0, noise_multiplier=0.0, loss_reduction="sum",
                      backend="eager")
    ids = torch.randint(0, 11, (2, 5))
    _token_loss(dp(ids), ids).backward()
    forward = dp._dpfx_backend.stages.graphs["forward"]
    assert forward.count("dpfx.block_fwd(") == 3, forward
    assert forward.count("aten.addmm") + forward.count("aten.mm") == 1, forward   # the head
    assert {b.forward.key for b in net.blocks} == {key}
    assert all(p.grad is not None for p in net.parameters())


def _hf_lm(arch: str, layers: int = 3, t: int = 4, vocab: int = 13):
    """A Hugging Face causal LM from a config (GPT-2: tied head, learned positions; Llama:
    rotary tables shared by the examples, grouped-query attention), called with an attention
    mask, and ``make(b)``."""
    transformers = pytest.importorskip("transformers")
    if arch == "gpt2":
        config = transformers.GPT2Config(
            n_layer=layers, n_head=2, n_embd=8, vocab_size=vocab, n_positions=t,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        build = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(
            hidden_size=16, intermediate_size=24, num_hidden_layers=layers,
            num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab,
            max_position_embeddings=2 * t, bos_token_id=0, eos_token_id=0)
        build = transformers.LlamaForCausalLM
    config._attn_implementation = "sdpa"

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = build(config)

        def forward(self, ids, mask):
            # GPT-2 as users call it (a fresh key/value cache each forward: Note [An empty
            # cache is no argument]); Llama without one
            extra = {} if arch == "gpt2" else {"use_cache": False}
            return self.model(input_ids=ids, attention_mask=mask, **extra).logits

    def make(b):
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(1, vocab, (b, t), generator=g)
        return (ids, torch.ones(b, t, dtype=torch.long)), torch.randint(0, vocab, (b, t),
                                                                         generator=g)
    return LM(), make


@pytest.mark.parametrize("arch,backend", [("gpt2", "eager"), ("gpt2", "inductor"),
                                          ("llama", "eager"), ("llama", "inductor")])
def test_hf_blocks(arch, backend):
    """A three-layer Hugging Face LM with blocks="auto": its decoder layers share one compiled
    block, and dpfx (through Inductor with the self-check on, or eager) equals the batch-of-one
    loop over the model without blocks, at batch sizes 3, 0, 1 and 4 (the sequence length),
    clipping biting on every example."""
    from dpfx.ops.blocks import KERNELS

    torch.manual_seed(0)
    model, make = _hf_lm(arch)
    reference = copy.deepcopy(model)
    before = set(KERNELS)
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, loss_reduction="sum",
                      blocks="auto", backend=backend)
    for b in (3, 0, 1, 4):
        inputs, y = make(b)
        if b:
            norms = per_example_norms(loop_example_grads(reference, _token_loss, inputs, y))
            assert bool((norms > 0.05).all()), norms
        got = run_dpfx_multi(dp, model, _token_loss, inputs, y, "sum")
        want = loop_dp_sgd_grads(reference, _token_loss, inputs, y, max_grad_norm=0.05,
                                 loss_reduction="sum")
        assert_close(got, want, rtol=2e-4, atol=1e-6)
    assert len(dp._blocks) == 3 and len({b.forward.key for b in dp._blocks}) == 1, \
        "three identical layers, one compiled block"
    assert set(KERNELS) - before <= {dp._blocks[0].forward.key}
    assert dp.compile_count == 2
    if backend == "inductor":
        checks = list(dp._dpfx_backend._checks.values())
        assert checks and all(c.done and c.backward is not None for c in checks)


def test_verifier_refuses_a_planted_block_clip():
    """The model graph's proof of a block's clipped sums (Note [A block's clipped sums]): a
    coefficient that is not the clip factor's, a mask that is not its finite mask, or the
    operands of another block call (whose examples' terms would then be released twice) are
    each refused."""
    from dpfx.errors import PrivacyError
    from dpfx.passes.verify import verify_backward

    torch.manual_seed(0)
    net = Net()
    _with_blocks(net, "eager")
    dp = dpfx.compile(net, max_grad_norm=1.0, noise_multiplier=0.0, loss_reduction="sum",
                      backend="eager")
    ids = torch.randint(0, 11, (2, 5))
    _token_loss(dp(ids), ids).backward()
    result = dp._dpfx_backend.last_backward
    gm = result.gm
    grads = {name: result.private[name] for name in result.private}
    verify_backward(gm, result.analysis.rerun(gm.graph), grads, dp.dp_config)   # as compiled
    calls = list(gm.graph.find_nodes(op="call_function", target=torch.ops.dpfx.block_clip.default))
    assert len(calls) == 3
    key, coefs, keeps, operands = calls[0].args
    with gm.graph.inserting_before(calls[0]):
        ones = gm.graph.call_function(torch.ops.aten.ones_like.default, (coefs[0],))
    ones.meta["val"] = coefs[0].meta["val"]
    plants = {"not scaled by a clip factor": ([ones] + list(coefs[1:]), keeps, operands),
              "finite-example mask": (coefs, [coefs[0]] + list(keeps[1:]), operands),
              "both release parameter": (coefs, keeps, list(calls[1].args[3]))}
    for refusal, (c, k, o) in plants.items():
        calls[0].args = (key, c, k, o)
        with pytest.raises(PrivacyError, match=refusal):
            verify_backward(gm, result.analysis.rerun(gm.graph), grads, dp.dp_config)
    for b in net.blocks:
        uninstall(b)


def test_refusals_leave_the_model_as_it_was():
    """A bad blocks= option fails at compile; a model graph refused after its blocks were
    compiled puts the blocks' forward back."""
    from dpfx.errors import OptionError, PrivacyError

    torch.manual_seed(0)
    with pytest.raises(OptionError, match="found no repeated block"):
        dpfx.compile(nn.Sequential(nn.Linear(3, 3)), max_grad_norm=1.0, noise_multiplier=0.0,
                     blocks="auto")
    with pytest.raises(OptionError, match="no module named"):
        dpfx.compile(Net(), max_grad_norm=1.0, noise_multiplier=0.0, blocks=["blocks.9"])

    class Mixing(Net):
        def forward(self, ids):
            out = super().forward(ids)
            return out - out.mean(0)     # couples the examples: refused by the forward check

    net = Mixing()
    dp = dpfx.compile(net, max_grad_norm=1.0, noise_multiplier=0.0, loss_reduction="sum",
                      backend="eager", blocks=[Block])
    ids = torch.randint(0, 11, (2, 5))
    with pytest.raises(PrivacyError, match="mixes examples"):
        dp(ids)
    assert all("forward" not in b.__dict__ for b in net.blocks)
    assert dp._blocks_pending == [Block] and dp._blocks == []


def test_block_self_check_refuses_a_planted_miscompile(monkeypatch):
    """A block's compiled forward that mixes examples (each row plus the batch's mean) is
    refused when the block is compiled (Note [A block's self-check])."""
    import dpfx.blocks.capture as blocks
    from dpfx.errors import PrivacyError

    lower = blocks.lower

    def planted(gm, inputs, kwargs, backend):
        compiled = lower(gm, inputs, kwargs, backend)
        if kwargs.get("is_backward"):
            return compiled

        def mixing(args):
            outs = list(compiled(args))
            outs[0] = outs[0] + outs[0].mean(0, keepdim=True)
            return outs

        mixing._boxed_call = True
        return mixing

    monkeypatch.setattr(blocks, "lower", planted)
    torch.manual_seed(0)
    config = DPConfig(max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(PrivacyError, match="self-check"):
        compile_block(Block(), (torch.randn(2, 5, 8),), {}, {0}, config)


def test_block_proof_refuses_a_clipped_sum_not_scaled_by_its_coefficient(monkeypatch):
    """The block's own proof (verify_block, passes/verify/block.py): a parameter's clipped sum
    scaled by anything but its coefficient input is refused when the block is compiled."""
    import dpfx.passes.block as block_pass
    from dpfx.errors import PrivacyError
    from dpfx.rules import Clip

    original = block_pass.clipped_sum
    calls = []

    def planted(pg, clip, emit, moved=True):
        calls.append(pg.name)
        if len(calls) == 1:
            clip = Clip(emit(torch.ops.aten.ones_like.default, clip.coef), clip.keep)
        return original(pg, clip, emit, moved)

    monkeypatch.setattr(block_pass, "clipped_sum", planted)
    config = DPConfig(max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    with pytest.raises(PrivacyError, match="not scaled by block parameter 0's coefficient"):
        compile_block(Block(), (torch.randn(2, 5, 8),), {}, {0}, config)
    assert calls


def test_adaptive_clipping_through_blocks():
    """clipping="adaptive" with blocks: each step's release equals the batch-of-one loop
    clipped at that step's bound C_t, and the bound moves as Andrew et al.'s update gives from
    the count of norms (blocks' rows included) at most C_t; through Inductor, self-check on."""
    torch.manual_seed(0)
    net = Net()
    reference = copy.deepcopy(net)

    def make(b):
        g = torch.Generator().manual_seed(b)
        return (torch.randint(0, 11, (b, 5), generator=g),), torch.randint(0, 11, (b, 5),
                                                                           generator=g)

    # C_0 between the first batch's two smallest norms: clipping bites on two examples of three
    first = per_example_norms(loop_example_grads(reference, _token_loss, *make(3))).sort().values
    c0, eta, quantile = float(first[:2].mean()), 0.5, 0.5
    dp = dpfx.compile(net, max_grad_norm=c0, noise_multiplier=0.0, loss_reduction="sum",
                      clipping="adaptive", target_unclipped_quantile=quantile, clip_lr=eta,
                      blocks="auto")
    bound = c0
    for b in (3, 5):
        inputs, y = make(b)
        norms = per_example_norms(loop_example_grads(reference, _token_loss, inputs, y))
        # a norm at the bound would be counted by float rounding, not by the rule
        assert float(((norms - bound).abs() / bound).min()) > 1e-3, (norms, bound)
        got = run_dpfx_multi(dp, net, _token_loss, inputs, y, "sum")
        want = loop_dp_sgd_grads(reference, _token_loss, inputs, y, max_grad_norm=bound,
                                 loss_reduction="sum")
        assert_close(got, want, rtol=2e-4, atol=1e-6)
        count = float(((norms <= bound).float() - 0.5).sum())
        bound *= math.exp(-eta * (count / b + 0.5 - quantile))
        assert dp.adaptive_clip.bound == pytest.approx(bound, rel=1e-6)
    assert bool((first > c0).any()) and bool((first <= c0).any())
    assert dp._blocks
    for blk in net.blocks:
        uninstall(blk)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_clipping_groups_that_split_blocks(backend):
    """Per-layer clipping whose groups split some blocks (Note [One norm row per clipping
    group]): a block's parameters in one group share one norm row, and two blocks share a
    compiled block only if their parameters are grouped alike. Against the batch-of-one loop
    clipped per group, clipping biting, batch sizes 3, 0, 1 and 5; Inductor with the
    self-check on."""
    torch.manual_seed(0)
    net = Net()
    reference = copy.deepcopy(net)
    # block 0: one group of its own; block 1: three groups (qkv, fc1, the rest with the model);
    # block 2: the model's group. Blocks 0 and 2 are grouped alike (one row), block 1 is not.
    bounds = {"": 0.05, "blocks.0": 0.03, "blocks.1.qkv": 0.02, "blocks.1.fc1": 0.04}
    dp = dpfx.compile(net, max_grad_norm=bounds, noise_multiplier=0.0, loss_reduction="sum",
                      blocks="auto", backend=backend)

    def make(b):
        g = torch.Generator().manual_seed(b)
        return (torch.randint(0, 11, (b, 5), generator=g),), torch.randint(0, 11, (b, 5),
                                                                           generator=g)

    for b in (3, 0, 1, 5):
        inputs, y = make(b)
        if b == 3:
            grads = loop_example_grads(reference, _token_loss, inputs, y)
            for key, bound in bounds.items():
                members = {k: v for k, v in grads.items()
                           if max((p for p in bounds if p == "" or k.startswith(p + ".")),
                                  key=len) == key}
                assert bool((per_example_norms(members) > bound).all()), key
        got = run_dpfx_multi(dp, net, _token_loss, inputs, y, "sum")
        want = loop_dp_sgd_grads(reference, _token_loss, inputs, y, max_grad_norm=bounds,
                                 loss_reduction="sum")
        assert_close(got, want, rtol=2e-4, atol=1e-6)
    keys = [b.forward.key for b in net.blocks]
    assert keys[0] == keys[2] != keys[1]
    assert kernels(keys[0]).rows == [0] * len(kernels(keys[0]).params)
    rows = dict(zip(kernels(keys[1]).params, kernels(keys[1]).rows))
    assert rows["qkv.weight"] == rows["qkv.bias"] != rows["fc1.weight"] == rows["fc1.bias"]
    assert len(set(rows.values())) == 3 and rows["ln1.weight"] == rows["fc2.bias"]
    if backend == "inductor":
        checks = list(dp._dpfx_backend._checks.values())
        assert checks and all(c.done and c.backward is not None for c in checks)
    for blk in net.blocks:
        uninstall(blk)


def test_one_norm_row_per_block_call_in_the_model_graph():
    """Under flat clipping each block call adds one norm row to the model's norm, once for all
    its parameters; the verifier refuses a block whose parameters' row is not in the norm of
    the factor that scales them."""
    from dpfx.errors import PrivacyError
    from dpfx.passes.verify import verify_backward

    torch.manual_seed(0)
    net = Net()
    dp = dpfx.compile(net, max_grad_norm=1.0, noise_multiplier=0.0, loss_reduction="sum",
                      backend="eager", blocks="auto")
    ids = torch.randint(0, 11, (2, 5))
    _token_loss(dp(ids), ids).backward()
    result = dp._dpfx_backend.last_backward
    gm = result.gm
    k = kernels(net.blocks[0].forward.key)
    assert k.rows == [0] * len(k.params)
    selects = [n for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.select.int)
               if n.args[0].target is operator.getitem
               and n.args[0].args[0].target is torch.ops.dpfx.block_bwd.default]
    assert len(selects) == 3, "one row per block call"
    grads = {name: result.private[name] for name in result.private}
    verify_backward(gm, result.analysis.rerun(gm.graph), grads, dp.dp_config)
    k.rows = [1] * len(k.params)      # a row the model's norm never took
    try:
        with pytest.raises(PrivacyError, match="norm row 1 of its block call"):
            verify_backward(gm, result.analysis.rerun(gm.graph), grads, dp.dp_config)
    finally:
        k.rows = [0] * len(k.params)
    for blk in net.blocks:
        uninstall(blk)


def test_two_models_with_blocks_do_not_recompile_each_other():
    """Two Hugging Face models with blocks in one process, stepped in turn through Inductor
    (self-check on): each compiles its pair once (Note [The pickler leaves pytree's registry as
    it was] in lower/warm.py; before, each compile's graph snapshot and each warm load failed
    the other model's guards on pytree's registry, and the two recompiled each other at every
    step), and each step equals the batch-of-one loop, clipping biting. Llama: its blocks take
    the rotary tables as a tuple, so dynamo traces pytree's flattening of each block call (Note
    [A block call's flattening]) and guards on pytree's registry."""
    torch.manual_seed(0)
    pairs = [_hf_lm("llama", layers=2) for _ in range(2)]
    references = [copy.deepcopy(m) for m, _ in pairs]
    dps = [dpfx.compile(m, max_grad_norm=0.05, noise_multiplier=0.0, loss_reduction="sum",
                        blocks="auto") for m, _ in pairs]
    for step in range(2):       # the second round is where each model's guards were failed
        inputs, y = pairs[0][1](3 - step)
        for dp, (model, _), reference in zip(dps, pairs, references):
            got = run_dpfx_multi(dp, model, _token_loss, inputs, y, "sum")
            if step == 0:
                norms = per_example_norms(loop_example_grads(reference, _token_loss, inputs, y))
                assert bool((norms > 0.05).all()), norms
            want = loop_dp_sgd_grads(reference, _token_loss, inputs, y, max_grad_norm=0.05,
                                     loss_reduction="sum")
            assert_close(got, want, rtol=2e-4, atol=1e-6)
    assert [dp.compile_count for dp in dps] == [2, 2]
    assert all(len(dp._blocks) == 2 for dp in dps)


def test_block_proof_refuses_a_clipped_sum_over_another_parameters_gradient(monkeypatch):
    """With one norm row for a whole group, the block's proof still checks each parameter's
    clipped sum against that parameter's own norm: ln1.bias released from ln1.weight's
    per-sample gradients (the same shape; one gradient released twice) is refused although both
    are in the row."""
    import dpfx.passes.block as block_pass
    from dpfx.errors import PrivacyError

    original = block_pass.clipped_sum
    first = []

    def planted(pg, clip, emit, moved=True):
        if not first:
            first.append(pg)
        elif len(first) == 1:
            first.append(pg)
            return original(first[0], clip, emit, moved)
        return original(pg, clip, emit, moved)

    monkeypatch.setattr(block_pass, "clipped_sum", planted)
    config = DPConfig(max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    block = Block()
    groups = ["g"] * sum(1 for p in block.parameters() if p.requires_grad)
    with pytest.raises(PrivacyError, match="not part of parameter 1's norm"):
        compile_block(block, (torch.randn(2, 5, 8),), {}, {0}, config, groups)
    assert [pg.name for pg in first] == ["ln1.weight", "ln1.bias"]


class _NormTanh(nn.Module):
    """LayerNorm, Linear, tanh, residual: aot_autograd donates the saved pre-activation to the
    backward, where Inductor would write the tanh gradient into it."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, h):
        return h + torch.tanh(self.fc(self.norm(h)))


def test_a_blocks_backward_writes_into_none_of_its_inputs():
    """Parts A and B through Inductor leave every tensor they read as it was: part B and the
    self-check read what part A read (Note [A block's backward donates no input]). The
    self-check is off here so that a backward that wrote into its inputs is compiled and seen
    doing it, not refused."""
    torch.manual_seed(0)
    config = DPConfig(max_grad_norm=1.0, noise_multiplier=0.0, self_check=False)
    key = compile_block(_NormTanh(), (torch.randn(3, 4, 8),), {}, {0}, config)
    k = kernels(key)
    block = _NormTanh()
    for b in (2, 5):
        args = [torch.randn(b, 4, 8)] + [p.detach() for p in block.parameters()]
        got = k.forward(args)
        grads = [torch.randn_like(o) for o in got[:k.num_outputs]]
        reads = [args[i] if kind == "arg" else got[k.num_outputs + i] if kind == "saved"
                 else grads[i] for kind, i in k.backward_reads]
        before = [r.clone() for r in reads]
        part_a = k.backward(reads)
        for i, (x, y) in enumerate(zip(reads, before)):
            assert torch.equal(x, y), f"part A wrote into its input {i} ({k.backward_reads[i]})"
        ops = operands(k, reads, part_a)
        kept = [o.clone() for o in ops]
        k.clip([torch.ones(b) for _ in k.params], [torch.ones(b, dtype=torch.bool)
                                                   for _ in k.params], ops)
        for i, (x, y) in enumerate(zip(ops, kept)):
            assert torch.equal(x, y), f"part B wrote into its operand {i}"
        for x, y in zip(part_a, k.fake_backward(before)):     # the graph the proof read
            torch.testing.assert_close(x, y)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h, scale=1.0, mask=None):
        out = torch.tanh(self.fc(h)) * scale
        return h + (out if mask is None else out * mask)


class _ScaledNet(nn.Module):
    """Two ``_Scaled`` layers, called as ``how`` says."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Scaled(), _Scaled()])
        self.how = "keywords"

    def forward(self, x):
        m = torch.ones(8)
        for layer in self.layers:
            if self.how == "keywords":
                x = layer(x, scale=2.0, mask=m)
            elif self.how == "positional":
                x = layer(x, 2.0, m)
            elif self.how == "other_scale":
                x = layer(x, scale=3.0, mask=m)
            else:
                x = layer(x, scale=2.0, mask=(m,))
        return x


def test_a_block_call_is_checked_against_the_call_it_was_compiled_for():
    """Note [A block call's flattening]: the keyword call the blocks were compiled from takes the
    fast path; another constant, a container where the call had a tensor, or the same values
    passed positionally (another structure) are refused, and the call compiled for still runs."""
    from dpfx.errors import CaptureError
    torch.manual_seed(0)
    net = _ScaledNet()
    plain = copy.deepcopy(net)
    dp = dpfx.compile(net, max_grad_norm=1.0, noise_multiplier=0.0, blocks="auto",
                      backend="eager")
    x = torch.randn(3, 8)
    want = plain(x)
    torch.testing.assert_close(dp(x), want)
    assert net.layers[0].forward.flat == (1, ("scale", "mask"))
    for how, said in (("other_scale", "3.0"), ("container", "compiled for"),
                      ("positional", "compiled for")):
        net.how = how
        with pytest.raises(CaptureError, match="arguments other than those it was compiled "
                                               "for") as e:
            dp(x)
        assert said in str(e.value)
    net.how = "keywords"
    torch.testing.assert_close(dp(x), want)


def test_a_held_output_shares_memory_only_with_what_the_op_holds():
    """Note [What a held tensor may share]: an output the op returns is a new tensor; one it
    holds may be a view of another held tensor (a held input, an earlier held output) as it is,
    and is copied where it would share a buffer of the model's graph (an argument, a returned
    output). Every copy keeps its values."""
    from dpfx.blocks.kernels import _storage, _unaliased
    arg, held_in = torch.randn(4, 3), torch.randn(4, 3)
    returned_new, held_new = torch.randn(2), torch.randn(3, 4)
    outs = [returned_new,           # 0 returned, new: kept
            arg.view(12),           # 1 returned, a view of an argument: copied
            held_in[0],             # 2 returned, a view of a held input: copied
            held_in.t(),            # 3 held, a view of a held input: kept
            held_new,               # 4 held, new: kept
            held_new.view(12),      # 5 held, a view of an earlier held output: kept
            arg[1],                 # 6 held, a view of an argument: copied
            returned_new.view(1, 2)]    # 7 held, a view of a returned output: copied
    got = _unaliased(outs, [arg, held_in], returned=3, held_inputs={1})
    shared = [_storage(g) == _storage(o) for g, o in zip(got, outs)]
    assert shared == [True, False, False, True, True, True, False, False]
    for g, o in zip(got, outs):
        assert torch.equal(g, o) and g.stride() == o.stride()
    # without held inputs (the forward, part B) every alias of an input or output is copied
    got = _unaliased(outs[:3] + outs[4:6], [arg, held_in], returned=3)
    assert [_storage(g) == _storage(o) for g, o in
            zip(got, outs[:3] + outs[4:6])] == [True, False, False, True, True]


def test_a_block_evaluates_its_sizes_once_per_batch_size(monkeypatch):
    """Note [A block call's sizes, once per batch size]: the second call at a batch size walks
    no expression, and every batch size (0, 1, and one met before) gets its own sizes and
    layouts: the kernels equal the block's FX graphs there."""
    import dpfx.blocks.kernels as block_kernels
    torch.manual_seed(0)
    config = DPConfig(max_grad_norm=1.0, noise_multiplier=0.0)
    key = compile_block(_NormTanh(), (torch.randn(3, 4, 8),), {}, {0}, config)
    k = kernels(key)
    params = [p.detach() for p in _NormTanh().parameters()]
    walked = [0]
    evaluate = block_kernels.evaluate

    def counted(expr, batch):
        walked[0] += 1
        return evaluate(expr, batch)

    monkeypatch.setattr(block_kernels, "evaluate", counted)
    seen, fresh = set(), []
    for b in (2, 0, 1, 2, 7, 2):
        for _ in range(2):
            before = walked[0]
            # a transposed argument: conformed to the layout the graph was compiled for
            args = [torch.randn(4, b, 8).transpose(0, 1)] + params
            out = k.forward(args)
            grads = [torch.randn_like(o) for o in out[:k.num_outputs]]
            reads = [args[i] if kind == "arg" else out[k.num_outputs + i] if kind == "saved"
                     else grads[i] for kind, i in k.backward_reads]
            part_a = k.backward(reads)
            ops = operands(k, reads, part_a)
            coefs = ([torch.rand(b) for _ in k.params],
                     [torch.rand(b) > 0.3 for _ in k.params])
            sums = k.clip(*coefs, ops)
            if b in seen:
                assert walked[0] == before, f"batch {b}, met before, walked its expressions"
            else:       # (the block's self-check may have met it first)
                fresh.append(walked[0] - before)
            seen.add(b)
            for got, want in ((out, k.fake_forward(args)), (part_a, k.fake_backward(reads)),
                              (sums, k.fake_clip(*coefs, ops))):
                for x, y in zip(got, want):
                    torch.testing.assert_close(x, y)
    assert any(fresh), "no batch size walked its expressions: the count reads nothing"


def test_a_step_skips_the_block_ops_autograd_layer(monkeypatch):
    """Note [Compiled graphs run below autograd] (backend/runtime.py): the model's compiled
    graphs call the block ops with the autograd keys excluded, so the ops' Python autograd layer
    (which would redispatch below itself) never runs in a step, forward or backward, at batch
    sizes 4 and 1; the step stays exact, clipping biting, under Inductor."""
    torch.manual_seed(0)
    net = Net(layers=2)
    reference = copy.deepcopy(net)
    dp = dpfx.compile(net, max_grad_norm=0.05, noise_multiplier=0.0, loss_reduction="sum",
                      blocks="auto")
    redispatched = []
    redispatch = torch._ops.OpOverload.redispatch

    def counted(op, *args, **kwargs):
        if op.namespace == "dpfx":
            redispatched.append(op.name())
        return redispatch(op, *args, **kwargs)

    monkeypatch.setattr(torch._ops.OpOverload, "redispatch", counted)
    for step, b in enumerate((4, 1, 4, 1)):
        if step == 2:       # the compiles and self-checks are done: steady steps from here
            assert "dpfx::block_fwd" in redispatched    # (the eager references take the layer)
            redispatched.clear()
        g = torch.Generator().manual_seed(b)
        inputs, y = (torch.randint(0, 11, (b, 5), generator=g),), torch.randint(0, 11, (b, 5),
                                                                             generator=g)
        norms = per_example_norms(loop_example_grads(reference, _token_loss, inputs, y))
        assert bool((norms > 0.05).all()), norms
        got = run_dpfx_multi(dp, net, _token_loss, inputs, y, "sum")
        want = loop_dp_sgd_grads(reference, _token_loss, inputs, y, max_grad_norm=0.05,
                                 loss_reduction="sum")
        assert_close(got, want, rtol=2e-4, atol=1e-6)
    assert redispatched == [], redispatched
