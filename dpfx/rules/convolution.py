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

with P the number of output positions and K the kernel size, as one ``bmm`` over B*groups. A 2-D
convolution's patches come from dpfx::im2col (Note [Patches by dpfx::im2col] in ops/conv.py); otherwise unfold
is ``aten.unfold`` once per spatial dim (window ``dilation*(k-1)+1``, step ``stride``) followed by a
strided slice for dilation, so 1d, 2d and 3d convolutions share the code; ``padding="same"``,
asymmetric padding and non-zero ``padding_mode`` reach the graph as a pad op *before* the
convolution, so the op's own padding is always symmetric zeros. The batch is never folded into the
convolution's ``groups`` (``B*groups`` is 0 for an empty batch, which ATen rejects). The price is
memory: the patches hold B * Cin * P * K values, the kernel size times the input's.

Strategies: the per-sample form above ("materialize") holds B * Cout * Cin/groups * K values. The
ghost form (``ghost_convolution``) takes example i's squared norm from the same operands, as
``<U_i U_i^T, G_i^T G_i>`` with two (P, P) Gram matrices or directly as ``|G_i U_i|^2``, whichever
holds fewer values, and the clipped sum as the op's own weight gradient of the clip-scaled output
gradient; "auto" takes it where it is also faster (Note [When auto takes the conv ghost]).

