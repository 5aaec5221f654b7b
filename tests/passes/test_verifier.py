"""The verifier rejects graphs that leak, and every refused model leaves the user's model intact."""
import operator
import types

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
from dpfx.config import DPConfig
from dpfx.passes import clip_noise
from dpfx.passes.verify import verify_backward
from dpfx.passes.verify.noise import check_disjoint, size_expr
from dpfx.passes.verify.patterns import is_add_noise, through_moves
from dpfx.passes.verify.release import through_release_moves
from support.models import MLP, ChannelsLastLinearPool, mse
from support.reference import assert_close, dp_sgd_grads, loop_dp_sgd_grads, run_dpfx, run_dpfx_multi

aten = torch.ops.aten
CONFIG = DPConfig(max_grad_norm=0.1, noise_multiplier=1.0, backend="eager")


@pytest.fixture(autouse=True)
def _expression_release(monkeypatch):
    """Most tests below break the release as GPU graphs write it (a slice of one normal draw,
    scaled and added to the clipped sum, then divided by D), built here on CPU. The CPU graphs'
    release, one dpfx::add_noise_ call (Note [Noise added in place]), has its own tests at the
    end, which put that form back."""
    monkeypatch.setattr(clip_noise, "NOISE_IN_PLACE", set())


def _rewritten(strategy="materialize", x_shape=(3, 8)):
    model = MLP()
    dp = dpfx.compile(model, max_grad_norm=CONFIG.max_grad_norm,
                      noise_multiplier=CONFIG.noise_multiplier, backend="eager",
                      strategy=strategy)
    dp(torch.randn(*x_shape))
    return dp._dpfx_backend.last_backward


def _insert_before(gm, anchor, op, *args):
    with gm.graph.inserting_before(anchor):
        node = gm.graph.call_function(op, args)
    node.meta["val"] = op(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args])
    return node


def _ratio(factor):
    """C / (norm + eps) inside where(isfinite(norm), clamp_max(ratio, 1), 0)."""
    return factor.args[1].args[0]


def _route_output(result, name, new_node):
    output = result.gm.graph.find_nodes(op="output")[0]
    old = result.private[name]
    output.args = (tuple(new_node if a is old else a for a in output.args[0]),)
    return {**result.private, name: new_node}


@pytest.mark.parametrize("strategy,x_shape", [
    ("materialize", (3, 8)), ("ghost", (3, 8)), ("ghost", (3, 5, 8))])
def test_intact_graph_verifies(strategy, x_shape):
    result = _rewritten(strategy, x_shape)
    assert {pg.strategy for pg in result.grads if pg.name.endswith("weight")} == {strategy}
    verify_backward(result.gm, result.analysis, result.private, CONFIG)


def test_book_keeping_product_without_the_clip_factor_is_rejected():
    """The ghost strategy's clipped sum is one mm with clip-scaled rows; scaling by anything
    but the clip coefficient is refused."""
    result = _rewritten("ghost", (3, 5, 8))
    apply = next(n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "clip_apply")
    ones = _insert_before(result.gm, apply, aten.ones_like.default, apply.args[1])
    apply.args = (apply.args[0], ones)
    with pytest.raises(dpfx.PrivacyError, match="not scaled by the clip factor"):
        verify_backward(result.gm, result.analysis, result.private, CONFIG)


def test_gradient_routed_around_the_clip_is_rejected():
    result = _rewritten()
    pg = next(p for p in result.grads if p.name == "fc1.weight")
    output = result.gm.graph.find_nodes(op="output")[0]
    unclipped = _insert_before(result.gm, output, aten.sum.dim_IntList, pg.per_sample, [0])
    noise = next(n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "noise_scale")
    leaky = _insert_before(result.gm, output, aten.add.Tensor, unclipped, noise)
    private = _route_output(result, "fc1.weight", leaky)
    with pytest.raises(dpfx.PrivacyError, match="fc1.weight.*bypasses per-sample clipping"):
        verify_backward(result.gm, result.analysis, private, CONFIG)


def test_batch_wide_value_inside_a_per_sample_gradient_is_rejected():
    """A rule that scaled example i's gradient by a statistic of the whole batch (as
    scale_grad_by_freq would) keeps every path through the clip, yet leaks: caught by re-running
    the batch analysis on the rewritten graph."""
    result = _rewritten()
    ps = next(p for p in result.grads if p.name == "fc2.bias").per_sample
    # The bias's per-sample form and its norm both read the output gradient's rows (Note [One
    # squared norm per tensor]): scale them where both see it.
    rows = through_moves(ps)
    tangent = next(n for n in result.gm.graph.nodes if n.name.startswith("tangents"))
    anchor = rows.next
    batch_total = _insert_before(result.gm, anchor, aten.sum.dim_IntList, tangent, [0])
    scaled = _insert_before(result.gm, anchor, aten.mul.Tensor, rows, batch_total)
    rows.replace_all_uses_with(scaled, delete_user_cb=lambda user: user.meta.get("dpfx_emitted"))
    with pytest.raises(dpfx.PrivacyError, match="combines examples outside the clipped sums"):
        verify_backward(result.gm, result.analysis, result.private, CONFIG)


