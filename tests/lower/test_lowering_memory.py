"""dpfx's lowering patch that changes Inductor's code for memory: Note [A shared sum stored so
that its inputs die] in dpfx/lower/codegen_patches.py. The stored sum gives the same DP-SGD
gradient at every batch size, through Inductor, and its backward holds fewer bytes at its peak than
Inductor's own choice."""
import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

import dpfx
from dpfx.lower import codegen_patches as lower_codegen
from support.models import ProjectedResNet, xent
from support.reference import check_every_batch_size, run_dpfx


def _backward_peak(step) -> int:
    """Peak tensor bytes live during the compiled backward of one step, counted from the step's
    start (the CPU allocator's records: deterministic for a given graph and batch)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    backward = next(e for e in events if e.name() == "CompiledFunctionBackward")
    start, end = backward.start_ns(), backward.start_ns() + backward.duration_ns()
    live = peak = 0
    for e in events:
        if e.name() == "[memory]":
            live += e.nbytes()
            if start <= e.start_ns() <= end:
                peak = max(peak, live)
    return peak


def _record_stored(monkeypatch) -> list:
    """The names of the nodes dpfx's lowering stores from now on (the patch left in place)."""
    inner, stored = lower_codegen.shared_sums_stored, []

    @contextlib.contextmanager
    def recorded():
        with inner() as made:
            yield made
            stored.extend(made)

    monkeypatch.setattr(lower_codegen, "shared_sums_stored", recorded)
    return stored


def test_a_shared_sum_is_stored_so_that_its_inputs_die(monkeypatch):
    """A downsampling block's two convolutions read one activation (ProjectedResNet): its
    gradient, the sum of their input gradients, is read by two kernels of the block before. dpfx
    stores it once, the gradient at batch sizes 0 to 8 (4 and 8 the widths) is a batch-of-one
    loop's (clipping biting), and the backward's peak is lower than with Inductor's choice."""
    torch.manual_seed(0)
    model = ProjectedResNet(c=4)
    x, y = torch.randn(8, 1, 16, 16), torch.randint(0, 3, (8,))
    stored = _record_stored(monkeypatch)
    with torch._inductor.config.patch(force_disable_caches=True):
        dp = check_every_batch_size(model, xent, x, y, max_grad_norm=0.05, expected=8,
                                    backend="inductor")
    assert stored, "no shared sum was stored"
    patched = _backward_peak(lambda: run_dpfx(dp, model, xent, x, y))

    monkeypatch.setattr(lower_codegen, "shared_sums_stored", contextlib.nullcontext)
    torch._dynamo.reset()
    plain_dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0,
                            expected_batch_size=8)
    with torch._inductor.config.patch(force_disable_caches=True):
        run_dpfx(plain_dp, model, xent, x, y)
    plain = _backward_peak(lambda: run_dpfx(plain_dp, model, xent, x, y))
    # at least one of the block's input gradients (8 x 4 x 16 x 16 floats) no longer held
    assert patched <= plain - 8 * 4 * 16 * 16 * 4, (patched, plain)


def test_a_sum_read_once_is_left_to_inductor(monkeypatch):
    """Where no buffer would die sooner (the ResBlock's identity shortcut adds one convolution's
    input gradient to a value computed in the same kernel), nothing is stored."""
    from support.models import ResNetGN

    torch.manual_seed(0)
    model = ResNetGN(c=4)
    x, y = torch.randn(3, 1, 8, 8), torch.randint(0, 3, (3,))
    stored = _record_stored(monkeypatch)
    dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=3)
    with torch._inductor.config.patch(force_disable_caches=True):
        run_dpfx(dp, model, xent, x, y)
    assert stored == []
