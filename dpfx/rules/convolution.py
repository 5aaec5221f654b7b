"""Per-sample gradients of convolutions: ``nn.Conv{1,2,3}d`` and ``nn.ConvTranspose{1,2,3}d``.

In the backward graph a convolution's parameter gradients are outputs 1 and 2 of one op::

    cb = convolution_backward(g, x, w, [Cout], stride, padding, dilation, False, [0], groups, mask)
    getitem(cb, 1)    # weight grad, f32[Cout, Cin/groups, *k]: a sum over the batch and positions
    getitem(cb, 2)    # bias grad, f32[Cout]: g summed over dims 0, 2, 3, ...

Keeping the example dim (Opacus' conv grad sampler, derived from the op's constants): unfold the
zero-padded input into the patches each output position reads, then contract only the positions::

    patches = unfold(pad(x))                              # (B, Cin, *out_spatial, *k)
    dW_i    = g_i.view(groups, Cout/groups, P) @ patches_i.view(groups, P, Cin/groups * K)
    db_i    = g_i.sum(spatial dims)

with P the number of output positions and K the kernel size, as one ``bmm`` over B*groups. Unfold
is ``aten.unfold`` once per spatial dim (window ``dilation*(k-1)+1``, step ``stride``) followed by a
strided slice for dilation, so 1d, 2d and 3d convolutions share the code; ``padding="same"``,
asymmetric padding and non-zero ``padding_mode`` reach the graph as a pad op *before* the
convolution, so the op's own padding is always symmetric zeros. The batch is never folded into the
convolution's ``groups`` (``B*groups`` is 0 for an empty batch, which ATen rejects). The price is
memory: the patches hold B * Cin * P * K values, the kernel size times the input's.

A transposed convolution is the input-gradient of a convolution, so its weight gradient is the
convolution weight gradient with the roles swapped: ``g`` is unfolded and ``x`` is contracted.
Windows past the end of ``x`` (``output_padding``) are trimmed to ``x``'s spatial size.
"""
from __future__ import annotations

import dataclasses
import math
import operator

import torch

from . import Rule, register
from ..passes.batch import BatchDim

aten = torch.ops.aten

WEIGHT, BIAS = 1, 2


@dataclasses.dataclass(frozen=True)
class ConvArgs:
    """The arguments of one ``convolution_backward`` node, by name."""
    grad_out: torch.fx.Node
    input: torch.fx.Node
    weight: torch.fx.Node
    stride: list
    padding: list
    dilation: list
    transposed: bool
    groups: int

    @classmethod
    def of(cls, conv_backward: torch.fx.Node) -> "ConvArgs":
        a = conv_backward.args
        return cls(a[0], a[1], a[2], list(a[4]), list(a[5]), list(a[6]), bool(a[7]), a[9])

    @property
    def kernel(self) -> list[int]:
        return [int(k) for k in self.weight.meta["val"].shape[2:]]

    @property
    def image(self) -> torch.fx.Node:
        """The operand whose patches are unfolded: the convolution's input."""
        return self.grad_out if self.transposed else self.input

    @property
    def response(self) -> torch.fx.Node:
        """The operand contracted against the patches: the convolution's output gradient."""
        return self.input if self.transposed else self.grad_out


def _constants_ok(args: ConvArgs) -> str | None:
    consts = [*args.stride, *args.padding, *args.dilation, args.groups]
    if not all(isinstance(c, int) for c in consts):
        return f"stride, padding, dilation and groups must be ints, got {consts}"
    if any(isinstance(k, torch.SymInt) for k in args.weight.meta["val"].shape):
        return "the weight has a symbolic shape"
    return None


def _plain_batch(node, ctx, what: str) -> str | None:
    lay = ctx.layout(node)
    if not (isinstance(lay, BatchDim) and lay.is_plain and lay.dim == 0):
        return f"the {what} must carry the batch as plain dim 0, its layout is {lay}"
    return None


def check_convolution(node, ctx) -> str | None:
    if node.target is not operator.getitem:
        return "the rule matches the getitem of convolution_backward's output, not the op"
    index = node.args[1]
    if index not in (WEIGHT, BIAS):
        return f"output {index} of convolution_backward is the input gradient, not a parameter's"
    args = ConvArgs.of(node.args[0])
    if index == BIAS:
        return _plain_batch(args.grad_out, ctx, "output gradient")
    return (_constants_ok(args) or _plain_batch(args.grad_out, ctx, "output gradient")
            or _plain_batch(args.input, ctx, "input"))