def test_missing_noise_is_rejected():
    result = _rewritten()
    clipped = next(n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "clipped_sum"
                   and n.meta["val"].shape == (4,))
    private = _route_output(result, "fc2.bias", clipped)
    with pytest.raises(dpfx.PrivacyError, match="no noise .*fc2.bias"):
        verify_backward(result.gm, result.analysis, private, CONFIG)


def test_wrong_noise_scale_is_rejected():
    result = _rewritten()
    scale = next(n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "noise_scale")
    scale.args = (scale.args[0], CONFIG.noise_std / 2)
    with pytest.raises(dpfx.PrivacyError, match="not N\\(0"):
        verify_backward(result.gm, result.analysis, result.private, CONFIG)



def test_noise_from_something_other_than_a_standard_normal_is_rejected():
    """Tagging a node "noise" proves nothing: it must be a standard normal draw."""
    result = _rewritten()
    noise = next(n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "noise")
    assert noise.target is torch.ops.dpfx.standard_normal.default      # CPU graph
    noise.target, noise.args = aten.zeros.default, ([noise.args[0]],)
    with pytest.raises(dpfx.PrivacyError, match="not from a standard normal draw"):
        verify_backward(result.gm, result.analysis, result.private, CONFIG)


def test_parameters_sharing_noise_entries_are_rejected():
    """Two parameters drawing the same noise entries get correlated noise: none at all along
    their difference."""
    result = _rewritten()
    slices = [n for n in result.gm.graph.nodes if n.target is aten.slice.Tensor
              and n.args[0].meta.get("dpfx") == "noise"]
    assert len(slices) == len(result.grads)     # one per parameter
    first, second = slices[0], slices[1]
    width = second.meta["val"].shape[0]
    second.args = (second.args[0], 0, 0, width)    # overlaps [0, numel(fc1.weight))
    with pytest.raises(dpfx.PrivacyError, match="may share noise entries"):
        verify_backward(result.gm, result.analysis, result.private, CONFIG)
    second.args = (second.args[0], 0, first.args[3], first.args[3] + width)  # disjoint again
    verify_backward(result.gm, result.analysis, result.private, CONFIG)


def test_noise_slices_with_symbolic_bounds():
    """A parameter with a symbolic dim has symbolic noise bounds: disjointness must be proven."""
    s = sympy.Symbol("s0", positive=True, integer=True)
    src, other = types.SimpleNamespace(name="noise"), types.SimpleNamespace(name="noise_1")
    n = sympy.Integer
    check_disjoint([("a", (src, n(0), n(4))), ("b", (src, n(4), 4 + s)),
                    ("c", (src, 4 + s, 4 + 3 * s)), ("d", (other, n(0), n(4)))])
    with pytest.raises(dpfx.PrivacyError, match="'b' and 'a' may share"):
        check_disjoint([("a", (src, n(0), n(4))), ("b", (src, s, s + 1))])    # s0 may be < 4
    with pytest.raises(dpfx.PrivacyError, match="may share"):
        check_disjoint([("a", (src, n(0), n(4))), ("b", (src, n(2), n(6))),
                        ("c", (src, n(6), n(9)))])


def test_wrong_clip_bound_is_rejected():
    result = _rewritten()
    factor = next(n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "clip_factor")
    ratio = _ratio(factor)
    ratio.args = (ratio.args[0], 10 * CONFIG.max_grad_norm)
    with pytest.raises(dpfx.PrivacyError, match="clip factor"):
        verify_backward(result.gm, result.analysis, result.private, CONFIG)


def test_clip_factor_without_the_finiteness_select_is_rejected():
    """min(1, C / (norm + eps)) alone is NaN for an example with a NaN gradient."""
    result = _rewritten()
    factor = next(n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "clip_factor")
    clamp = factor.args[1]
    factor.replace_all_uses_with(clamp)
    clamp.meta["dpfx"] = "clip_factor"
    with pytest.raises(dpfx.PrivacyError, match=r"where\(isfinite\(norm\)"):
        verify_backward(result.gm, result.analysis, result.private, CONFIG)


def _masks_into_clipped_sums(result):
    masks = []
    for c in (n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "clipped_sum"):
        for x in c.all_input_nodes:
            while x.meta.get("dpfx") != "finite_mask" and x.target in (
                    aten.view.default, aten.reshape.default, aten._unsafe_view.default):
                x = x.args[0]
            if x.meta.get("dpfx") == "finite_mask":
                masks.append(x)
    return masks


@pytest.mark.parametrize("strategy,x_shape,which", [
    ("materialize", (3, 8), "scaled"), ("ghost", (3, 5, 8), "scaled"),
    ("ghost", (3, 5, 8), "other"), ("ghost", (3, 8), "other")])
