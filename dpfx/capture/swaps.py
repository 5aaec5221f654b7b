"""Stand-ins for the few torch functions that cannot be traced with a symbolic batch size.

dpfx keeps the batch an unbacked symbol (Note [Why the batch dim is marked unbacked] in capture/entry.py),
and a handful of torch's Python-level functions branch on sizes that contain it. While dpfx
captures a model, ``Swaps`` swaps them for versions with the same result that do not
branch on the batch:

- ``F._verify_batch_size`` (BatchNorm/GroupNorm/InstanceNorm's "more than one value per channel"
  check): skipped for symbolic sizes. With B = 1 and one value per group, GroupNorm then returns
  zeros where eager torch would raise.
- ``F.instance_norm`` without running statistics: written out as var_mean over the spatial dims
  (torch's own runs batch_norm on a (1, B*C, ...) view, whose kernel tests numel() == 0).
- ``F.batch_norm`` in eval mode and ``F.instance_norm`` with running statistics (eval mode,
  ``track_running_stats=True``): ``(x - running_mean) / sqrt(running_var + eps)`` and the affine,
  per example, since the frozen statistics mix nothing (torch's kernel tests numel() == 0).
  Modes that mix the batch are refused before capture (``capture/modules.py``).
- ``torch.roll``/``Tensor.roll`` over dims without the batch: the two slices concatenated (torch's
  tests numel() == 0). A roll over the batch dim moves one example's values into another's
  output: refused with a ``PrivacyError`` naming the model's line (Note [Refusals raised while
  capturing] in capture/errors.py).
- ``F.bilinear`` (``nn.Bilinear``): written as one matmul and a broadcast product (torch's meta
  function for ``_trilinear`` fails with a symbolic batch); the weight's gradient is then an
  ``mm`` and the bias's a sum, both with rules.
- ``Tensor.view``/``Tensor.reshape`` as ``x.view(x.shape[0], -1)``: the -1 is written out as the
  product of the static dims, since torch's size inference divides by the batch and asserts at
  run time that it is not 0 (which fails every empty Poisson batch; seen in GPT-2's mask code).
- ``F.embedding_bag`` on a (B, L) input (``nn.EmbeddingBag``, one bag per example): an embedding
  lookup and the bag's sum / mean / max over non-padding entries, so the table's gradient is an
  ordinary embedding gradient with a rule (torch's kernel's ``offset2bag`` bookkeeping has no
  provable batch layout). The 1-D input + offsets form is left as is and refused.
- ``Tensor.repeat`` with a symbolic count (MultiheadAttention's add_bias_kv repeats bias_k over the
  batch): reshape -> expand -> reshape, since repeat's backward tests each count against 0.
- ``F.linear`` with one input feature on an input that needs a gradient (a Linear after a width-1
  hidden layer, after a one-channel conv with a 1x1 output): the broadcast product
  ``input * weight.squeeze(1)``, since mm's backward tests the (B, 1) input's strides against
  the batch.

- ``F.conv2d``/``F.conv3d`` (and transposed), ``F.avg_pool*``/``F.max_pool*`` and the adaptive
  pools: on a 4-D/5-D input, ``input.contiguous()`` first (Note [Channels-last strides made
  inside the model]).

- dynamo's ``setattr`` on tensors: ``t.requires_grad = True`` inside the forward is skipped
  (``capture/requires_grad_skip.py``: Note [Setting requires_grad inside the forward]).

- ``nn.RNN``/``nn.GRU``/``nn.LSTM``'s ``forward``, ``pack_padded_sequence`` and
  ``pad_packed_sequence``: the recurrence written out step by step in ``F.linear`` and pointwise
  gates, packed batches as padded data and lengths (``dpfx/capture/rnn.py``); dynamo's ``allow_rnn`` is
  set meanwhile, since it refuses to wrap these modules otherwise.

The swaps last only for the duration of a dpfx forward call: all of them while dynamo captures,
and on a steady-state call only those its guards read (Note [Only the swaps the guards read,
between captures]); the cached graphs do not depend on them.
"""
from __future__ import annotations

import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.nn.utils import rnn as rnn_utils

