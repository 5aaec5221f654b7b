"""Lowering a rewritten graph with Inductor: the settings and the patches it runs under.

    compiled = lower(gm, example_inputs, kwargs, backend="inductor")

The verifier proves the FX graph; what runs is the code Inductor generates from it. ``lower``
runs Inductor under two sets of patches, each patch a context manager that sets torch back as
it found it:

- ``shape_patch_list`` (lower/shape_patches.py): how Inductor treats the graph's shapes, without
  which the generated code could differ from the proven graph. Each is needed for as long as the
  torch it names has the behaviour it closes; removing one fails the tests that reproduce that
  behaviour (tests/lower/test_inductor_exact.py, tests/conftest.py).
- ``codegen_patch_list`` (lower/codegen_patches.py, lower/cpu_builds.py): how Inductor groups,
  builds and caches while it generates code, for a fast compile or lean code. None changes a
  computed value (tests/lower/test_lowering_patches.py compares the code with and without them),
  so any of them can be dropped when torch changes, at a cost in time measured in its Note.

# Note [dpfx's own FX-graph cache entries]
Inductor's FX-graph cache keys on the graph and Inductor's config, not on the hook above, so an
entry lowered without it (an earlier dpfx, or plain torch.compile of the same forward graph) could
be handed back. dpfx compiles with a no-op post-grad pass whose uuid hashes dpfx's sources
(every Python and C file of the package), so its entries are its own. The whole package, not
this file alone: the generated code bakes in what dpfx's own ops' fake kernels said (output
strides) and calls their kernels, so a dpfx whose ops changed must not reuse another version's
entries, which the graph alone (the same op names and arguments) would match
(tests/lower/test_inductor.py::test_cache_key_covers_every_dpfx_source). The same pass is in
Inductor's settings for the whole compile, so that AOTAutogradCache's key carries it too (Note
[No caches that skip the inner compiler] in backend/__init__.py).
"""
from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import os
import warnings

import torch
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.compile_fx import compile_fx_inner
from torch._inductor.custom_graph_pass import CustomGraphPass

import dpfx
from dpfx.lower import codegen_patches, shape_patches
from dpfx.lower.cpu_builds import merged_cpu_builds
from dpfx.lower.warm import canonical_attributes
from dpfx.errors import DPFXWarning


def shape_patch_list(shape_env) -> list:
    """The patches without which Inductor's code could differ from the proven graph."""
    return [shape_patches.no_unchecked_assumptions(shape_env),
            shape_patches.bmm_operands_contiguous(), shape_patches.fake_values_kept()]


def codegen_patch_list() -> list:
    """The patches that only make compiling fast or the code lean (lower/codegen_patches.py)."""
    return [codegen_patches.smaller_cpu_kernel_groups(), merged_cpu_builds(),
            codegen_patches.polynomial_vector_strides(), codegen_patches.dtype_rules_once(),
            codegen_patches.fusion_refusals_kept(), codegen_patches.shared_sums_stored()]

# Inductor's channels-last layout optimization miscompiles Conv2d on CPU when the batch is
# unbacked (a stride assertion fails at run time; plain torch.compile fails the same way).
INDUCTOR_PATCHES = {"layout_optimization": False}

# Note [Combo kernels on the GPU]
# A GPU step of dpfx is bound by the host launching kernels: every parameter adds its own small
# reductions (its per-example gradient, its norm, its clipped sum), each tens of microseconds of
# host time. Inductor's combo kernels put independent kernels into one launch, a third fewer
# launches and a shorter step (BENCHMARKS.md, "On a GPU"). Triton only: the C++ backend
# has no combo kernels. They are off in torch by default; should Inductor fail to lower a graph
# with them, ``lower`` warns (ComboKernelsWarning) and lowers the same graph without them.
GPU_PATCHES = {"combo_kernels": True}