def test_clipped_sum_operand_without_the_finite_mask_is_rejected(strategy, x_shape, which):
    """Each example's terms must be selected, not only multiplied by its (zero) factor:
    0 * NaN = NaN. In a book-keeping product that holds for the operand the coefficient does
    not scale (the activations) as much as for the scaled one."""
    result = _rewritten(strategy, x_shape)
    masks = _masks_into_clipped_sums(result)
    scaled = [m for m in masks if m.args[1].meta.get("dpfx") == "clip_apply"]
    other = [m for m in masks if m not in scaled]
    assert scaled and (other or strategy == "materialize")
    mask = (scaled if which == "scaled" else other)[0]
    mask.replace_all_uses_with(mask.args[1])
    with pytest.raises(dpfx.PrivacyError, match="without the select"):
        verify_backward(result.gm, result.analysis, result.private, CONFIG)


def test_finite_mask_that_keeps_the_example_is_rejected():
    """where(keep, x, x) selects nothing away."""
    result = _rewritten("ghost", (3, 8))
    mask = next(m for m in _masks_into_clipped_sums(result)
                if m.args[1].meta.get("dpfx") != "clip_apply")
    mask.args = (mask.args[0], mask.args[1], mask.args[1])
    with pytest.raises(dpfx.PrivacyError, match="without the select"):
        verify_backward(result.gm, result.analysis, result.private, CONFIG)


# -- models dpfx must refuse, and what they leave behind ------------------------------------------

def _assert_untouched(model, before):
    for (name, p), b in zip(model.named_parameters(), before):
        assert torch.equal(p, b), name
        assert p.grad is None, name


def _refuse(model, x, error, match):
    before = [p.detach().clone() for p in model.parameters()]
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, backend="eager")
    with pytest.raises(error, match=match):
        dp(x)
    _assert_untouched(model, before)


def test_batchnorm_in_training_is_refused():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    _refuse(model, torch.randn(5, 4), dpfx.PrivacyError, r"(?s)module '1'.*BatchNorm.*GroupNorm")


class CrossBatchMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x - x.mean(0, keepdim=True))


class LossInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x).pow(2).mean()


class SoftmaxOverBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return F.softmax(self.fc(x), dim=0)


@pytest.mark.parametrize("model_cls,match", [
    (CrossBatchMean, "reduces over the batch dim|works along the batch dim"),
    (LossInside, "reduces over the batch dim.*loss outside"),
    (SoftmaxOverBatch, "batch dim"),
])
def test_ops_that_mix_examples_are_refused(model_cls, match):
    _refuse(model_cls(), torch.randn(5, 4), dpfx.PrivacyError, match)


class StridedView(nn.Module):
    """A Linear on an ``as_strided`` view of tanh(x), x of shape (B, 6): ``view(B)`` gives the
    view's size, stride and storage offset."""

    def __init__(self, view):
        super().__init__()
        self.view, self.fc = view, nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(torch.tanh(x).as_strided(*self.view(x.shape[0])))


def test_as_strided_within_each_example_trains():
    """Note [as_strided reads storage] in graph/batch.py: positions 6b + 1, 6b + 3, 6b + 5
    are in example b's block of the (B, 6) storage, so the view keeps examples apart."""
    model = StridedView(lambda b: ((b, 3), (6, 2), 1))
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=0.0, backend="eager")
    x, y = torch.randn(5, 6), torch.randn(5, 2)
    got = run_dpfx_multi(dp, model, mse, (x,), y)
    assert_close(got, loop_dp_sgd_grads(model, mse, (x,), y, max_grad_norm=0.1))


@pytest.mark.parametrize("view", [
    lambda b: ((b, 3), (5, 1)),      # example b reads 5b .. 5b + 2: example 1 reads example 0
    lambda b: ((b, 3), (1, b)),      # the batch innermost: entry c of example b is b + c B
    lambda b: ((b, 3), (6, 2), 2),   # 6b + 2, 6b + 4, 6b + 6: the next example's first entry
], ids=["overlapping", "batch-innermost", "past-the-block"])
def test_as_strided_across_examples_is_refused(view):
    _refuse(StridedView(view), torch.randn(5, 6), dpfx.PrivacyError,
            r"as_strided.*one example's block")


def test_as_strided_scatter_across_examples_is_rejected():
    """The pooled model's backward scatters example b's gradient into positions 6b .. 6b + 5 of
    a flat buffer; the same scatter with strides (1, B) interleaves the examples."""
    dp = dpfx.compile(ChannelsLastLinearPool(), max_grad_norm=CONFIG.max_grad_norm,
                      noise_multiplier=CONFIG.noise_multiplier, backend="eager")
    dp(torch.randn(3, 3, 5, 5))
    result = dp._dpfx_backend.last_backward
    verify_backward(result.gm, result.analysis, result.private, CONFIG)
    scatter = next(iter(result.gm.graph.find_nodes(op="call_function",
                                                   target=aten.as_strided_scatter.default)))
    base, src, size, stride, *rest = scatter.args
    assert [size_expr(s) for s in stride] == [6, 1]
    scatter.args = (base, src, size, [1, size[0]], *rest)
    with pytest.raises(dpfx.PrivacyError, match="as_strided_scatter.*one example's block"):
        verify_backward(result.gm, result.analysis, result.private, CONFIG)


