"""The self-check's batches: the sizes it runs at, the synthetic inputs, and the boxed runs.

    x = synthetic(name, meta, real, sizes, generator, batch_inputs, targets)
    out = call_boxed(compiled, [x, ...], device)     # seeded; the inputs freed after last use

Each synthetic batch is built like the user's (floats with the inputs' mean and spread,
integers within their range, boolean rows copied) at the sizes of SIZES, laid out with the
strides the graph was compiled for.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch

from dpfx.capture import batch_branches
from dpfx.graph.batch import BatchDim


# Note [The self-check's two batch sizes]
# Two sizes, so that code which assumed one batch size fails at the other; neither is 1, which
# torch's size-oblivious reasoning sets apart, and 2 and 3 differ in parity. They are the
# smallest such pair because the check's time and memory are its graph runs, in proportion to
# the examples (BENCHMARKS.md, "Levers in the code"). Neither pair runs the vector body of a kernel
# over [B] (16 lanes): both run only its tail.
SIZES = (2, 3)


def saved_by_backward_name(forward: Half, outs: list) -> dict:
    """The forward's outputs by the names the backward's placeholders give them: saved tensors
    keep their forward names; the RNG states saved for recomputing a checkpointed region
    (``run_and_save_rng_state``, the u8 outputs, in order) are ``rng_state_output_<k>``."""
    saved = dict(zip(forward.outputs, outs))
    states = [x for x, meta in zip(outs, forward.output_vals)
              if isinstance(meta, torch.Tensor) and meta.dtype == torch.uint8]
    saved.update({f"rng_state_output_{k}": x for k, x in enumerate(states)})
    return saved


def sizes_served(decisions: list) -> list[int]:
    """SIZES, or for a graph captured for the batch sizes where the model's branches on the
    batch come out one way (Note [Deciding a branch on the batch size]), the first two sizes it
    serves (B = 1 alone for a graph of B = 1: exactness only)."""
    served = [b for b in (*SIZES, *range(1, 66)) if batch_branches.holds(decisions, b)]
    return list(dict.fromkeys(served))[:2]


def synthetic(name, meta, real, sizes, generator, batch_inputs: set, targets: set):
    """An input of the forward at ``sizes``, built like the user's ``real`` one where it holds
    the batch (``batch_inputs``; ``targets``: a captured loss's integer targets)."""
    if isinstance(meta, torch.SymInt):
        return concrete(meta, sizes)
    if name not in batch_inputs or not isinstance(real, torch.Tensor):
        return real
    shape = [concrete(s, sizes) for s in meta.shape]
    if real.dtype.is_floating_point:
        x = torch.randn(shape, generator=generator).to(real.device, real.dtype)
        x = (x * real.float().std().nan_to_num(1.0) + real.float().mean()).to(real)
    elif real.dtype == torch.bool:
        rows = torch.randint(real.shape[0], (shape[0],), generator=generator)
        x = real[rows.to(real.device)]
    elif name in targets:
        # a captured loss's integer targets: values they hold, drawn element by element, so
        # that class labels stay labels (a label tensor holds -100 beside 0..K-1, and the
        # values between would index out of range in the loss, loss/captured.py)
        flat = real.reshape(-1)
        x = flat[torch.randint(flat.numel(), shape, generator=generator).to(real.device)]
    else:
        low, high = int(real.min()), int(real.max())
        x = torch.randint(low, high + 1, shape, generator=generator).to(real)
    return laid_out(x, meta, sizes)


# Note [The self-check's runs free their inputs]
# Both graphs of a check run in the boxed convention: the callable takes one list of inputs and
# clears it as it starts, so an input is freed after its last use, as in training (Inductor's
# code does; the eager reference is generated so too, ``_BoxedCodeGen``). A run that the
# check feeds for the last time is handed the list itself (``consume``): a backward's saved
# tensors then go as the backward passes them, where a list the caller kept held all of them
# to the end (an eager backward's saved tensors, beside the compiled gradients, at the check's
# peak). A forward's inputs are fed again and are copied.
def call_boxed(fn, args: list, device, consume: bool = False) -> list:
    """``fn(args)`` for a boxed ``fn``; ``consume``: ``args`` itself, which ``fn`` empties."""
    torch.manual_seed(1234) if device.type == "cpu" else torch.get_device_module(
        device.type).manual_seed(1234)
    # as the runners call it: Note [Compiled graphs run below autograd] in backend/runtime.py
    with torch.no_grad(), torch._C._AutoDispatchBelowAutograd():
        out = fn(args if consume else list(args))
    return list(out) if isinstance(out, (list, tuple)) else [out]


class isolated_rng:
    """The self-check draws from the device generator; the user's stream continues unchanged."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        self.state = torch.random.get_rng_state()
        if self.device.type != "cpu":
            self.device_state = torch.get_device_module(self.device.type).get_rng_state()

    def __exit__(self, *exc):
        torch.random.set_rng_state(self.state)
        if self.device.type != "cpu":
            torch.get_device_module(self.device.type).set_rng_state(self.device_state)


def other_examples(t: torch.Tensor, layout: BatchDim, b: int, sizes: dict) -> torch.Tensor:
    """Every example but 0, from a tensor whose dim ``layout.dim`` is (outer, B, inner)."""
    outer, inner = concrete(layout.outer, sizes), concrete(layout.inner, sizes)
    d = layout.dim
    split = t.reshape(*t.shape[:d], outer, b, inner, *t.shape[d + 1:])
    return split.narrow(d + 1, 1, b - 1)


def rows_from(value, dim: int | None, meta, sizes: dict, scale: float = 1.0):
    """A larger size's value at the smaller size: its examples 1 on along ``dim`` (None: the
    value itself), times ``scale``, laid out as the graph was compiled for."""
    if not isinstance(value, torch.Tensor) or dim is None:
        return concrete(meta, sizes) if isinstance(meta, torch.SymInt) else value
    rows = value.narrow(dim, 1, value.shape[dim] - 1).clone()
    if scale != 1.0:
        rows.mul_(scale)
    return laid_out(rows, meta, sizes)


def every_example(t: torch.Tensor, layout: BatchDim, b: int, sizes: dict) -> torch.Tensor:
    """Every example, from a tensor whose dim ``layout.dim`` is (outer, B, inner)."""
    outer, inner = concrete(layout.outer, sizes), concrete(layout.inner, sizes)
    d = layout.dim
    return t.reshape(*t.shape[:d], outer, b, inner, *t.shape[d + 1:])


def known_sizes(inputs: list, args: list, batch_symbols: set) -> dict:
    """Values of the graph's non-batch size symbols, read off the real arguments."""
    sizes = {}
    for (_, meta), a in zip(inputs, args):
        if isinstance(meta, torch.SymInt) and isinstance(meta.node.expr, sympy.Symbol):
            sizes[meta.node.expr] = int(a)
        elif isinstance(meta, torch.Tensor) and isinstance(a, torch.Tensor):
            for s, v in zip(meta.shape, a.shape):
                if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                    sizes.setdefault(s.node.expr, v)
    return {s: v for s, v in sizes.items() if s not in batch_symbols}


def real_examples(b: int, meta: torch.Tensor) -> torch.Tensor:
    """A padded batch's count of real examples (Note [Padded rows contribute zero] in
    passes/clip_noise.py) for a check at batch size ``b``: all rows but the last, so that the
    check runs a padded row through both graphs."""
    return torch.tensor(float(max(b - 1, 1)), dtype=meta.dtype, device=meta.device)


def concrete(size, sizes: dict) -> int:
    expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.sympify(size)
    return int(sympy.sympify(expr).subs(sizes))


def random_like(meta, sizes: dict, generator) -> Any:
    if isinstance(meta, torch.SymInt):
        return concrete(meta, sizes)
    shape = [concrete(s, sizes) for s in meta.shape]
    x = torch.randn(shape, generator=generator)
    return laid_out(x.to(dtype=meta.dtype, device=meta.device), meta, sizes)


def laid_out(x: torch.Tensor, meta: torch.Tensor, sizes: dict) -> torch.Tensor:
    """``x`` with the strides the graph was compiled for: the compiled code asserts them (a
    channels-last image stays channels-last)."""
    strides = [concrete(s, sizes) for s in meta.stride()]
    if list(x.stride()) == strides:
        return x
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device).copy_(x)