def inductor_patches(example_inputs) -> dict:
    """dpfx's Inductor settings for a graph whose inputs are ``example_inputs``."""
    on_gpu = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
    return {**INDUCTOR_PATCHES, **GPU_PATCHES} if on_gpu else INDUCTOR_PATCHES


class _CacheKey(CustomGraphPass):
    """A no-op pass whose uuid gives dpfx's lowerings their own FX-graph cache entries."""

    def __init__(self, user_pass, extra: str = ""):
        self.user_pass = user_pass
        self.extra = extra

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.user_pass is not None:
            self.user_pass(graph)

    def uuid(self) -> bytes:
        theirs = self.user_pass.uuid() if self.user_pass is not None else None
        return f"dpfx-{_source_digest()}-{theirs}-{self.extra}".encode()


def cache_key_pass(user_pass, extra: str = "") -> _CacheKey:
    """Inductor's post-grad custom pass for a dpfx compile: ``user_pass`` (or none) under a uuid
    that names dpfx's sources and ``extra`` (the batch-size decisions the graph was captured
    under: Note [Deciding a branch on the batch size]), for Inductor's and AOTAutogradCache's
    keys."""
    if isinstance(user_pass, _CacheKey):
        return user_pass if not extra else _CacheKey(user_pass.user_pass, extra)
    return _CacheKey(user_pass, extra)


@functools.cache
def _source_digest() -> str:
    """One hash of dpfx's sources (Python and C). The compiled code of a graph bakes in what
    dpfx's own ops' fake kernels said (output shapes and strides) and calls their kernels: a
    dpfx that changed either must not be handed another version's entries, which the graph
    alone (the same op names and arguments) would match."""
    return source_digest(os.path.dirname(os.path.abspath(dpfx.__file__)))


def source_digest(root: str) -> str:
    """sha256 over the package at ``root``: each .py file and each .c file (any depth), by path
    relative to ``root`` and content, so the same sources give the same key wherever they lie."""
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                       + glob.glob(os.path.join(root, "**", "*.c"), recursive=True)):
        digest.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def lower(gm: torch.fx.GraphModule, example_inputs: list, kwargs: dict, backend: str):
    """The compiled callable (boxed) for a rewritten forward or backward graph."""
    if backend == "eager":
        return make_boxed_func(gm.forward)
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    shape_env = fake_mode.shape_env if fake_mode is not None else None
    key = cache_key_pass(torch._inductor.config.post_grad_custom_post_pass)
    # Note [A warm start without the joint trace] (lower/warm.py): the FX-graph cache stays on under
    # AOTAutogradCache's bundled mode, and the key of a graph rebuilt from that cache is the
    # key of the graph aot_autograd built.
    canonical_attributes(gm)

    def attempt(**settings):
        with contextlib.ExitStack() as patches:
            for patch in shape_patch_list(shape_env) + codegen_patch_list():
                patches.enter_context(patch)
            patches.enter_context(torch._functorch.config.patch(bundled_autograd_cache=False))
            patches.enter_context(torch._inductor.config.patch(post_grad_custom_post_pass=key,
                                                               **settings))
            return compile_fx_inner(gm, example_inputs, **kwargs)

    try:
        try:
            return attempt()
        except Exception as e:
            if not torch._inductor.config.combo_kernels or shape_patches.unchecked(e) is not None:
                raise
            # Note [Combo kernels on the GPU]: they only group kernels; without them the same
            # verified graph is lowered kernel by kernel.
            warnings.warn(f"dpfx: Inductor's combo kernels failed on this graph "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                          f"); lowering it without them (more kernel launches, the same "
                          f"values)", ComboKernelsWarning, stacklevel=2)
            return attempt(combo_kernels=False)
    except Exception as e:
        cause = shape_patches.unchecked(e)
        if cause is None:
            raise
        raise shape_patches.assumption_error(cause.expr) from e


class ComboKernelsWarning(DPFXWarning):
    """Inductor's combo kernels failed on a graph, which dpfx then lowered without them."""


