"""The training-step implementations compared by the benchmark.

Each factory takes a freshly built model and returns a ``Method``: ``step(x, y)`` runs one full
training step (forward, backward, and for the private methods per-sample clipping at C, Gaussian
noise sigma*C, division by the expected batch size; then ``optimizer.step()`` (SGD) and
``zero_grad``), and ``compiles()`` reports the graphs compiled so far where that applies.

All private methods implement the same DP-SGD step (flat clipping over all parameters, Opacus's
semantics), so their timings compare like with like.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_leaves, tree_map

import models
from models import forward, loss_fn

C = 1.0        # max_grad_norm
SIGMA = 1.0    # noise_multiplier
LR = 0.01


@dataclass
class Method:
    step: Callable[[torch.Tensor, torch.Tensor], None]
    compiles: Optional[Callable[[], int]] = None   # None: not applicable (eager)
    model: Optional[nn.Module] = None   # the module it trains, when not the one it was given


def unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _dynamo_compiles() -> Callable[[], int]:
    start = unique_graphs()
    return lambda: unique_graphs() - start


# --- non-private --------------------------------------------------------------------------------

def nonprivate_eager(model: nn.Module, B: int) -> Method:
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(x, y):
        loss_fn(forward(model, x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Method(step)


def nonprivate_compile(model: nn.Module, B: int) -> Method:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    compiles = _dynamo_compiles()
    cmodel = torch.compile(model)

    def step(x, y):
        loss_fn(forward(cmodel, x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Method(step, compiles)


def nonprivate_compile_loss(model: nn.Module, B: int) -> Method:
    """torch.compile of the model and its loss together: the baseline of dpfx with the loss
    captured (``dpfx_loss``), whose compiled graph holds the loss too."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    compiles = _dynamo_compiles()

    @torch.compile
    def objective(x, y):
        return models.captured_loss(model(**x) if isinstance(x, dict) else model(x), y)

    def step(x, y):
        call_compiled(objective, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Method(step, compiles)


def call_compiled(fn, *args):
    """``fn(*args)``: a named frame around a torch.compile'd function's call, which kernels.py
    times as that method's forward call (dynamo's guards, aot_autograd's runtime)."""
    return fn(*args)


def nonprivate_compile_unrolled(model: nn.Module, B: int) -> Method:
    """torch.compile with dpfx's capture-time rewrites in place (``traceable_torch``: nn.LSTM's
    recurrence written out one time step at a time), no DP: the graph dpfx makes private,
    compiled as it is (Note [The LSTM's baseline] in models.py)."""
    from dpfx.capture.swaps import traceable_torch

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    compiles = _dynamo_compiles()
    cmodel = torch.compile(model)

    def step(x, y):
        with traceable_torch():   # every call: dynamo guards on the swapped functions
            out = forward(cmodel, x)
        loss_fn(out, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Method(step, compiles)


# --- Opacus -------------------------------------------------------------------------------------

def _opacus(model: nn.Module, B: int, mode: str, x_example, y_example):
    from opacus import PrivacyEngine
    from opacus.validators import ModuleValidator
    from torch.utils.data import DataLoader, TensorDataset

    if not ModuleValidator.is_valid(model):
        model = ModuleValidator.fix(model)   # nn.LSTM -> Opacus's DPLSTM, same weights
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    # A loader over one batch of B examples: sample rate 1, so Opacus's expected batch size is B.
    loader = DataLoader(TensorDataset(tree_leaves(x_example)[0], y_example), batch_size=B)
    engine = PrivacyEngine()
    kwargs = dict(module=model, optimizer=opt, data_loader=loader, noise_multiplier=SIGMA,
                  max_grad_norm=C, poisson_sampling=False, grad_sample_mode=mode,
                  loss_reduction="mean")
    if mode == "ghost":
        kwargs["criterion"] = nn.CrossEntropyLoss(reduction="mean")
        return (*engine.make_private(**kwargs)[:3], model)
    gsm, dp_opt, _ = engine.make_private(**kwargs)
    return gsm, dp_opt, None, model


def opacus_hooks(model: nn.Module, B: int, x, y) -> Method:
    gsm, opt, _, trained = _opacus(model, B, "hooks", x, y)

    def step(x, y):
        loss_fn(forward(gsm, x), y).backward()
        opt.step()                      # clip per-sample grads, add noise, scale, SGD
        opt.zero_grad(set_to_none=True)  # also clears grad_sample

    return Method(step, model=trained)


def opacus_ghost(model: nn.Module, B: int, x, y) -> Method:
    """Ghost clipping: the wrapped criterion's loss.backward() runs two backward passes (per-sample
    norms without per-sample gradients, then the clipped, reweighted sum); the optimizer adds
    noise and scales."""
    gsm, opt, criterion, trained = _opacus(model, B, "ghost", x, y)

    def step(x, y):
        out = forward(gsm, x)
        if out.dim() == 3:   # (B, T, V) logits: per-sequence loss, mean over its T tokens
            loss = criterion(out.reshape(-1, out.shape[-1]), y.reshape(-1), shape=out.shape)
        else:
            loss = criterion(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Method(step, model=trained)


# --- torch.func ---------------------------------------------------------------------------------

def _func_dp_grads(model: nn.Module):
    buffers = dict(model.named_buffers())

    def one(params, x, y):
        call = lambda *a, **k: functional_call(model, (params, buffers), a, k)
        out = forward(call, tree_map(lambda t: t.unsqueeze(0), x))
        return loss_fn(out, y.unsqueeze(0))

    def dp_grads(params, x, y, denom: int):
        g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
        factor = (C / (norms + 1e-6)).clamp(max=1.0)
        out = {}
        for k, v in g.items():
            clipped = (v * factor.view(-1, *[1] * (v.dim() - 1))).sum(0)
            out[k] = (clipped + SIGMA * C * torch.randn_like(clipped)) / denom
        return out

    return dp_grads


def _func_method(model: nn.Module, B: int, compiled: bool) -> Method:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    named = {k: p for k, p in model.named_parameters() if p.requires_grad}
    fn = _func_dp_grads(model)
    compiles = None
    if compiled:
        compiles = _dynamo_compiles()
        fn = torch.compile(fn)

    def step(x, y):
        grads = fn({k: p.detach() for k, p in named.items()}, x, y, B)
        for k, p in named.items():
            p.grad = grads[k]
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Method(step, compiles)


def func_eager(model, B):
    return _func_method(model, B, compiled=False)


def func_compile(model, B):
    return _func_method(model, B, compiled=True)


# --- Opake --------------------------------------------------------------------------------------

# Note [Opake in the harness]
# Opake (PyTorch DP on torch.func) runs the same DP-SGD step through its own functions:
# ``opake.dpsgd.clipping.clipped_grad`` (vmap of grad over the examples, flat clipping at C,
# the sum divided by B) and ``opake.dpsgd.noise.gaussian_noise`` (std sigma * C / B), the model
# through ``torch.func.functional_call``. Two limits shape where it runs:
# - It holds every example's gradient at once: its eager step's tensor peak on CPU was 19.7
#   bytes per parameter per example on the MLP and 8.5 on the GPT (run.step_peak_bytes). A step
#   that would need 20 bytes per parameter per example beyond the memory available is refused
#   before it starts, as the row's error.
#   Opake's ``microbatch_size`` bounds the memory by looping over chunks of the batch: a
#   different step from the one the other methods take, so it is not used here.
# - Hugging Face models with an attention mask branch on the mask's values, which vmap cannot
#   map. Opake runs them after ``opake.patches.apply_model_patches``, which replaces
#   transformers' mask builders, the causal LM's forward and parts of torch.func for the whole
#   process. So on a row with a mask its methods run in a process of their own
#   (``own_process``; run.py's ``--opake-patches`` worker, ``OPAKE_PATCHES`` set), beside that
#   row's non-private baseline timed in the same process, and no other method runs under the
#   patches. Without them the step is refused with the reason.
OPAKE_PATCHES = False
OPAKE_METHODS = ("opake_eager", "opake_compile")


def own_process(method: str, model_name: str) -> bool:
    """Whether ``method`` runs on ``model_name``'s row only in a process of its own, under
    Opake's process-wide model patches (Note [Opake in the harness])."""
    return method in OPAKE_METHODS and models.has_attention_mask(model_name)


OPAKE_BYTES_PER_PARAM_EXAMPLE = 20


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 2**63


def _check_opake_applies(model: nn.Module, B: int, x) -> None:
    """Raise, naming why, where Opake's step cannot run this row in the harness (Note [Opake in
    the harness]); the worker records the error as the row's result."""
    if isinstance(x, dict) and "attention_mask" in x and not OPAKE_PATCHES:
        raise NotImplementedError(
            "Opake maps an attention mask under vmap only after opake.patches."
            "apply_model_patches, which patches transformers and torch.func process-wide (the "
            "other methods of the worker would run under them)")
    params = [p for p in model.parameters() if p.requires_grad]
    need = OPAKE_BYTES_PER_PARAM_EXAMPLE * sum(p.numel() for p in params) * B
    have = _available_bytes(params[0].device)
    if need > have:
        raise MemoryError(
            f"Opake holds every per-example gradient: about {need / 2**30:.1f} GiB at B={B} "
            f"({OPAKE_BYTES_PER_PARAM_EXAMPLE} bytes per parameter per example), "
            f"{have / 2**30:.1f} GiB available")


def _opake_method(model: nn.Module, B: int, x, compiled: bool) -> Method:
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.noise import gaussian_noise
    from opake.random import key

    _check_opake_applies(model, B, x)
    if OPAKE_PATCHES:
        from opake.patches import apply_model_patches

        apply_model_patches(model)    # process-wide: Note [Opake in the harness]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    named = {k: p for k, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())

    def one(params, x, y):   # one example, without its batch dim (vmap's slice)
        call = lambda *a, **k: functional_call(model, (params, buffers), a, k)
        out = forward(call, tree_map(lambda t: t.unsqueeze(0), x))
        return loss_fn(out, y.unsqueeze(0))

    clip_fn, clip_state = clipped_grad(one, clipping_norm=C, batch_argnums=(1, 2),
                                       normalize_by=B)
    noise_fn, noise_state = gaussian_noise(noise_multiplier=SIGMA, key=key(0))

    def dp_grads(params, x, y, noise_state):
        summed, _ = clip_fn(params, x, y, state=clip_state)   # clipped sum / B
        return noise_fn(summed, noise_state)                  # + N(0, (sigma C / B)^2)

    compiles = None
    if compiled:
        compiles = _dynamo_compiles()
        dp_grads = torch.compile(dp_grads)
    state = [noise_state]

    def step(x, y):
        noised, state[0] = dp_grads({k: p.detach() for k, p in named.items()}, x, y, state[0])
        for k, p in named.items():
            p.grad = noised.pytree[k]
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Method(step, compiles)


def opake_eager(model, B, x, y):
    return _opake_method(model, B, x, compiled=False)


def opake_compile(model, B, x, y):
    """Opake's DP gradient function (clipping and noise) under torch.compile, as one call."""
    return _opake_method(model, B, x, compiled=True)


def loop_eager(model: nn.Module, B: int) -> Method:
    """Each example's gradient by plain autograd on a batch of one, then the same flat clipping
    and noise: the reference of check_agreement.py for models vmap cannot map over (the Hugging
    Face attention paths branch on tensor values). Not timed."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    named = {k: p for k, p in model.named_parameters() if p.requires_grad}

    def step(x, y):
        sums = {k: torch.zeros_like(p) for k, p in named.items()}
        for i in range(y.shape[0]):
            one = tree_map(lambda t: t[i:i + 1], x)
            g = torch.autograd.grad(loss_fn(forward(model, one), y[i:i + 1]), list(named.values()),
                                    allow_unused=True)
            g = [torch.zeros_like(p) if gi is None else gi for gi, p in zip(g, named.values())]
            norm = torch.sqrt(sum(gi.pow(2).sum() for gi in g))
            factor = (C / (norm + 1e-6)).clamp(max=1.0)
            for k, gi in zip(named, g):
                sums[k] += gi * factor
        for k, p in named.items():
            p.grad = (sums[k] + SIGMA * C * torch.randn_like(sums[k])) / B
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Method(step)


# --- dpfx ---------------------------------------------------------------------------------------

def _dpfx(model: nn.Module, B: int, strategy: str, captured: bool = False,
          noise: str | None = None, blocks=None, mechanism=None) -> Method:
    import dpfx

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    kwargs = {} if strategy == "auto" else {"strategy": strategy}
    if captured:
        kwargs["loss"] = models.captured_loss
    if noise is not None:
        kwargs["noise"] = noise
    if blocks is not None:
        kwargs["blocks"] = blocks
    dp = dpfx.compile(model, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=B,
                      backend="inductor", **kwargs)
    if noise == "optimizer":
        opt = dpfx.DPOptimizer(opt, dp, mechanism=mechanism)

    def step(x, y):
        if captured:
            dp.loss(x, y).backward()              # the loss proven with the model, once
        else:
            loss_fn(forward(dp, x), y).backward()     # p.grad: clipped, noised, / B
        opt.step()
        opt.zero_grad(set_to_none=True)

    m = Method(step, lambda: dp.compile_count)
    m.dp_model = dp
    m.optimizer = opt
    return m


def dpfx_inductor(model, B):
    """dpfx's default: strategy="auto" (ghost norms + book-keeping for Linear weights where the
    symbolic memory cost says so, per-sample gradients elsewhere)."""
    return _dpfx(model, B, "auto")


def dpfx_loss(model, B):
    """dpfx's default with the loss captured with the model (``dpfx.compile(model, loss=fn)``,
    ``dp.loss(x, y).backward()``): no loss check a step."""
    return _dpfx(model, B, "auto", captured=True)


def dpfx_optimizer_noise(model, B):
    """dpfx's default with ``noise="optimizer"`` (what distributed and sharded training run): the
    backward leaves the clipped sums, DPOptimizer.step() noises them, divides and steps."""
    return _dpfx(model, B, "auto", noise="optimizer")


# Built for more steps than a benchmark runs: the state's cost does not depend on the length.
MECHANISM_STEPS = 2000


def dpfx_bandmf4(model, B):
    """``dpfx_optimizer_noise`` with correlated noise: BandMF, 4 bands (3 noise vectors kept)."""
    from dpfx.privacy import strategies
    return _dpfx(model, B, "auto", noise="optimizer",
                 mechanism=strategies.bandmf(MECHANISM_STEPS, 4))


def dpfx_blt4(model, B):
    """``dpfx_optimizer_noise`` with correlated noise: BLT, 4 buffers."""
    from dpfx.privacy import strategies
    return _dpfx(model, B, "auto", noise="optimizer",
                 mechanism=strategies.blt(MECHANISM_STEPS, 4))


def dpfx_blocks(model, B):
    """dpfx with ``blocks="auto"``: each distinct repeated block one private graph, compiled
    once and called as one op by the model's graph."""
    return _dpfx(model, B, "auto", blocks="auto")


def dpfx_materialize(model, B):
    """dpfx with every per-sample gradient materialized (strategy="materialize")."""
    return _dpfx(model, B, "materialize")


# name -> (label, factory, needs the example batch)
METHODS = {
    "eager": ("non-private eager", nonprivate_eager, False),
    "compile": ("non-private torch.compile", nonprivate_compile, False),
    "compile_loss": ("non-private torch.compile, loss compiled with the model",
                     nonprivate_compile_loss, False),
    "compile_unrolled": ("non-private torch.compile, recurrence unrolled as dpfx captures it",
                         nonprivate_compile_unrolled, False),
    "opacus_hooks": ("Opacus hooks", opacus_hooks, True),
    "opacus_ghost": ("Opacus ghost clipping", opacus_ghost, True),
    "func_eager": ("torch.func vmap(grad), eager", func_eager, False),
    "func_compile": ("torch.func vmap(grad), torch.compile", func_compile, False),
    "opake_eager": ("Opake 0.16 (torch.func), eager", opake_eager, True),
    "opake_compile": ("Opake 0.16 (torch.func), torch.compile", opake_compile, True),
    "dpfx": ("dpfx (inductor)", dpfx_inductor, False),
    "dpfx_loss": ("dpfx (inductor), loss captured", dpfx_loss, False),
    "dpfx_optimizer_noise": ("dpfx (inductor), noise at the optimizer", dpfx_optimizer_noise,
                             False),
    "dpfx_bandmf4": ("dpfx (inductor), BandMF 4 bands", dpfx_bandmf4, False),
    "dpfx_blt4": ("dpfx (inductor), BLT 4 buffers", dpfx_blt4, False),
    "dpfx_materialize": ("dpfx (inductor, strategy=materialize)", dpfx_materialize, False),
    "dpfx_blocks": ("dpfx (inductor), blocks='auto'", dpfx_blocks, False),
    "loop_eager": ("batch-of-one loop, eager", loop_eager, False),
}


def applies(name: str, model_name: str) -> bool:
    """compile_unrolled differs from compile only where a model names it as its baseline."""
    return name != "compile_unrolled" or models.BASELINE.get(model_name) == name


def make(name: str, model: nn.Module, B: int, x, y) -> Method:
    _, factory, needs_batch = METHODS[name]
    return factory(model, B, x, y) if needs_batch else factory(model, B)