@torch.library.custom_op("dpfx_test::scale", mutates_args=())
def _scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


@torch.library.custom_op("dpfx_test::scale_weight_grad", mutates_args=())
def _scale_weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (g * x).sum(0)


@_scale.register_fake
def _(x, w):
    return torch.empty_like(x)


@_scale_weight_grad.register_fake
def _(g, x):
    return g.new_empty(g.shape[1:])


def _scale_backward(ctx, g):
    x, w = ctx.saved_tensors
    return g * w, _scale_weight_grad(g, x)


def _scale_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


_scale.register_autograd(_scale_backward, setup_context=_scale_setup)


class CustomWeightGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return _scale(x, self.w)


def test_unknown_weight_gradient_op_is_refused():
    _refuse(CustomWeightGrad(), torch.randn(5, 4), dpfx.UnsupportedOpError,
            r"parameter 'w'.*dpfx_test.scale_weight_grad")


@pytest.mark.filterwarnings("ignore::dpfx.PlainGradientWarning")  # the model trained directly
def test_model_stays_usable_after_an_error():
    model = CrossBatchMean()
    _refuse(model, torch.randn(5, 4), dpfx.PrivacyError, "batch")
    out = model(torch.randn(5, 4))  # the user's module still runs eagerly
    out.sum().backward()
    assert model.fc.weight.grad is not None


@pytest.mark.parametrize("kwargs,match", [
    ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ({"max_grad_norm": float("inf")}, "max_grad_norm"),
    ({"noise_multiplier": -1.0}, "noise_multiplier"),
    ({"loss_reduction": "avg"}, "loss_reduction"),
    ({"expected_batch_size": 0}, "expected_batch_size"),
    ({"seed": 1.5}, "seed"),
    ({"backend": "tvm"}, "backend"),
])
def test_bad_options_name_the_argument(kwargs, match):
    options = {"max_grad_norm": 1.0, "noise_multiplier": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        dpfx.compile(MLP(), **options)


def test_bad_inputs():
    model = MLP()
    before = [p.detach().clone() for p in model.parameters()]
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, backend="eager")
    with pytest.raises(ValueError, match="expected_batch_size"):
        dp(torch.randn(0, 8))
    with pytest.raises(TypeError):
        dpfx.compile(lambda x: x, max_grad_norm=1.0, noise_multiplier=1.0)
    frozen = MLP().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        dpfx.compile(frozen, max_grad_norm=1.0, noise_multiplier=1.0)
    _assert_untouched(model, before)


def test_replace_batchnorm_makes_the_model_trainable():
    model = nn.Sequential(nn.Linear(4, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 2))
    dpfx.replace_batchnorm(model, max_groups=4)
    assert isinstance(model[1], nn.GroupNorm) and model[1].num_groups == 4
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=0.0, backend="eager")
    assert_close(run_dpfx(dp, model, mse, x, y), dp_sgd_grads(model, mse, x, y, max_grad_norm=0.1))


class ManyProblems(nn.Module):
    """BatchNorm in training, a cross-batch mean, and a parameter no rule covers, at once."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        h = self.fc(self.bn(x))
        return _scale(h - h.mean(0, keepdim=True), self.w)


def test_validate_lists_every_problem_without_raising():
    model = ManyProblems()
    before = [p.detach().clone() for p in model.parameters()]
    problems = dpfx.validate(model, torch.randn(5, 4))
    kinds = [p.kind for p in problems]
    text = "\n".join(map(str, problems))
    assert "module 'bn' (BatchNorm1d)" in text and "GroupNorm" in text
    assert "reduces over the batch dim" in text
    assert kinds.count("unsupported") == 1 and "parameter 'w'" in text
    _assert_untouched(model, before)
    assert dpfx.validate(MLP(), torch.randn(3, 8)) == []


# -- per-layer clipping and noise at the optimizer -------------------------------------------------

def _rewritten_with(config_kwargs, x_shape=(3, 8)):
    model = MLP()
    dp = dpfx.compile(model, backend="eager", **config_kwargs)
    dp(torch.randn(*x_shape))
    return dp._dpfx_backend.last_backward, dp.dp_config


@pytest.mark.parametrize("in_place", [False, True])
def test_per_layer_graph_verifies_and_wrong_group_bound_is_rejected(in_place, monkeypatch):
    """Through a dpfx::add_noise_ call, a parameter's release depends on its own base only, not
    on the other groups' clipped sums that the call also reads."""
    if in_place:
        monkeypatch.setattr(clip_noise, "NOISE_IN_PLACE", {"cpu"})
    result, config = _rewritten_with(dict(max_grad_norm={"fc1": 0.1, "fc2": 0.3},
                                          noise_multiplier=1.0))
    verify_backward(result.gm, result.analysis, result.private, config)
    factors = [n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "clip_factor"]
    assert len(factors) == 2
    # Give group fc2's clip factor fc1's bound: still a configured C, but not fc2's.
    ratio = next(_ratio(f) for f in factors if _ratio(f).args[1] == 0.3)
    ratio.args = (ratio.args[0], 0.1)
    with pytest.raises(dpfx.PrivacyError, match="fc2.* clipped to 0.1, but its group's bound"):
        verify_backward(result.gm, result.analysis, result.private, config)


