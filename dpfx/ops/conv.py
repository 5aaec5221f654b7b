"""The per-sample convolution kernels: ``dpfx::im2col``, ``dpfx::conv2d_per_sample_grad`` and
``dpfx::conv2d_input_grad``, each with its fake kernel.

    patches = torch.ops.dpfx.im2col(image, [3, 3], [1, 1], [1, 1], [1, 1])       # as aten.im2col
    grads = torch.ops.dpfx.conv2d_per_sample_grad(response, image, [3, 3], [1, 1], [1, 1], [1, 1], 1)
                                                   # (B*groups, C_out/g, C_in/g * 9)

The rule that emits them is rules/convolution.py; the C kernels are csrc/im2col.c and
csrc/transpose.c (ops/native.py).
"""
from __future__ import annotations

import math

import torch

from dpfx.ops import native

aten = torch.ops.aten


# Note [Patches by dpfx::im2col]
# Inductor compiles the unfold views above into a gather whose innermost loop runs over one row's
# output positions with masked vectors and int64 index arithmetic for the padding, several times
# slower than an im2col kernel. So 2-D convolutions (the shape im2col covers) take their patches
# from ``dpfx::im2col``, an opaque op that Inductor calls as an extern kernel; 1-D/3-D and
# transposed convolutions keep the views. On CPU the op runs dpfx's own kernel (csrc/im2col.c, via
# ops/native.py): ATen's loops over the examples serially and tests bounds at every pixel, while
# dpfx's splits the image planes across threads, lays each plane out once as its zero-padded stride
# phases, and copies every kernel tap's window from one phase without tests or per-pixel index
# arithmetic (figures: BENCHMARKS.md, "Levers in the code"). Every output is a copy or a zero, so it
# equals ATen's bit for bit (tests/rules/test_rule_convolution.py compares them over random
# geometry); other dtypes, devices and ranks, or no C compiler, run ATen's kernel. The op maps
# example i's image to example i's patches only: the batch analysis carries dim 0 through it, and
# the self-check compares the compiled graph with eager execution as for every other op.
_LIBRARY = torch.library.Library("dpfx", "FRAGMENT")
_LIBRARY.define("im2col(Tensor image, int[] kernel, int[] dilation, int[] padding, int[] stride)"
                " -> Tensor")