A transposed convolution is the input-gradient of a convolution, so its weight gradient is the
convolution weight gradient with the roles swapped: ``g`` is unfolded and ``x`` is contracted.
Windows past the end of ``x`` (``output_padding``) are trimmed to ``x``'s spatial size.
"""
from __future__ import annotations

import dataclasses
import math
import operator

import torch

from dpfx.rules.registry import Ghost, Rule, at_least_float32, at_nominal, register
import dpfx.ops  # noqa: F401  (registers the dpfx:: ops the rule emits)
from dpfx.graph.batch import BatchDim

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
        n = a[2].meta["val"].dim() - 2

        def per_dim(values):    # ATen expands a one-element list (padding="valid" gives [0])
            values = list(values)
            return values * n if len(values) == 1 else values
        return cls(a[0], a[1], a[2], per_dim(a[4]), per_dim(a[5]), per_dim(a[6]), bool(a[7]),
                   a[9])

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


def _batch_rows(node, ctx, what: str) -> str | None:
    """None if ``node`` carries the batch in dim 0 as B or as B*K batch-major rows (Note [A
    convolution over K rows per example]), else the reason."""
    lay = ctx.layout(node)
    if not (isinstance(lay, BatchDim) and lay.dim == 0 and lay.outer == 1):
        return (f"the {what} must carry the batch in dim 0 (B, or B*K with each example's K rows "
                f"together), its layout is {lay}")
    return None


def _same_rows(args: "ConvArgs", ctx) -> str | None:
    a, b = ctx.layout(args.grad_out), ctx.layout(args.input)
    if a != b:
        return f"the output gradient's batch layout {a} is not the input's {b}"
    return None


# Note [A convolution over K rows per example]
# A model that flattens K views of each example into the batch dim before a convolution
# (augmentation multiplicity: (B, K, C, H, W) -> (B*K, C, H, W), De et al. 2022) runs the
# convolution on B*K rows, example b owning rows [b K, (b + 1) K) (the batch analysis proves that
# layout, BatchDim(0, inner=K), through the flatten). Example b's weight gradient is the sum of
# its K rows' gradients, so the per-sample product is taken per row, over the B*K rows, and
# summed over each example's K rows: (B*K*groups, ...) -> (B, K, *weight.shape) -> sum(1). The
# bias likewise sums each example's rows and positions. A view-major K*B (outer != 1) and
# operands with different layouts are refused; the ghost form is not offered (its Grams would
# have to span K*P positions), so these convolutions materialize.
# (tests/graph/test_merged_batch.py::test_augmentation_multiplicity)
def _rows_per_example(ctx, args: "ConvArgs"):
    """K, the rows of dim 0 each example owns (1 for a plain batch), a sympy expression."""
    lay = ctx.layout(args.grad_out)
    return lay.inner if isinstance(lay, BatchDim) else 1


def _rows(ctx, args: "ConvArgs"):
    """The number of rows of dim 0, B*K, as an int or a SymInt node."""
    return ctx.emit.size(ctx.analysis.batch * _rows_per_example(ctx, args))


def check_convolution(node, ctx) -> str | None:
    if node.target is not operator.getitem:
        return "the rule matches the getitem of convolution_backward's output, not the op"
    index = node.args[1]
    if index not in (WEIGHT, BIAS):
        return f"output {index} of convolution_backward is the input gradient, not a parameter's"
    args = ConvArgs.of(node.args[0])
    if index == BIAS:
        return _batch_rows(args.grad_out, ctx, "output gradient")
    return (_constants_ok(args) or _batch_rows(args.grad_out, ctx, "output gradient")
            or _batch_rows(args.input, ctx, "input") or _same_rows(args, ctx))


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


def _per_sample_product(ctx, args: ConvArgs):
    """(B*groups, C_resp/g, C_img/g * K): each example's (and group's) weight gradient."""
    if len(args.kernel) == 2 and not args.transposed:
        # Note [Per-sample conv2d gradients in chunks of examples] in ops/conv.py
        response = _response(ctx, args)
        return ctx.emit(torch.ops.dpfx.conv2d_per_sample_grad.default, response, args.image,
                        args.kernel, args.dilation, args.padding, args.stride, args.groups)
    response, patches = _unfolded(ctx, args)
    return ctx.emit(aten.bmm.default, response, patches)


def _response(ctx, args: ConvArgs):
    """The response as (B*K*groups, C_resp/groups, P)."""
    g, n = args.groups, len(args.kernel)
    c_resp = int(args.weight.meta["val"].shape[0])
    batch_groups = _product(ctx, [_rows(ctx, args), g])
    num_positions = _product(ctx, [_size(ctx, args.response, 2 + i) for i in range(n)])
    return ctx.emit(aten.reshape.default, args.response, [batch_groups, c_resp // g, num_positions])


def _unfolded(ctx, args: ConvArgs):
    """The two operands of the per-sample product, groups folded into the rows:
    response (B*groups, C_resp/groups, P) and patches (B*groups, P, C_img/groups * K), B*K rows
    in place of B for K rows per example."""
    g, n = args.groups, len(args.kernel)
    c_img = int(args.weight.meta["val"].shape[1])
    batch = _rows(ctx, args)
    batch_groups = _product(ctx, [batch, g])
    positions = [_size(ctx, args.response, 2 + i) for i in range(n)]
    num_positions = _product(ctx, positions)
    response = _response(ctx, args)
    if n == 2 and not args.transposed:     # Note [Patches by dpfx::im2col] in ops/conv.py
        patches = ctx.emit(torch.ops.dpfx.im2col.default, args.image, args.kernel,
                           args.dilation, args.padding, args.stride)
        if g > 1:
            patches = ctx.emit(aten.reshape.default, patches,
                               [batch_groups, c_img * math.prod(args.kernel), num_positions])
        return response, ctx.emit(aten.permute.default, patches, [0, 2, 1])
    patches = _patches(ctx, args, positions)
    patches = ctx.emit(aten.view.default, patches,
                       [batch, g, c_img, *positions, *args.kernel])
    # Positions last: the copy reads rows of the image, and bmm takes the transposed operand
    # as strides, a faster bmm than the transposed copy's.
    perm = [0, 1, 2, *range(3 + n, 3 + 2 * n), *range(3, 3 + n)]
    patches = ctx.emit(aten.permute.default, patches, perm)
    patches = ctx.emit(aten.reshape.default, patches,
                       [batch_groups, c_img * math.prod(args.kernel), num_positions])
    return response, ctx.emit(aten.permute.default, patches, [0, 2, 1])


def per_sample_weight(ctx, args: ConvArgs):
    """(B, *weight.shape): bmm over B*groups of the response against the unfolded patches,
    summed over each example's rows (Note [A convolution over K rows per example])."""
    c_resp, c_img = (int(c) for c in args.weight.meta["val"].shape[:2])
    grad = _per_sample_product(ctx, args)
    rows = _rows_per_example(ctx, args)
    if rows == 1:
        return ctx.emit(aten.view.default, grad,
                        [ctx.emit.batch_size(), c_resp, c_img, *args.kernel])
    grad = ctx.emit(aten.view.default, grad, [ctx.emit.batch_size(), ctx.emit.size(rows), c_resp,
                                              c_img, *args.kernel])
    return ctx.emit(aten.sum.dim_IntList, grad, [1], False)