def _reweight(result, name, where, factor):
    """Insert mul(x, factor) between the release's noise_scale or clipped side and the add."""
    add = _release_add(result, name)
    side = next(a for a in add.args
                if (a.meta.get("dpfx") == "noise_scale") == (where == "noise"))
    scaled = _insert_before(result.gm, add, aten.mul.Tensor, side, factor)
    add.args = tuple(scaled if a is side else a for a in add.args)


def _release_add(result, name):
    node = result.private[name]
    while node.target is not aten.add.Tensor:
        node = node.args[0]
    return node


@pytest.mark.parametrize("strategy", ["materialize", "ghost"])
@pytest.mark.parametrize("where,factor", [("noise", 0.5), ("clipped", 2.0), ("noise", 1.0)])
def test_release_reweighted_after_the_checks_is_rejected(strategy, where, factor):
    """Note [The release is checked as a whole]: each ingredient is right, but the noise is
    attenuated, or the clipped sum amplified, on its way to the sum (even by 1.0: nothing may
    sit there); the clipped sum added twice; the division by D changed."""
    result = _rewritten(strategy, (3, 5, 8) if strategy == "ghost" else (3, 8))
    _reweight(result, "fc2.weight", where, factor)
    with pytest.raises(dpfx.PrivacyError, match="fc2.weight.*not \\(clipped sum \\+ noise\\) / D"):
        verify_backward(result.gm, result.analysis, result.private, CONFIG)


def test_release_with_a_clipped_sum_twice_or_another_divisor_is_rejected():
    result = _rewritten("ghost", (3, 5, 8))
    add = _release_add(result, "fc1.weight")
    clipped = next(a for a in add.args if a.meta.get("dpfx") != "noise_scale")
    twice = _insert_before(result.gm, add, aten.add.Tensor, clipped, clipped)
    add.args = tuple(twice if a is clipped else a for a in add.args)
    with pytest.raises(dpfx.PrivacyError, match="fc1.weight.*added twice"):
        verify_backward(result.gm, result.analysis, result.private, CONFIG)

    result = _rewritten("ghost", (3, 5, 8))
    out = result.private["fc1.weight"]
    assert out.target is aten.div.Tensor        # mean loss, no expected batch size: / B
    halved = _insert_before(result.gm, out, aten.mul.Tensor, out.args[0], 0.5)
    out.args = (halved, *out.args[1:])
    with pytest.raises(dpfx.PrivacyError, match="fc1.weight.*lies between the clipped sum"):
        verify_backward(result.gm, result.analysis, result.private, CONFIG)


@pytest.mark.parametrize("multiplier", [2.0, "2B"])
def test_clip_coefficient_other_than_the_batch_size_is_rejected(multiplier):
    """The coefficient clip_factor * B undoes a mean loss's 1/B; a rule that scaled by anything
    else (a constant, 2B) would let each example contribute more than C."""
    result = _rewritten()
    coef = next(n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "clip_coef")
    factor, batch = coef.args
    if multiplier == "2B":
        multiplier = _insert_before(result.gm, coef, operator.mul, batch, 2)
    coef.args = (factor, multiplier)
    with pytest.raises(dpfx.PrivacyError, match="not the clip factor times the batch size"):
        verify_backward(result.gm, result.analysis, result.private, CONFIG)


def test_per_layer_clipped_sum_outside_its_groups_norm_is_rejected():
    """fc2.weight's clipped sum scaled by fc1's clip factor: fc2's data is not in fc1's norm."""
    result, config = _rewritten_with(dict(max_grad_norm={"fc1": 0.1, "fc2": 0.1},
                                          noise_multiplier=1.0))
    coefs = [n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "clip_coef"]
    applies = [n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "clip_apply"]
    fc1_coef, fc2_coef = coefs
    view = next(a.args[1] for a in applies if a.args[1].target is aten.view.default
                and a.args[1].args[0] is fc2_coef)
    view.replace_input_with(fc2_coef, fc1_coef)
    with pytest.raises(dpfx.PrivacyError, match="not part of the per-sample norm"):
        verify_backward(result.gm, result.analysis, result.private, config)


def test_per_layer_mask_by_another_groups_norm_is_rejected():
    """fc2's clipped sum selected by fc1's finite-example mask: an fc2-only NaN would pass."""
    result, config = _rewritten_with(dict(max_grad_norm={"fc1": 0.1, "fc2": 0.1},
                                          noise_multiplier=1.0))
    fc1_keep, fc2_keep = [n for n in result.gm.graph.nodes
                          if n.meta.get("dpfx") == "finite_examples"]
    masks = [n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "finite_mask"]
    moved = 0
    for m in masks:
        view = m.args[0]
        if view.args[0] is fc2_keep and any(u.meta.get("dpfx") == "clipped_sum"
                                            for u in m.users):
            view.replace_input_with(fc2_keep, fc1_keep)
            moved += 1
    assert moved
    with pytest.raises(dpfx.PrivacyError, match="without the select"):
        verify_backward(result.gm, result.analysis, result.private, config)