from dpfx.capture import requires_grad_skip, rnn
from dpfx.errors import PrivacyError

_verify_batch_size = F._verify_batch_size
_instance_norm = F.instance_norm
_repeat = torch.Tensor.repeat
_bilinear = F.bilinear
_view = torch.Tensor.view
_embedding_bag = F.embedding_bag
_reshape = torch.Tensor.reshape
_linear = F.linear
_batch_norm = F.batch_norm
_roll = torch.roll
_tensor_roll = torch.Tensor.roll
_rnn_forwards = {cls: cls.forward for cls in (nn.RNN, nn.GRU, nn.LSTM)}


def _verify_batch_size_if_known(size) -> None:
    if any(isinstance(s, torch.SymInt) for s in size):
        return
    _verify_batch_size(size)


def _instance_norm_written_out(input, running_mean=None, running_var=None, weight=None,
                               bias=None, use_input_stats=True, momentum=0.1, eps=1e-5):
    if not use_input_stats and running_mean is not None and running_var is not None:
        return _with_running_stats(input, running_mean, running_var, weight, bias, eps)
    if not use_input_stats or running_mean is not None or running_var is not None:
        return _instance_norm(input, running_mean, running_var, weight, bias, use_input_stats,
                              momentum, eps)
    F._verify_spatial_size(input.size())
    var, mean = torch.var_mean(input, dim=tuple(range(2, input.dim())), unbiased=False,
                               keepdim=True)
    out = (input - mean) * torch.rsqrt(var + eps)
    channel = (1, -1) + (1,) * (input.dim() - 2)
    if weight is not None:
        out = out * weight.view(channel)
    if bias is not None:
        out = out + bias.view(channel)
    return out


def _with_running_stats(input, running_mean, running_var, weight, bias, eps):
    channel = (1, -1) + (1,) * (input.dim() - 2)
    out = (input - running_mean.view(channel)) * torch.rsqrt(running_var.view(channel) + eps)
    if weight is not None:
        out = out * weight.view(channel)
    return out if bias is None else out + bias.view(channel)


def _batch_norm_frozen_stats(input, running_mean, running_var, weight=None, bias=None,
                             training=False, momentum=0.1, eps=1e-5):
    if training or running_mean is None or running_var is None:
        return _batch_norm(input, running_mean, running_var, weight, bias, training, momentum,
                           eps)
    return _with_running_stats(input, running_mean, running_var, weight, bias, eps)


def _roll_checked(input, shifts, dims=None):
    batched = [i for i, s in enumerate(input.shape)
               if isinstance(s, torch.SymInt) and free_unbacked_symbols(s)]
    if not batched:
        return _roll(input, shifts, dims)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims, shifts = (), ()
    shifts = tuple(shifts) if isinstance(shifts, (list, tuple)) else (shifts,)
    dims = tuple(dims) if isinstance(dims, (list, tuple)) else (dims,)
    if not dims or any(d % input.dim() in batched for d in dims):
        raise PrivacyError(
            "torch.roll over the batch dim (or over the flattened tensor) moves one example's "
            "values into another example's output, so each example's gradient depends on the "
            "others and clipping bounds nothing. Roll over the other dims (dims=1, ...), or do "
            "the shift per example in the data pipeline.")
    out = input
    for shift, dim in zip(shifts, dims):
        n = out.shape[dim]
        k = shift % n if n else 0
        if k:
            out = torch.cat([out.narrow(dim, n - k, k), out.narrow(dim, 0, n - k)], dim)
    return out


def _roll_as_method(input, shifts, dims=None):
    # dynamo inlines a Python function found as torch.roll, where sizes are not SymInts yet; a
    # Tensor method runs where they are.
    return input.roll(shifts, dims)


def _repeat_by_expand(self, *sizes):
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple, torch.Size)):
        sizes = tuple(sizes[0])
    if not any(isinstance(s, torch.SymInt) for s in sizes):
        return _repeat(self, *sizes)
    x = self.reshape((1,) * (len(sizes) - self.dim()) + tuple(self.shape))
    split = [v for s in x.shape for v in (1, s)]
    tiled = [v for r, s in zip(sizes, x.shape) for v in (r, s)]
    return x.reshape(split).expand(tiled).reshape([r * s for r, s in zip(sizes, x.shape)])


