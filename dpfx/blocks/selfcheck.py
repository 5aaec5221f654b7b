"""A compiled block's self-check: its three compiled graphs against their FX graphs, and each
for what its proof assumes, when the block is compiled (Note [A block's self-check]).

    check_block(kernels, call_tensors, batched, rest, batch_symbols)   # raises PrivacyError
"""
from __future__ import annotations

import torch

from dpfx.blocks.sizes import resized
from dpfx.lower.cpu_builds import finish_builds
from dpfx.ops.blocks import Kernels


# Note [A block's self-check]
# The model graph's self-check (lower/selfcheck/) runs the block ops' compiled kernels on both
# of its sides, so it cannot see a block's own lowering. Each block's three compiled graphs are
# therefore checked when it is compiled, at 2 and 3 examples (the probe's rows repeated, floating
# inputs random): each against its FX graph (the graph the proof read), the forward and part A
# for independence (example 0's inputs and output gradient changed, every other example's rows
# of every batched output unchanged), and part B for the mask (example 0 with coefficient 0 and
# mask off, its operands changed: the clipped sums unchanged).
def check_block(k: Kernels, call_tensors: list, batched: set[int], rest: list,
                batch_symbols: set) -> None:
    from dpfx.errors import PrivacyError
    from dpfx.graph.batch import BatchDim
    from dpfx.lower.selfcheck.batches import other_examples
    from dpfx.lower.selfcheck.compare import close, compare
    from dpfx.ops.blocks import operands

    finish_builds()     # Note [A graph's C++ builds run while the next graph lowers]
    g = torch.Generator().manual_seed(0)

    def changed(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[0] = t[1] if not t.is_floating_point() else t[0] + torch.randn(
            t[0].shape, generator=g).to(t)
        return t

    def changed_at(t: torch.Tensor, lay, b: int) -> torch.Tensor:
        """``t`` with example 0's entries changed, its dim ``lay.dim`` (outer, B, inner)."""
        sizes = {s: b for s in batch_symbols}
        from dpfx.lower.selfcheck.batches import concrete
        outer, inner = concrete(lay.outer, sizes), concrete(lay.inner, sizes)
        t = t.clone()
        split = t.view(*t.shape[:lay.dim], outer, b, inner, *t.shape[lay.dim + 1:])
        row = split.select(lay.dim + 1, 0)
        if t.is_floating_point():
            row.add_(torch.randn(row.shape, generator=g).to(row))
        else:
            row.copy_(split.select(lay.dim + 1, 1))
        return t

    # each of part B's operands' layout: a part A output's, or that of what part A read
    def read_layout(kind, i):
        if kind == "arg":
            return BatchDim(0) if i in batched else None
        return k.forward_layouts[k.num_outputs + i] if kind == "saved" else k.forward_layouts[i]

    operand_layouts = [k.backward_layouts[i] if kind == "out" else read_layout(*k.backward_reads[i])
                       for kind, i in k.operands]

    def independent(which, b, layouts, before, after):
        sizes = {s: b for s in batch_symbols}
        for i, (lay, x, y) in enumerate(zip(layouts, before, after)):
            if isinstance(lay, BatchDim) and not close(other_examples(x, lay, b, sizes),
                                                        other_examples(y, lay, b, sizes), 1e-5):
                raise PrivacyError(
                    f"dpfx's self-check of block {k.name}: changing example 0 changed other "
                    f"examples of {which} output {i} at batch size {b}. The code Inductor "
                    f"generated mixes examples (a torch bug); dpfx refuses to train with it. "
                    f"Use backend='eager', or compile without blocks, and report this with "
                    f"your torch version.")

    with torch.no_grad():
        for b in (2, 3):
            args = [(resized(t, b) if i in batched else t) for i, t in enumerate(call_tensors)]
            args = [torch.randn(a.shape, generator=g).to(a) if i in batched
                    and a.is_floating_point() else a for i, a in enumerate(args)] + list(rest)
            got = k.forward(args)
            names = [f"{k.name} forward output {i}" for i in range(len(got))]
            compare(f"block {k.name} forward", b, names, got, k.fake_forward(args))
            again = k.forward([changed(a) if i in batched else a for i, a in enumerate(args)])
            independent("forward", b, k.forward_layouts, got, again)

            grads = [torch.randn(o.shape, generator=g).to(o) for o in got[:k.num_outputs]]

            def reads_of(args, got, grads):
                return [args[i] if kind == "arg" else got[k.num_outputs + i] if kind == "saved"
                        else grads[i] for kind, i in k.backward_reads]

            reads = reads_of(args, got, grads)
            part_a = k.backward(reads)
            names = [f"{k.name} part A output {i}" for i in range(len(part_a))]
            compare(f"block {k.name} backward (part A)", b, names, part_a,
                     k.fake_backward(reads))
            args2 = [changed(a) if i in batched else a for i, a in enumerate(args)]
            again = k.backward(reads_of(args2, k.forward(args2), [changed(t) for t in grads]))
            independent("part A", b, k.backward_layouts, part_a, again)

            ops = operands(k, reads, part_a)
            coefs = [torch.rand(b, generator=g) + 0.5 for _ in k.params]
            keeps = [torch.ones(b, dtype=torch.bool) for _ in k.params]
            part_b = k.clip(coefs, keeps, ops)
            names = [f"{k.name} clipped sum {p}" for p in k.params]
            compare(f"block {k.name} clipped sums (part B)", b, names, part_b,
                     k.fake_clip(coefs, keeps, ops))
            for c, m in zip(coefs, keeps):
                c[0], m[0] = 0.0, False
            masked = k.clip(coefs, keeps, ops)
            rows = [changed_at(t, lay, b) if isinstance(lay, BatchDim) else t
                    for t, lay in zip(ops, operand_layouts)]
            for name, x, y in zip(k.params, masked, k.clip(coefs, keeps, rows)):
                if not close(x, y, 1e-5):
                    raise PrivacyError(
                        f"dpfx's self-check of block {k.name}: the clipped sum of {name} moved "
                        f"with example 0's operands although its coefficient was 0 and its mask "
                        f"off, at batch size {b}. dpfx refuses to train with this code; use "
                        f"backend='eager', or compile without blocks, and report this with your "
                        f"torch version.")