def test_optimizer_noise_graph_must_not_carry_noise():
    result, config = _rewritten_with(dict(max_grad_norm=0.1, noise_multiplier=1.0,
                                          noise="optimizer"))
    verify_backward(result.gm, result.analysis, result.private, config)
    assert not any(n.meta.get("dpfx") == "noise" for n in result.gm.graph.nodes)
    # The same graph checked as a noise="graph" one: no noise is an error there.
    graph_config = DPConfig(max_grad_norm=0.1, noise_multiplier=1.0, backend="eager")
    with pytest.raises(dpfx.PrivacyError, match="no noise"):
        verify_backward(result.gm, result.analysis, result.private, graph_config)
    # An output that is not the tagged clipped sum (here: the clipped sum times 2) is refused.
    name, out = next(iter(result.private.items()))
    doubled = _insert_before(result.gm, result.gm.graph.find_nodes(op="output")[0],
                             aten.mul.Tensor, out, 2.0)
    with pytest.raises(dpfx.PrivacyError, match="not the tagged clipped sum"):
        verify_backward(result.gm, result.analysis, {**result.private, name: doubled}, config)


def test_size_equality_is_exact_and_memoized():
    """Note [Size arithmetic is memoized] in graph/batch.py: expand decides polynomial sizes,
    simplify the rest (quotients, as views divide strides), in both directions."""
    from torch.utils._sympy.functions import FloorDiv
    from dpfx.graph.batch import sizes_equal

    b, t = sympy.symbols("u0 s1", integer=True, positive=True)
    assert sizes_equal(b * t * 16, 16 * t * b)
    assert sizes_equal(b * (t + 1), b * t + b)
    assert not sizes_equal(16 * b, sympy.Integer(16))
    assert not sizes_equal(b * t, b * (t + 1))
    assert sizes_equal(FloorDiv(2 * b * t, 2), b * t)
    assert not sizes_equal(FloorDiv(b * t, 2), b * t)
    assert sizes_equal((b * b - 1) / (b - 1), b + 1)
    assert not sizes_equal((b * b - 1) / (b - 1), b)


def test_noise_base_reweighted_inside_the_embedding_sum_is_rejected():
    """Note [The clipped sum accumulates into the noise]: the embedding's clipped sum adds its
    rows into the scaled noise; noise scaled again on its way into that base is refused, as is
    a base that is not the noise at all (no noise term reaches the output)."""
    model = nn.Sequential(nn.Embedding(11, 4), nn.Flatten(), nn.Linear(12, 3))
    dp = dpfx.compile(model, max_grad_norm=CONFIG.max_grad_norm,
                      noise_multiplier=CONFIG.noise_multiplier, backend="eager", strategy="ghost")
    dp(torch.randint(0, 11, (5, 3)))
    for mutation, match in (("halve", "lies between|0 noise terms"), ("zeros", "0 noise terms")):
        result = dp._dpfx_backend.last_backward
        put = next(n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "clipped_sum"
                   and n.target is aten._unsafe_masked_index_put_accumulate.default)
        base = put.args[0]
        if mutation == "halve":
            new = _insert_before(result.gm, put, aten.mul.Tensor, base, 0.5)
        else:
            new = _insert_before(result.gm, put, aten.zeros_like.default, base)
        put.args = (new, *put.args[1:])
        with pytest.raises(dpfx.PrivacyError, match=f"'0.weight'.*({match})"):
            verify_backward(result.gm, result.analysis, result.private, CONFIG)
        put.args = (base, *put.args[1:])
        verify_backward(result.gm, result.analysis, result.private, CONFIG)


# -- the CPU release: one dpfx::add_noise_ call (Note [Noise added in place]) ----------------

def _in_place(monkeypatch, strategy="ghost", x_shape=(3, 5, 8), **config_kwargs):
    monkeypatch.setattr(clip_noise, "NOISE_IN_PLACE", {"cpu"})
    kwargs = {**dict(max_grad_norm=CONFIG.max_grad_norm, noise_multiplier=CONFIG.noise_multiplier,
                     strategy=strategy), **config_kwargs}
    result, config = _rewritten_with(kwargs, x_shape)
    calls = [n for n in result.gm.graph.nodes if is_add_noise(n)]
    assert len(calls) == 1 and not any(n.meta.get("dpfx") == "noise_scale"
                                       for n in result.gm.graph.nodes)
    return result, config, calls[0]


@pytest.mark.parametrize("strategy,x_shape", [
    ("materialize", (3, 8)), ("ghost", (3, 8)), ("ghost", (3, 5, 8))])
@pytest.mark.parametrize("reduction,expected", [("mean", None), ("mean", 4), ("sum", None)])
def test_in_place_release_verifies(monkeypatch, strategy, x_shape, reduction, expected):
    result, config, call = _in_place(monkeypatch, strategy, x_shape, loss_reduction=reduction,
                                     expected_batch_size=expected)
    verify_backward(result.gm, result.analysis, result.private, config)
    # over tokens, the two biases' per-sample gradients are dpfx's own sums: one stacked base
    # (Note [Vector parameters' per-sample gradients stacked])
    stacked = 2 if len(x_shape) == 3 else 0
    assert call.kwargs["_sums_length"] == len(result.private) - max(stacked - 1, 0)
    slices = [o for o in result.private.values() if o.target is aten.slice.Tensor]
    assert len(slices) == stacked