# Note [A Linear with one input feature]
# torch's backward of mm(mat1, mat2) (mm_mat1_backward in FunctionsManual.cpp) computes mat1's
# gradient column-major when ``mat1.stride(0) == 1 and mat1.stride(1) == mat1.size(0)``. A
# contiguous (B, 1) input has strides (1, 1), so the test is ``1 == B``: Eq(u0, 1), which an
# unbacked batch cannot answer, and capture fails (plain torch.compile too). Only an input that
# needs a gradient reaches that test. With one input feature, F.linear is the broadcast product
# ``input * weight.squeeze(1)`` (+ bias): one product per output, no contraction, so nothing
# tests the batch. The weight's gradient becomes a sum over the batch of grad * input (the
# "sum" rule) instead of an mm, exact per example either way. Inputs that need no gradient (a
# scalar feature fed straight in) keep torch's mm and its ghost form. A raw ``h @ W`` goes
# through no Python function dpfx could swap; torch's size-oblivious answer decides its test
# (capture/batch_branches.py).
# (tests/rules/test_linear.py::test_width_one_hidden_layer_matches_reference,
#  tests/rules/test_rule_convolution.py::test_one_channel_conv_into_linear_matches_reference)
def _linear_one_feature(input, weight, bias=None):
    if weight.dim() != 2 or weight.shape[1] != 1 or not input.requires_grad:
        return _linear(input, weight, bias)
    out = input * weight.squeeze(1)
    return out if bias is None else out + bias


def _bilinear_written_out(input1, input2, weight, bias=None):
    """out[..., o] = sum_ij x1[..., i] W[o, i, j] x2[..., j] + b[o]."""
    out_f, in1, in2 = weight.shape
    h = (input1 @ weight.permute(1, 0, 2).reshape(in1, out_f * in2)).unflatten(-1, (out_f, in2))
    out = (h * input2.unsqueeze(-2)).sum(-1)
    return out if bias is None else out + bias


def _embedding_bag_written_out(input, weight, offsets=None, max_norm=None, norm_type=2.0,
                               scale_grad_by_freq=False, mode="mean", sparse=False,
                               per_sample_weights=None, include_last_offset=False,
                               padding_idx=None):
    """One bag per row of a (B, L) input: an embedding lookup, then the bag's sum, mean or max
    over the non-padding entries (empty bags give zeros, as torch's kernel does)."""
    if (input.dim() != 2 or offsets is not None or max_norm is not None
            or (per_sample_weights is not None and mode != "sum") or mode not in
            ("sum", "mean", "max")):
        return _embedding_bag(input, weight, offsets, max_norm, norm_type, scale_grad_by_freq,
                              mode, sparse, per_sample_weights, include_last_offset, padding_idx)
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    emb = F.embedding(input, weight, None, None, 2.0, scale_grad_by_freq, sparse)   # (B, L, d)
    keep = None if padding_idx is None else (input != padding_idx).unsqueeze(-1)
    if per_sample_weights is not None:
        emb = emb * per_sample_weights.unsqueeze(-1).to(emb.dtype)
    if mode == "max":
        if keep is None:
            return emb.amax(1)
        best = emb.masked_fill(~keep, float("-inf")).amax(1)
        return torch.where(keep.any(1), best, torch.zeros_like(best))
    if keep is not None:
        emb = emb * keep.to(emb.dtype)
    total = emb.sum(1)
    if mode == "sum":
        return total
    if keep is None:
        return total / input.shape[1]
    return total / keep.sum(1).clamp(min=1).to(emb.dtype)


def _same_size(a, b) -> bool:
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return not isinstance(a, torch.SymInt) and not isinstance(b, torch.SymInt) and a == b