def _size(ctx, node, dim: int):
    """Size ``dim`` of ``node``: an int, or a SymInt node when the size is symbolic."""
    size = node.meta["val"].shape[dim]
    return ctx.emit(aten.sym_size.int, node, dim) if isinstance(size, torch.SymInt) else int(size)


def _product(ctx, sizes):
    """The product of ints and SymInt nodes, as an int or a SymInt node."""
    out = math.prod(s for s in sizes if isinstance(s, int))
    for node in (s for s in sizes if not isinstance(s, int)):
        out = node if out == 1 else ctx.emit(operator.mul, out, node)
    return out


def _patches(ctx, args: ConvArgs, positions: list):
    """(B, C, *spatial) image -> (B, C, *positions, *kernel): what each output position reads."""
    x, n = args.image, len(args.kernel)
    if any(args.padding):
        pad = [p for p in reversed(args.padding) for _ in range(2)]
        x = ctx.emit(aten.constant_pad_nd.default, x, pad, 0.0)
    for i, (k, s, d) in enumerate(zip(args.kernel, args.stride, args.dilation)):
        x = ctx.emit(aten.unfold.default, x, 2 + i, d * (k - 1) + 1, s)
    for i, (k, d) in enumerate(zip(args.kernel, args.dilation)):
        if d > 1:
            x = ctx.emit(aten.slice.Tensor, x, 2 + n + i, 0, d * (k - 1) + 1, d)
    if args.transposed:
        for i, p in enumerate(positions):
            x = ctx.emit(aten.slice.Tensor, x, 2 + i, 0, p)
    return x


def per_sample_weight(ctx, args: ConvArgs):
    """(B, *weight.shape): bmm over B*groups of the response against the unfolded patches."""
    g, n = args.groups, len(args.kernel)
    c_resp, c_img = (int(c) for c in args.weight.meta["val"].shape[:2])
    batch = ctx.emit.batch_size()
    batch_groups = _product(ctx, [batch, g])
    positions = [_size(ctx, args.response, 2 + i) for i in range(n)]
    num_positions = _product(ctx, positions)
    patches = _patches(ctx, args, positions)
    patches = ctx.emit(aten.view.default, patches,
                       [batch, g, c_img, *positions, *args.kernel])
    perm = [0, 1, *range(3, 3 + n), 2, *range(3 + n, 3 + 2 * n)]
    patches = ctx.emit(aten.permute.default, patches, perm)
    patches = ctx.emit(aten.reshape.default, patches,
                       [batch_groups, num_positions, c_img * math.prod(args.kernel)])
    response = ctx.emit(aten.reshape.default, args.response,
                        [batch_groups, c_resp // g, num_positions])
    grad = ctx.emit(aten.bmm.default, response, patches)
    return ctx.emit(aten.view.default, grad, [batch, c_resp, c_img, *args.kernel])


def per_sample_bias(ctx, args: ConvArgs):
    """(B, C): the output gradient summed over its spatial dims."""
    rank = args.grad_out.meta["val"].dim()
    return ctx.emit(aten.sum.dim_IntList, args.grad_out, list(range(2, rank)), False)


def rewrite_convolution(node, ctx):
    args = ConvArgs.of(node.args[0])
    if node.args[1] == BIAS:
        return per_sample_bias(ctx, args)
    return per_sample_weight(ctx, args)


def _positions(ctx, node):
    """The number of spatial positions of ``node``, a sympy expression."""
    return math.prod(ctx.analysis.shape(node.meta["val"])[2:])


def cost_convolution(node, ctx) -> dict:
    args = ConvArgs.of(node.args[0])
    batch = ctx.analysis.batch
    if node.args[1] == BIAS:
        channels = int(args.grad_out.meta["val"].shape[1])
        return {"form": f"sum of [B, {channels}, ...] over its spatial dims",
                "flops": batch * channels * _positions(ctx, args.grad_out),
                "memory": batch * channels}
    g, k, p = args.groups, math.prod(args.kernel), _positions(ctx, args.response)
    c_resp, c_img = (int(c) for c in args.weight.meta["val"].shape[:2])
    return {
        "form": f"bmm([B*{g}, {c_resp // g}, {p}], unfold to [B*{g}, {p}, {c_img * k}])",
        "flops": 2 * batch * c_resp * c_img * k * p,
        "memory": batch * g * c_img * k * p + batch * c_resp * c_img * k,
    }


CONVOLUTION = register(Rule("convolution", (aten.convolution_backward.default,),
                            check_convolution, rewrite_convolution, cost_convolution))