def _stacked(monkeypatch, **config_kwargs):
    result, config, call = _in_place(monkeypatch, **config_kwargs)
    b1, b2 = result.private["fc1.bias"], result.private["fc2.bias"]
    assert b1.target is b2.target is aten.slice.Tensor and b1.args[0] is b2.args[0]
    assert b1.args[0].args == (call, b1.args[0].args[1])
    return result, config, b1, b2


def test_stacked_vector_parameters_verify_and_each_slice_is_its_own(monkeypatch):
    """Note [Vector parameters' per-sample gradients stacked]: the biases' per-sample
    gradients (sums over tokens) are one [B, N] tensor, one clipped sum, one noised base; each
    bias is its own slice of it. Slices that overlap would share noise entries; a slice with a
    step, along another dim or with bounds that are not constants is not read as one."""
    result, config, b1, b2 = _stacked(monkeypatch)
    verify_backward(result.gm, result.analysis, result.private, config)
    item, _, start, end = b2.args
    assert b1.args[1:] == (0, 0, start)
    for args, match in (((item, 0, start - 1, end), "share the noise"),
                        ((item, 0, start, end, 2), "step 1"),
                        ((item, 1, start, end), "step 1"),
                        ((item, 0, -3, end), "step 1")):
        b2.args = args
        with pytest.raises(dpfx.PrivacyError, match=match):
            verify_backward(result.gm, result.analysis, result.private, config)
    b2.args = (item, 0, start, end)
    verify_backward(result.gm, result.analysis, result.private, config)
    # a parameter released as the whole stacked base overlaps both slices
    private = _route_output(result, "fc1.bias", item)
    with pytest.raises(dpfx.PrivacyError, match="share the noise"):
        verify_backward(result.gm, result.analysis, private, config)


def test_stacked_vector_parameters_outside_the_norm_are_rejected(monkeypatch):
    """The stacked clipped sum must reduce the very tensor whose squares the norm sums: a
    stack with one member doubled after the norm was taken is refused."""
    result, config, b1, b2 = _stacked(monkeypatch)
    apply = next(n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "clip_apply"
                 and n.args[0].target is aten.cat.default)
    cat = apply.args[0]
    doubled = _insert_before(result.gm, apply, aten.mul.Tensor, cat.args[0][0], 2.0)
    with result.gm.graph.inserting_before(apply):
        other = result.gm.graph.call_function(aten.cat.default, ([doubled, *cat.args[0][1:]], 1))
    other.meta["val"] = cat.meta["val"]
    apply.args = (other, apply.args[1])
    with pytest.raises(dpfx.PrivacyError, match="not part of the per-sample norm"):
        verify_backward(result.gm, result.analysis, result.private, config)
    apply.args = (cat, apply.args[1])
    verify_backward(result.gm, result.analysis, result.private, config)


class _TwoBiases(nn.Module):
    """Two biases added to one activation: one per-sample gradient node serves both."""

    def __init__(self):
        super().__init__()
        self.b1, self.b2 = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(6))
        self.ln, self.fc = nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(self.ln(x + self.b1 + self.b2)).mean(1)


def test_stacked_parts_that_are_one_node_are_noised_apart(monkeypatch):
    """Two parameters whose per-sample gradients are one node (Note [Emitted nodes are shared])
    are two parts of the stack, two slices of the noised sum: exact at sigma 0 (each counted in
    the norm), and with noise, two different draws."""
    monkeypatch.setattr(clip_noise, "NOISE_IN_PLACE", {"cpu"})
    torch.manual_seed(0)
    model = _TwoBiases()
    x, y = torch.randn(5, 4, 6) * 3, torch.randint(0, 3, (5,))
    for sigma in (0.0, 1.0):
        dp = dpfx.compile(model, max_grad_norm=0.05, noise_multiplier=sigma,
                          expected_batch_size=4, backend="eager")
        got = run_dpfx(dp, model, F.cross_entropy, x, y)
        private = dp._dpfx_backend.last_backward.private
        assert private["b1"].target is private["b2"].target is aten.slice.Tensor
        assert private["b1"].args[2:] != private["b2"].args[2:]
        if sigma == 0.0:
            assert_close(got, dp_sgd_grads(model, F.cross_entropy, x, y, max_grad_norm=0.05,
                                           expected_batch_size=4))
            torch.testing.assert_close(got["b1"], got["b2"])
        else:
            assert not torch.allclose(got["b1"], got["b2"], atol=1e-3)