def _explicit_sizes(self, sizes):
    """``x.view(x.shape[0], -1, ...)`` with a symbolic batch: the -1 becomes the product of the
    remaining static dims, so torch need not divide by the batch (which adds a runtime assert
    that the batch is not 0, failing every empty Poisson batch)."""
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple, torch.Size)):
        sizes = tuple(sizes[0])
    if (self.dim() == 0 or not isinstance(self.shape[0], torch.SymInt) or -1 not in sizes
            or not sizes or not _same_size(sizes[0], self.shape[0])):
        return sizes
    rest = self.shape[1:]
    known = [s for i, s in enumerate(sizes[1:]) if not (isinstance(s, int) and s == -1)]
    total = 1
    for s in rest:
        total *= s
    given = 1
    for s in known:
        given *= s
    if any(isinstance(s, torch.SymInt) for s in list(rest) + known):
        # other dynamic sizes (a sequence length): the -1 only where sympy divides them exactly
        # (48 * s1 / (16 * s1) = 3), never asking the shape environment a question
        total_e, given_e = (sympy.sympify(t.node.expr if isinstance(t, torch.SymInt) else t)
                            for t in (total, given))
        if given_e == 0:
            return sizes
        quotient = sympy.cancel(total_e / given_e)
        if quotient.is_Integer:
            fill = int(quotient)
        elif given_e == 1:
            fill = total                    # x.view(B, -1) over (B, T, C): T * C
        else:
            return sizes
        return tuple(fill if (isinstance(s, int) and s == -1) else s for s in sizes)
    if given == 0 or total % given:
        return sizes
    return tuple(total // given if (isinstance(s, int) and s == -1) else s for s in sizes)


def _view_explicit(self, *sizes):
    if sizes and isinstance(sizes[0], torch.dtype):
        return _view(self, *sizes)
    return _view(self, _explicit_sizes(self, sizes))


def _reshape_explicit(self, *sizes):
    return _reshape(self, _explicit_sizes(self, sizes))


# Note [Channels-last strides made inside the model]
# A model that permutes inside its blocks (HF ConvNeXt: dwconv, permute to (B, H, W, C),
# LayerNorm and Linear layers, permute back) hands the next convolution or pooling a tensor with
# channels-last strides. ATen's kernels for those return channels-last outputs for such inputs,
# but with the batch an unbacked symbol torch's shape functions trace them as contiguous, so the
# graph's next view fails on real tensors (in the eager backend and in the self-check's
# reference run) and the convolution would be refused (Note [Channels-last convolutions are
# refused] in passes/__init__.py). During capture these functions read ``input.contiguous()``
# instead: the same values, and on a 4-D or 5-D input that is not contiguous one ``clone`` in
# the graph, an elementwise copy that the batch analysis carries the layout through and the
# proofs see like any other op. A contiguous input costs nothing (``contiguous`` returns it), and
# neither does an adaptive pool to one position per channel (``_pooled_to_one``). A
# channels-last *weight* (``model.to(memory_format=torch.channels_last)``) is still refused.
# (tests/graph/test_merged_batch.py::test_convnext_channels_last_inside_the_model)
def _reads_contiguous(fn, adaptive: bool):
    def stand_in(input, *args, **kwargs):
        if isinstance(input, torch.Tensor) and input.dim() in (4, 5) and \
                not (adaptive and _pooled_to_one(args, kwargs)):
            input = input.contiguous()
        return fn(input, *args, **kwargs)
    stand_in.__name__ = stand_in.__qualname__ = getattr(fn, "__name__", "stand_in")
    return stand_in


def _pooled_to_one(args, kwargs) -> bool:
    """An adaptive pool to one position per channel: its (B, C, 1, 1) output is read right
    whatever its strides, and Inductor restrides it with an ``as_strided`` the proof reads
    (Note [as_strided reads storage] in graph/batch.py), with no copy of the input."""
    size = args[0] if args else kwargs.get("output_size")
    sizes = list(size) if isinstance(size, (list, tuple)) else [size]
    return all(isinstance(s, int) and s == 1 for s in sizes)


_STRIDE_KEEPING = ["conv2d", "conv3d", "conv_transpose2d", "conv_transpose3d", "avg_pool2d",
                   "avg_pool3d", "max_pool2d", "max_pool3d", "adaptive_avg_pool2d",
                   "adaptive_avg_pool3d", "adaptive_max_pool2d", "adaptive_max_pool3d"]


# (object, attribute, dpfx's stand-in) for every swap; the originals are read when the module loads.
_SWAPS = [
    (F, "_verify_batch_size", _verify_batch_size_if_known),
    (F, "instance_norm", _instance_norm_written_out),
    (torch.Tensor, "repeat", _repeat_by_expand),
    (F, "bilinear", _bilinear_written_out),
    (F, "embedding_bag", _embedding_bag_written_out),
    (torch.Tensor, "view", _view_explicit),
    (torch.Tensor, "reshape", _reshape_explicit),
    (F, "linear", _linear_one_feature),
    (F, "batch_norm", _batch_norm_frozen_stats),
    (torch, "roll", _roll_as_method),
    (torch.Tensor, "roll", _roll_checked),
    *[(cls, "forward", rnn.rnn_forward) for cls in _rnn_forwards],
    (rnn_utils, "pack_padded_sequence", rnn.pack_padded_sequence),
    (rnn_utils, "pad_packed_sequence", rnn.pad_packed_sequence),
    *[(F, name, _reads_contiguous(getattr(F, name), name.startswith("adaptive_")))
      for name in _STRIDE_KEEPING],
    requires_grad_skip.SWAP,    # dynamo's own setattr: Note [Setting requires_grad inside the forward]
]
_ORIGINALS = [(obj, name, getattr(obj, name)) for obj, name, _ in _SWAPS]


class Swaps:
    """Swaps in place for the duration of a dpfx forward call: those named in ``names``, else
    all. A plain class with direct assignments: this runs on every training step, where
    ``contextlib`` costs several microseconds (Note [The steady-state call] in
    compiled_call.py). dynamo's ``allow_rnn``, which only a capture reads, is set where dpfx's
    captures run (Note [Settings only a capture reads] in capture/entry.py).

    # Note [Only the swaps the guards read, between captures]
    Every swap is in place while dynamo captures (``Captured``, from capture/entry.py's callback). On
    a steady-state call dynamo reads none of them except through its guards, which check the
    code of each function it inlined: a swap whose attribute the guards read must be in place
    (else they fail and dynamo captures again), and no other one changes what runs. Each setattr
    costs, and one on ``torch.Tensor`` also clears the interpreter's attribute caches for every
    tensor method looked up after it: swapping all of them around each call would be most of
    dpfx's forward call's overhead over torch.compile's on a small model (BENCHMARKS.md, "Levers
    in the code"). So after each capture a dpfx entry swaps what the
    guards of its cached graphs name (capture/entry.py, ``steady_swaps``), once they are seen to
    pass with only those for the call that captured, and all of them otherwise."""

    __slots__ = ("_new", "_old", "names")

    def __init__(self, names: set[str] | None = None):
        chosen = [i for i, (_, name, _) in enumerate(_SWAPS) if names is None or name in names]
        self._new = [_SWAPS[i] for i in chosen]
        self._old = [_ORIGINALS[i] for i in chosen]
        self.names = frozenset(_SWAPS[i][1] for i in chosen)

    def __enter__(self):
        for obj, name, new in self._new:
            setattr(obj, name, new)
        return self

    def __exit__(self, *exc):
        for obj, name, old in self._old:
            setattr(obj, name, old)
        return False


ALL = Swaps()


class Captured:
    """Every swap while dynamo captures, inside whatever swaps the call had in place (which
    are put back as they were found)."""

    __slots__ = ("_found",)

    def __enter__(self):
        self._found = [(obj, name, obj.__dict__.get(name, _ABSENT))
                       for obj, name, _ in _SWAPS]
        ALL.__enter__()
        return self

    def __exit__(self, *exc):
        for obj, name, value in self._found:
            if value is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
        return False


_ABSENT = object()


class traceable_torch(Swaps):
    """The swaps and dynamo's ``allow_rnn``, for a plain ``torch.compile`` of a model with dpfx's
    capture-time rewrites (the benchmarks' unrolled non-private LSTM)."""

    __slots__ = ("_allow_rnn",)

    def __enter__(self):
        config = torch._dynamo.config
        self._allow_rnn = config.allow_rnn
        config.allow_rnn = True
        return super().__enter__()

    def __exit__(self, *exc):
        torch._dynamo.config.allow_rnn = self._allow_rnn
        return super().__exit__(*exc)