def _im2col(image, kernel, dilation, padding, stride):
    kernel_fn = _NATIVE_IM2COL.get(image.dtype) if image.device.type == "cpu" else None
    lib = native.library() if kernel_fn else None
    if lib is None or image.dim() != 4:
        return aten.im2col.default(image, kernel, dilation, padding, stride)
    out = image.new_empty(_im2col_shape(image, kernel, dilation, padding, stride))
    if out.numel():
        image = image.contiguous()
        b, c, h, w = image.shape
        oh, ow = ((size + 2 * p - d * (k - 1) - 1) // s + 1 for size, k, d, p, s
                  in zip((h, w), kernel, dilation, padding, stride))
        threads = torch.get_num_threads()
        # each thread's zero-padded stride phases of one image plane (csrc/im2col.c)
        phases = math.prod(-(-(size + 2 * p) // s) * s
                           for size, p, s in zip((h, w), padding, stride))
        scratch = image.new_empty(threads * phases)
        getattr(lib, kernel_fn)(image.data_ptr(), out.data_ptr(), b, c, h, w, *kernel, *dilation,
                                *padding, *stride, oh, ow, scratch.data_ptr(), threads)
    return out


_NATIVE_IM2COL = {torch.float32: "dpfx_im2col_f32", torch.float64: "dpfx_im2col_f64"}


_LIBRARY.impl("im2col", _im2col, "CompositeExplicitAutograd")


@torch.library.register_fake("dpfx::im2col", lib=_LIBRARY)
def _im2col_shape_only(image, kernel, dilation, padding, stride):
    return image.new_empty(_im2col_shape(image, kernel, dilation, padding, stride))


def _im2col_shape(image, kernel, dilation, padding, stride) -> list:
    """(B, C * K, P): the patches of each output position as columns."""
    positions = [(size + 2 * p - d * (k - 1) - 1) // s + 1
                 for size, k, d, p, s in zip(image.shape[2:], kernel, dilation, padding, stride)]
    return [image.shape[0], image.shape[1] * math.prod(kernel), math.prod(positions)]


# Note [Per-sample conv2d gradients in chunks of examples]
# Building every example's patches, then taking one bmm, holds B * C_img * K * P values of
# patches, the kernel size times the input, beside the per-sample gradients they produce.
# ``dpfx::conv2d_per_sample_grad`` fuses the two: it unfolds chunks of whole examples of at most
# _CHUNK_BYTES of patches (at least one example; equal chunks) and writes each chunk's products
# straight into the (B*groups, C_resp/g, C_img/g*K) output, so the patches do not grow with B
# and each chunk is read back while still in cache. On CPU a chunk is 1 MiB: the op's inputs
# stay alive until it returns, where the two ops it replaces freed the image after the unfold,
# so a larger chunk raises the step's memory peak, and a chunk far larger than the caches is
# slower. A chunk of one or two examples leaves each bmm too few GEMMs to share between the
# threads, so a chunk holds at least _CHUNK_MIN_EXAMPLES examples while their patches stay under
# _CHUNK_BYTES_MAX; larger examples keep their 1 MiB chunks (a few of them in one larger chunk
# ran slower than one by one). A small layer (one chunk) pays one op dispatch. Figures:
# BENCHMARKS.md, "Levers in the code".
# Example i's output reads example i's image and response only (the batch analysis carries dim
# 0 through it as through bmm; the self-check compares the compiled graph with eager).
# (tests/rules/test_rule_convolution.py::test_per_sample_conv2d_grad_in_chunks,
# test_examples_per_chunk)
_CHUNK_BYTES = 1 << 20              # CPU: a chunk's patches stay in the cores' caches
_CHUNK_MIN_EXAMPLES = 8             # CPU: at least this many examples in a chunk where
_CHUNK_BYTES_MAX = 4 << 20          # their patches stay under this
_CHUNK_BYTES_ACCELERATOR = 64 << 20  # GPU: fewer, larger launches; still bounded in B
_LIBRARY.define("conv2d_per_sample_grad(Tensor response, Tensor image, int[] kernel, "
                "int[] dilation, int[] padding, int[] stride, int groups) -> Tensor")


def _conv2d_per_sample_grad(response, image, kernel, dilation, padding, stride, groups):
    out = response.new_empty(_conv2d_per_sample_grad_shape(response, image, kernel, groups))
    batch = image.shape[0]
    if out.numel() == 0:
        return out
    # (C*K, P) patches per example
    chunk = _examples_per_chunk(batch, image.element_size() * out.shape[2] * groups
                                * response.shape[2], image.device.type)
    # See Note [The per-sample conv2d product's orientation]
    swapped = _TRANSPOSED_PRODUCT and image.device.type == "cpu" \
        and out.shape[1] < min(32, out.shape[2])
    scratch = out.new_empty(chunk * groups, out.shape[2], out.shape[1]) if swapped else None
    for start in range(0, batch, chunk):
        stop = min(batch, start + chunk)
        patches = _im2col(image[start:stop], kernel, dilation, padding, stride)
        patches = patches.view((stop - start) * groups, out.shape[2], patches.shape[-1])
        rows = slice(start * groups, stop * groups)
        if swapped:
            products = scratch[:(stop - start) * groups]
            torch.bmm(patches, response[rows].transpose(1, 2), out=products)
            _transpose_into(products, out[rows])
        else:
            torch.bmm(response[rows], patches.transpose(1, 2), out=out[rows])
        del patches     # before the next chunk's: one chunk of patches alive at a time
    return out


def _examples_per_chunk(batch: int, per_example: int, device_type: str) -> int:
    """Note [Per-sample conv2d gradients in chunks of examples]: as many examples as
    _CHUNK_BYTES of patches hold, and on CPU at least _CHUNK_MIN_EXAMPLES while their patches
    stay under _CHUNK_BYTES_MAX; at least one; then equal chunks, so no small last one."""
    if device_type == "cpu":
        chunk = max(1, _CHUNK_BYTES // per_example,
                    min(_CHUNK_MIN_EXAMPLES, _CHUNK_BYTES_MAX // per_example))
    else:
        chunk = max(1, _CHUNK_BYTES_ACCELERATOR // per_example)
    return -(-batch // -(-batch // chunk))


# Note [The per-sample conv2d product's orientation]
# Example i's product is G_i U_i^T: the response G_i (C_resp, P) against the patches U_i (C*K, P),
# contracted over the P positions. With few output channels MKL's batched GEMM runs that shape
# far below the machine's peak, and the transposed product U_i G_i^T, the same flops as
# (C*K, P) x (P, C_resp), runs faster. So where C_resp < 32 and C_resp < C*K each chunk's
# products are taken transposed into a scratch buffer of one chunk, still in cache, and dpfx's
# transpose kernel (csrc/transpose.c) writes them back into the output, whose layout does not
# change: the graph's consumers (the norm, the clipped sum) read it as before. Returning the
# transposed layout would make those Inductor kernels read across strides, which costs more than
# the product saves; wider responses keep one orientation, where the transposed form is no
# faster. The values are the same products up to the GEMM's rounding. CPU only: the choice
# follows MKL's kernels; accelerators keep one orientation. Figures: BENCHMARKS.md, "Levers in
# the code".
# (tests/rules/test_rule_convolution.py::test_per_sample_conv2d_grad_in_chunks)
_TRANSPOSED_PRODUCT = True     # benchmarks/conv_product.py --orientation switches it off


def _transpose_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[i] = src[i].T`` for contiguous 3-D ``src`` and ``dst``: dpfx's transpose kernel
    (csrc/transpose.c) where it applies, else ATen's copy."""
    kernel_fn = _NATIVE_TRANSPOSE.get(src.dtype) if src.device.type == "cpu" else None
    lib = native.library() if kernel_fn else None
    if lib is None:
        dst.copy_(src.transpose(1, 2))
        return
    b, rows, cols = src.shape
    getattr(lib, kernel_fn)(src.data_ptr(), dst.data_ptr(), b, rows, cols, torch.get_num_threads())


def _conv2d_per_sample_grad_shape(response, image, kernel, groups) -> list:
    return [response.shape[0], response.shape[1], image.shape[1] // groups * math.prod(kernel)]


_LIBRARY.impl("conv2d_per_sample_grad", _conv2d_per_sample_grad, "CompositeExplicitAutograd")


@torch.library.register_fake("dpfx::conv2d_per_sample_grad", lib=_LIBRARY)
def _conv2d_per_sample_grad_fake(response, image, kernel, dilation, padding, stride, groups):
    return response.new_empty(_conv2d_per_sample_grad_shape(response, image, kernel, groups))


# Note [Conv2d input gradients in channels-last]
# dpfx's graphs keep a convolution's tensors in NCHW: with the batch unbacked, torch traces a
# convolution of a channels-last tensor as returning a contiguous one while the kernel returns
# channels-last (so such inputs are refused, passes/__init__.py), and Inductor's layout optimization
# miscompiles then (lower/inductor.py). On CPU, ATen's oneDNN convolution_backward with NCHW
# operands converts them to channels-last, computes, and converts its result back through an extra
# copy, which makes an input gradient a DP step's memory peak on small CNNs.
# ``dpfx::conv2d_input_grad`` computes the same gradient as the transposed convolution of the output
# gradient (which needs the input's shape only) with the output gradient converted to channels-last
# first, one copy of the smaller tensor, and returns it in NCHW: a lower peak in the same time. The
# two layout changes are dpfx's transpose kernel (csrc/transpose.c: tiles of each example's (C, H*W)
# matrix across threads), faster than ATen's copies. The result is NCHW rather than channels-last:
# that would save the last copy, but the GroupNorm backward kernel Inductor fuses after it would
# read it across the channel stride, which costs more than the copy. Figures: BENCHMARKS.md, "Levers
# in the code". The result is always contiguous, as its fake kernel says (a kernel that already
# returns NCHW, as ATen's slow paths for some geometries and dtypes do, costs no copy).
# ``compile_backward`` routes the input-gradient-only convolution_backward calls of 2-D float32 CPU
# convolutions through it (``_input_gradients_channels_last``). Example i's gradient reads example
# i's output gradient only, as for the op it replaces: the batch analysis carries dim 0 through it
# and the self-check compares the compiled graph with eager execution.
# (tests/rules/test_rule_convolution.py::test_conv2d_input_grad_*)
_LIBRARY.define("conv2d_input_grad(Tensor grad_output, Tensor input, Tensor weight, "
                "int[] stride, int[] padding, int[] dilation, int groups) -> Tensor")


def _conv2d_input_grad(grad_output, input, weight, stride, padding, dilation, groups):
    size = input.shape
    # the transposed convolution's output_padding that gives back the input's size (in
    # [0, stride) whenever the forward convolution was valid)
    extra = [size[2 + i] - ((grad_output.shape[2 + i] - 1) * stride[i] - 2 * padding[i]
                            + dilation[i] * (weight.shape[2 + i] - 1) + 1) for i in range(2)]
    grad = torch.nn.functional.conv_transpose2d(
        _in_layout(grad_output, torch.channels_last), weight, None, stride, padding, extra,
        groups, dilation)
    return _in_layout(grad, torch.contiguous_format)


def _in_layout(x, memory_format):
    """4-D ``x`` in ``memory_format`` (contiguous or channels-last): between the two, by dpfx's
    transpose kernel (csrc/transpose.c) where it applies, else by ATen's copy."""
    if x.is_contiguous(memory_format=memory_format):
        return x
    to_channels_last = memory_format == torch.channels_last
    source = torch.contiguous_format if to_channels_last else torch.channels_last
    kernel_fn = _NATIVE_TRANSPOSE.get(x.dtype) if x.device.type == "cpu" else None
    lib = native.library() if kernel_fn else None
    if lib is None or not x.is_contiguous(memory_format=source):
        return x.contiguous(memory_format=memory_format)
    out = torch.empty(x.shape, dtype=x.dtype, memory_format=memory_format)
    b, c, h, w = x.shape
    # NCHW -> NHWC transposes each example's (C, H*W) matrix, NHWC -> NCHW its (H*W, C)
    rows, cols = (c, h * w) if to_channels_last else (h * w, c)
    if out.numel():
        getattr(lib, kernel_fn)(x.data_ptr(), out.data_ptr(), b, rows, cols,
                                torch.get_num_threads())
    return out


_NATIVE_TRANSPOSE = {torch.float32: "dpfx_transpose_f32", torch.float64: "dpfx_transpose_f64"}


_LIBRARY.impl("conv2d_input_grad", _conv2d_input_grad, "CompositeExplicitAutograd")


@torch.library.register_fake("dpfx::conv2d_input_grad", lib=_LIBRARY)
def _conv2d_input_grad_fake(grad_output, input, weight, stride, padding, dilation, groups):
    return grad_output.new_empty(input.shape)