def test_stacked_vector_parameters_per_clipping_group(monkeypatch):
    """Per-layer clipping stacks within a group only: fc1's and fc2's biases each stay whole
    (one member per group), and the graph verifies."""
    result, config, call = _in_place(monkeypatch, max_grad_norm={"fc1": 0.1, "fc2": 0.3})
    verify_backward(result.gm, result.analysis, result.private, config)
    assert call.kwargs["_sums_length"] == len(result.private)
    assert not any(n.target is aten.cat.default for n in result.gm.graph.nodes)


@pytest.mark.parametrize("key,value,match", [
    ("std", 0.05, "not N\\(0, \\(sigma\\*C\\)\\^2\\)"),      # noise attenuated
    ("multiplier", 2.0, "not by 1/D"),                          # release amplified
    ("divisor", 1, "not by 1/D"),                               # mean loss, / B dropped
    ("_sums_0_base_index", 1, "whole, distinct sums"),          # one base noised twice
])
def test_in_place_release_with_wrong_arguments_is_rejected(monkeypatch, key, value, match):
    result, config, call = _in_place(monkeypatch)
    call.kwargs = {**call.kwargs, key: value}
    with pytest.raises(dpfx.PrivacyError, match=match):
        verify_backward(result.gm, result.analysis, result.private, config)


def test_in_place_release_with_an_amplified_or_shared_sum_is_rejected(monkeypatch):
    """The clipped sum doubled before the noise is added; two parameters released from one
    noised sum (their noise would be the same draw); a second call."""
    result, config, call = _in_place(monkeypatch)
    bases = list(call.kwargs["_all_bases"])
    bases[0] = _insert_before(result.gm, call, aten.mul.Tensor, bases[0], 2.0)
    call.kwargs = {**call.kwargs, "_all_bases": bases}
    with pytest.raises(dpfx.PrivacyError, match="lies between the clipped sum and the noise"):
        verify_backward(result.gm, result.analysis, result.private, config)

    result, config, call = _in_place(monkeypatch)
    private = _route_output(result, "fc1.bias", result.private["fc2.bias"])
    with pytest.raises(dpfx.PrivacyError, match="share the noise"):
        verify_backward(result.gm, result.analysis, private, config)

    result, config, call = _in_place(monkeypatch)
    output = result.gm.graph.find_nodes(op="output")[0]
    with result.gm.graph.inserting_before(output):
        result.gm.graph.call_function(call.target, call.args, dict(call.kwargs))
    with pytest.raises(dpfx.PrivacyError, match="add_noise_ 2 times"):
        verify_backward(result.gm, result.analysis, result.private, config)


def test_in_place_release_that_skips_the_noise_is_rejected(monkeypatch):
    """An output taken from the clipped sum itself, before add_noise_: no noise reaches it."""
    result, config, call = _in_place(monkeypatch, "materialize", (3, 8))
    name = next(n for n, out in result.private.items()
                if through_release_moves(out).args[1:] == (1,))
    base = call.kwargs["_all_bases"][0]
    private = _route_output(result, name, base)
    with pytest.raises(dpfx.PrivacyError, match="no noise is added"):
        verify_backward(result.gm, result.analysis, private, config)


def test_tied_ghost_release_and_norm_are_checked(monkeypatch):
    """Note [Tied weights without per-sample gradients]: a tied table's release is the add of its
    uses' clipped sums; one use amplified before the add is refused, and so is a norm that drops
    a use (its clipped sum's operands are then outside what the clip factor was taken over)."""
    from support.models import TiedLM
    monkeypatch.setattr(clip_noise, "NOISE_IN_PLACE", {"cpu"})

    def rewritten():
        model = TiedLM(7, 8, last_only=True)
        dp = dpfx.compile(model, max_grad_norm=0.1, noise_multiplier=1.0, backend="eager",
                          strategy="ghost")
        dp(torch.randint(0, 7, (3, 4)))
        result = dp._dpfx_backend.last_backward
        assert next(p for p in result.grads if p.name == "tok.weight").strategy == "ghost"
        return result, dp.dp_config

    result, config = rewritten()
    verify_backward(result.gm, result.analysis, result.private, config)
    sums = [n for n in result.gm.graph.nodes if n.meta.get("dpfx") == "clipped_sum"
            and any(u.target is aten.add.Tensor for u in n.users)]
    assert sums
    doubled = _insert_before(result.gm, next(iter(sums[0].users)), aten.mul.Tensor, sums[0], 2.0)
    for user in list(sums[0].users):
        if user is not doubled and user.target is aten.add.Tensor:
            user.replace_input_with(sums[0], doubled)
    with pytest.raises(dpfx.PrivacyError, match="tok.weight.*lies between the clipped sum"):
        verify_backward(result.gm, result.analysis, result.private, config)

    result, config = rewritten()
    clamp = next(n for n in result.gm.graph.nodes if n.target is aten.clamp_min.default
                 and n.meta["val"].dtype.is_floating_point)
    total = clamp.args[0]
    while total.target is aten.add.Tensor:
        total = total.args[0]          # the first use's own ghost norm alone
    clamp.args = (total, *clamp.args[1:])
    with pytest.raises(dpfx.PrivacyError, match="not part of the per-sample norm"):
        verify_backward(result.gm, result.analysis, result.private, config)
