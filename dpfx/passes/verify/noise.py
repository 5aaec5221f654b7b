"""The noise: sigma * C times a slice of one standard normal draw that no other slice overlaps.

    slices = check_noise(name, ancestors, noise_scales, calls, adaptive, config)
    check_noise_slots(slots)        # the add_noise_ call's sums: one parameter an entry
    check_disjoint(slices)          # the draw's slices: one parameter an entry

Two parameters that shared noise entries would get correlated noise: along their difference
there would be none at all. So each noise_scale node multiplies a contiguous slice of a standard
normal draw by exactly sigma * C (adaptive clipping: the clip_bound input times sigma_grad, Note
[The adaptive bound is proven as an input] in adaptive.py), and the slices, like the entries of
the ``dpfx::add_noise_`` call's sums that parameters take, are proven disjoint.
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx

import dpfx.ops  # noqa: F401  (dpfx::standard_normal)
from dpfx.config import DPConfig
from dpfx.errors import PrivacyError

aten = torch.ops.aten


def check_noise(name: str, ancestors: set[fx.Node], noise_scales: list[fx.Node],
                calls: list[fx.Node], adaptive: fx.Node | None, config: DPConfig) -> list[tuple]:
    """Noise reaches parameter ``name``'s output (``ancestors``: what it is computed from): a
    noise_scale node, each scaling standard normals by the configured std, or the graph's
    dpfx::add_noise_ call (whose std check_release checks). Returns the noise_scale nodes'
    (name, slice) pairs for ``check_disjoint``."""
    scales = [n for n in noise_scales if n in ancestors]
    if not scales and not any(c in ancestors for c in calls):
        raise PrivacyError(f"no noise is added to the gradient of parameter '{name}'")
    found = []
    for s in scales:
        noise_src, std = s.args
        if adaptive is not None:
            check_adaptive_std(name, std, adaptive, config)
        elif std != config.noise_std:
            raise PrivacyError(f"the noise of parameter '{name}' is not N(0, (sigma*C)^2): "
                               f"scale {std}, expected {config.noise_std}")
        found.append((name, noise_slice(name, noise_src)))
    return found


def check_adaptive_std(name: str, std, bound: fx.Node, config: DPConfig) -> None:
    """See Note [The adaptive bound is proven as an input]."""
    if not (isinstance(std, fx.Node) and std.target is aten.mul.Tensor and not std.kwargs
            and len(std.args) == 2 and std.args[0] is bound
            and std.args[1] == config.grad_noise_multiplier):
        raise PrivacyError(f"the noise of parameter '{name}' is not N(0, (sigma_grad*C_t)^2) "
                           f"with C_t the graph's clip_bound input and sigma_grad = "
                           f"{config.grad_noise_multiplier}: its scale is {std}")


def check_noise_slots(slots: dict) -> None:
    """``slots``: (add_noise_ call, getitem index) -> [(start, end, parameter)], the entries of
    each noised sum that parameters take (check_release); no two may overlap."""
    for (call, index), spans in slots.items():
        spans.sort(key=lambda s: s[:2])
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise PrivacyError(f"parameters '{first}' and '{second}' share the noise of sum "
                                   f"{index - 1} of {call.name}")


# Sources of i.i.d. N(0, 1) entries that a "noise" node may be.
_STANDARD_NORMAL = {aten.randn.default, torch.ops.dpfx.standard_normal.default}


def noise_slice(name: str, node: fx.Node) -> tuple[fx.Node, sympy.Expr, sympy.Expr]:
    """The (noise node, start, end) that ``node`` views: a contiguous run of one standard normal
    draw, reached through views and one step-1 slice of dim 0."""
    while node.target in (aten.view.default, aten.reshape.default):
        node = node.args[0]
    if node.target is not aten.slice.Tensor or tuple(node.args[1:2]) != (0,) or \
            (len(node.args) > 4 and node.args[4] != 1):
        raise PrivacyError(f"the noise of parameter '{name}' is not a contiguous slice of one "
                           f"standard normal draw (found {node.name} = {node.target})")
    source, start, end = node.args[0], size_expr(node.args[2]), size_expr(node.args[3])
    if source.meta.get("dpfx") != "noise" or source.target not in _STANDARD_NORMAL:
        raise PrivacyError(f"the noise of parameter '{name}' comes from {source.name} = "
                           f"{source.target}, not from a standard normal draw")
    return source, start, end


def check_disjoint(slices: list) -> None:
    """Two parameters that shared noise entries would get correlated noise: along their
    difference there would be none at all. Integer bounds: sorted, each against the next;
    symbolic bounds (a parameter with a symbolic dim): against every other slice."""
    fixed = sorted((s for s in slices if s[1][1].is_Integer and s[1][2].is_Integer),
                   key=lambda s: (id(s[1][0]), int(s[1][1])))
    pairs = list(zip(fixed, fixed[1:]))
    symbolic = [s for s in slices if not (s[1][1].is_Integer and s[1][2].is_Integer)]
    pairs += [(a, b) for i, a in enumerate(symbolic) for b in symbolic[i + 1:] + fixed]
    for (a, (src_a, start_a, end_a)), (b, (src_b, start_b, end_b)) in pairs:
        if src_a is src_b and not _proven_le(end_a, start_b) and not _proven_le(end_b, start_a):
            raise PrivacyError(f"parameters '{a}' and '{b}' may share noise entries "
                               f"([{start_a}, {end_a}) and [{start_b}, {end_b}) of {src_a.name})")


def _proven_le(a: sympy.Expr, b: sympy.Expr) -> bool:
    if a.is_Integer and b.is_Integer:
        return a <= b
    return (sympy.simplify(a - b) <= 0) == sympy.true


def size_expr(x) -> sympy.Expr:
    if isinstance(x, fx.Node):
        x = x.meta["val"]
    return x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(x)