def per_sample_bias(ctx, args: ConvArgs):
    """(B, C): the output gradient summed over its spatial dims (and each example's rows)."""
    rank = args.grad_out.meta["val"].dim()
    lay = ctx.layout(args.grad_out)
    if lay.is_plain:
        return ctx.emit(aten.sum.dim_IntList, args.grad_out, list(range(2, rank)), False)
    front = ctx.emit.batch_to_front(args.grad_out, lay)    # (B, K, C, *spatial)
    return ctx.emit(aten.sum.dim_IntList, front, [1, *range(3, rank + 1)], False)


def rewrite_convolution(node, ctx):
    args = ConvArgs.of(node.args[0])
    if node.args[1] == BIAS:
        return per_sample_bias(ctx, args)
    return per_sample_weight(ctx, args)


def _positions(ctx, node):
    """The number of spatial positions of ``node``, a sympy expression."""
    return math.prod(ctx.analysis.shape(node.meta["val"])[2:])


def _gram_terms(ctx, args: ConvArgs):
    """Per example: (P, the weight's size C_resp * C_img/g * K)."""
    c_resp, c_img = (int(c) for c in args.weight.meta["val"].shape[:2])
    return _positions(ctx, args.response), c_resp * c_img * math.prod(args.kernel)


def _gram_is_smaller(ctx, args: ConvArgs) -> bool:
    """The ghost norm's form: the two (P, P) Gram matrices of every group hold fewer values than
    the per-sample gradient it would otherwise build."""
    p, weight = _gram_terms(ctx, args)
    return at_nominal(2 * args.groups * p * p) < weight


def _gram_pays_off(ctx, args: ConvArgs) -> bool:
    """The Gram matrices cost no more flops than the per-sample product they replace. The
    book-keeping product has the per-sample product's flops (both contract over B*P), so where
    this fails the ghost form does the work twice (Note [When auto takes the conv ghost])."""
    p, weight = _gram_terms(ctx, args)
    c_resp, c_img = (int(c) for c in args.weight.meta["val"].shape[:2])
    gram = args.groups * p * p * (c_img * math.prod(args.kernel) + c_resp // args.groups)
    return at_nominal(gram - weight * p) <= 0


def cost_convolution(node, ctx) -> dict:
    args = ConvArgs.of(node.args[0])
    batch = ctx.analysis.batch * _rows_per_example(ctx, args)   # the rows the product runs over
    if node.args[1] == BIAS:
        channels = int(args.grad_out.meta["val"].shape[1])
        return {"form": f"sum of [B, {channels}, ...] over its spatial dims",
                "flops": batch * channels * _positions(ctx, args.grad_out),
                "memory": batch * channels}
    g, k, p = args.groups, math.prod(args.kernel), _positions(ctx, args.response)
    c_resp, c_img = (int(c) for c in args.weight.meta["val"].shape[:2])
    patches = batch * g * c_img * k * p
    # Note [Per-sample conv2d gradients in chunks of examples]: a 2-D product holds the patches
    # of one chunk of examples at a time, a bound that does not grow with B.
    chunked = len(args.kernel) == 2 and not args.transposed
    product_patches = 0 if chunked else patches
    product = 2 * batch * c_resp * c_img * k * p   # the book-keeping product's flops too
    if _gram_is_smaller(ctx, args):
        ghost_form = f"<Gram [B*{g}, {p}, {p}], Gram [B*{g}, {p}, {p}]>"
        ghost_flops = 2 * batch * g * p * p * (c_img * k + c_resp // g)
        ghost_memory = patches + 2 * batch * g * p * p
    else:
        ghost_form = f"|bmm([B*{g}, {c_resp // g}, {p}], [B*{g}, {p}, {c_img * k}])|^2"
        ghost_flops = product
        ghost_memory = product_patches + batch * c_resp * c_img * k
    form = f"bmm([B*{g}, {c_resp // g}, {p}], unfold to [B*{g}, {p}, {c_img * k}])"
    return {
        "form": form + (" in chunks of examples" if chunked else ""),
        "flops": product,
        "memory": product_patches + batch * c_resp * c_img * k,
        "ghost_form": ghost_form + " + convolution_backward(c * grad_out)",
        "ghost_flops": ghost_flops + product,
        # the book-keeping product reads a clip-scaled copy of the response: B * C_resp * P
        "ghost_memory": ghost_memory + batch * c_resp * p,
    }


# Note [When auto takes the conv ghost]
# A convolution's per-sample product (B*groups small bmm's over P positions) and the
# book-keeping product (one convolution_backward over B*P) cost the same flops, so the ghost form
# adds its Gram matrices' flops and saves only the (B, *weight.shape) tensor's memory traffic.
# That pays where P is small against the channels (late layers), not where the image is large
# (figures: BENCHMARKS.md, "Levers in the code"). So under "auto" the ghost form is offered only
# where the Gram flops are at most the per-sample product's; strategy="ghost" takes it
# everywhere.
# (tests/rules/test_rule_convolution.py::test_auto_takes_the_ghost_where_it_pays)
def check_ghost_convolution(node, ctx) -> str | None:
    if node.args[1] == BIAS:
        return "the bias gradient is a sum over positions; its per-sample form is only (B, C)"
    if _rows_per_example(ctx, ConvArgs.of(node.args[0])) != 1:
        return "each example owns several rows (Note [A convolution over K rows per example])"
    if ctx.strategy == "auto" and not _gram_pays_off(ctx, ConvArgs.of(node.args[0])):
        return "the Gram matrices would cost more flops than the per-sample product"
    return None


def ghost_convolution(node, ctx) -> Ghost:
    """Example i's squared weight-gradient norm without the (B, *weight.shape) tensor. Per group,
    the gradient is G_i U_i with G_i (C_resp/g, P) the response and U_i (P, C_img/g * K) the
    unfolded patches, so ||G_i U_i||_F^2 = <U_i U_i^T, G_i^T G_i>, two (P, P) Gram matrices over
    the output positions (Goodfellow 2015, Li et al. 2022). Where P^2 is larger than the weight
    (early layers on big images) the norm is taken of G_i U_i directly. The clipped sum is the
    op's own weight gradient with each example's output gradient scaled by its clip coefficient
    (book-keeping, Bu et al. 2023), so no second backward runs."""
    emit = ctx.emit
    cb = node.args[0]
    args = ConvArgs.of(cb)
    batch = emit.batch_size()
    if _gram_is_smaller(ctx, args):
        response, patches = _unfolded(ctx, args)
        gram_img = emit(aten.bmm.default, patches, emit(aten.permute.default, patches, [0, 2, 1]))
        gram_resp = emit(aten.bmm.default, emit(aten.permute.default, response, [0, 2, 1]),
                         response)
        per_group = emit(aten.sum.dim_IntList, emit(aten.mul.Tensor, gram_img, gram_resp), [1, 2])
    else:
        grad = _per_sample_product(ctx, args)
        per_group = emit(aten.sum.dim_IntList, emit(aten.mul.Tensor, grad, grad), [1, 2])
    norm_sq = emit(aten.view.default, per_group, [batch, args.groups])
    norm_sq = emit(aten.sum.dim_IntList, norm_sq, [1])

    def clipped_sum(clip):
        scaled = clip.scale(emit, args.grad_out, ctx.layout(args.grad_out))
        cb_args = list(cb.args)
        scaled, image, cb_args[2] = at_least_float32(emit, scaled, cb.args[1], cb.args[2])
        cb_args[1] = clip.mask(emit, image, ctx.layout(cb.args[1]))
        cb_args[0], cb_args[3], cb_args[10] = scaled, None, [False, True, False]
        weight_grad = emit(aten.convolution_backward.default, *cb_args, tag="clipped_sum")
        return emit(operator.getitem, weight_grad, WEIGHT)

    return Ghost(norm_sq, clipped_sum)


CONVOLUTION = register(Rule("convolution", (aten.convolution_backward.default,),
                            check_convolution, rewrite_convolution, cost_convolution,
                            ghost=ghost_convolution, ghost_check=check_ghost_convolution))
