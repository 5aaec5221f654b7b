"""Refusals of the loss guard and the self-check that no other test triggers, each from user
code (or, for the self-check, a planted miscompile) through the public API: the exact error
type, a fragment of that refusal's own message (so another refusal cannot pass the test), and,
where the refusal comes before any gradient is written, parameters left without one.

Not here, because no user code (or single planted bug) was found to reach them: the
self-check's "released a gradient the smaller batch did not" (the smaller size accounts every
release position it is given), a rounding division (``rounding_mode`` is an argument of
``div.Tensor_mode``, which the loss walk never treats as a product: it is refused as a
non-linear op), and the captured loss's input that is neither a tensor nor a size, its model
intermediate (dynamo returns an escaping intermediate as a graph output: the one-tensor rule
refuses first) and its tensor without the batch in dim 0 (``dp.loss`` checks its targets
first, and a tensor the loss closes over is refused as a parameter or buffer). Nor the loss
check's "picks rows along the batch dim by index": every indexing op it would name reads a
batched tensor, so the mixing-op walk before it (passes/verify/, ``mixing_ops``) has already
refused that op, as "indexes the batch dim ... not proven to hold each row's own index" (the
same condition, passes/indexing.py) or as a reduction or an ambiguous layout; it stands behind
that walk. Nor the self-check's exact comparison of a backward output: it compares outputs that
are not floating, and a backward graph returns only gradients, which autograd makes floating,
and adaptive clipping's count of unclipped examples, a float too. The forward that did not run
through dpfx's compiled graph, and ordinary code beside these refusals, are in
test_refusal_gaps.py.
"""
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpfx
import dpfx.backend


def _mlp(features=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, 4))


def _untouched(model):
    return all(p.grad is None for p in model.parameters())


def _plain(model):
    return dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")


def _captured(model, loss):
    return dpfx.compile(model, loss=loss, max_grad_norm=1.0, noise_multiplier=0.0,
                        backend="eager")


# -- the self-check --------------------------------------------------------------------------------
def test_self_check_refuses_a_non_finite_release_at_the_larger_size(monkeypatch):
    """S7d: the compiled backward releases an infinite gradient at the larger check size only."""
    real_lower = dpfx.backend.lower

    def lower(gm, example_inputs, kwargs, backend):
        compiled = real_lower(gm, example_inputs, kwargs, backend)
        if not kwargs.get("is_backward"):
            return compiled

        def wrong(args):
            # the planted bug: the first gradient output turns infinite where the inputs have
            # 3 rows (the self-check's larger size), right at every other size
            larger = any(isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == 3
                         for a in args)
            outs = list(compiled(args))
            if larger:
                outs[0] = outs[0] + float("inf")
            return outs

        wrong._boxed_call = True
        return wrong

    monkeypatch.setattr(dpfx.backend, "lower", lower)
    model = _mlp()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=1.0, self_check="always")
    with pytest.raises(dpfx.PrivacyError, match="and released a non-finite gradient") as e:
        F.mse_loss(dp(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    assert "dpfx's self-check of the compiled backward" in str(e.value)
    assert _untouched(model)


# -- the release gate ------------------------------------------------------------------------------
class _Box:
    """An output container dpfx does not look into (not a tuple, list, dict or ModelOutput)."""

    def __init__(self, t):
        self.t = t


class _BoxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = _mlp()

    def forward(self, x, box=False):
        out = self.f(x)
        return _Box(out) if box else out


def test_backward_graph_without_its_release_hook_is_refused():
    """G3: an output hidden in a custom object, backwarded beside a checked loss: refused before
    the backward, by the walk of the root dpfx did not check; and the backward graph's runner
    refuses to run without its release hook (the gate's own check, which fails closed)."""
    model = _BoxNet()
    dp = _plain(model)
    checked = F.mse_loss(dp(torch.randn(3, 8)), torch.randn(3, 4))
    hidden = F.mse_loss(dp(torch.randn(3, 8), box=True).t, torch.randn(3, 4))
    with pytest.raises(dpfx.PrivacyError, match=r"through a compiled function "
                                                r"\(CompiledFunctionBackward\) that dpfx did not "
                                                r"check: another forward"):
        torch.autograd.backward([checked, hidden])
    assert _untouched(model)
    gate = dp._dpfx_backend.gate
    with gate.proven(), pytest.raises(dpfx.PrivacyError,
                                      match="dpfx's backward graph ran without its release check"):
        gate.admit_backward()


def test_two_forwards_in_one_backward_call_are_refused_by_the_gate():
    """G4: two checked losses of two forwards backwarded in one torch.autograd.backward call."""
    model = _mlp()
    dp = _plain(model)
    first = F.mse_loss(dp(torch.randn(3, 8)), torch.randn(3, 4))
    second = F.mse_loss(dp(torch.randn(3, 8)), torch.randn(3, 4))
    with pytest.raises(dpfx.PrivacyError, match=re.escape(
            "Zero the gradients before retrying: the first forward's have been written")):
        torch.autograd.backward([first, second])


# -- the plain loop's tracking ---------------------------------------------------------------------
def test_in_place_write_into_an_untracked_tensor_that_requires_grad_is_refused():
    """T3: `acc += loss` where acc requires grad and dpfx does not follow it."""
    model = _mlp()
    dp = _plain(model)
    acc = torch.zeros((), requires_grad=True) * 1
    with pytest.raises(dpfx.PrivacyError, match="into a tensor dpfx does not follow"):
        acc += F.mse_loss(dp(torch.randn(3, 8)), torch.randn(3, 4))
    assert _untouched(model)


@torch.library.custom_op("dpfx_refusals::label_weight", mutates_args=())
def _label_weight(y: torch.Tensor) -> torch.Tensor:
    """A custom op with no fake implementation: it runs, but cannot be replayed symbolically."""
    return 1.0 + y * y


def test_a_loss_that_cannot_be_replayed_is_refused():
    """T9: the loader's labels weighted through a custom op the replay cannot trace."""
    from dpfx.loop.data import PoissonLoader

    x, y = torch.randn(6, 8), torch.randn(6, 4)
    loader = PoissonLoader(torch.utils.data.TensorDataset(x, y), batch_sampler=[list(range(6))])
    xb, yb = next(iter(loader))
    model = _mlp()
    dp = _plain(model)
    loss = (F.mse_loss(dp(xb), yb, reduction="none") * _label_weight(yb)).sum()
    with pytest.raises(dpfx.PrivacyError, match="dpfx cannot check the loss: op label_weight"
                       r"\.default .* could not be replayed with a symbolic batch size"):
        loss.backward()
    assert _untouched(model)


# -- check.py's reasons, through the plain loop ----------------------------------------------------
def _plain_refusal(loss_fn, match):
    model = _mlp()
    dp = _plain(model)
    loss = loss_fn(dp(torch.randn(3, 8)), torch.randn(3, 4))
    with pytest.raises(dpfx.PrivacyError, match=match) as e:
        loss()
    assert _untouched(model)
    return str(e.value)


def test_a_loss_that_is_not_a_single_number_is_refused():
    """C1: per-example losses backwarded with a gradient of ones, not their sum."""
    def loss(out, y):
        per = ((out - y) ** 2).sum(1)
        return lambda: per.backward(torch.ones_like(per))
    assert "the loss couples examples: op backward" in _plain_refusal(
        loss, "the loss is not a single number")


def test_an_in_place_scale_of_a_value_another_op_read_is_refused():
    """C2: `s.multiply_(2)` after `t = s * 1` read s (T2 checks mul_, not multiply_)."""
    def loss(out, y):
        s = F.mse_loss(out, y, reduction="sum")
        t = s * 1
        s.multiply_(2)
        return (s + t).backward
    _plain_refusal(loss, "scales in place a value that another op also reads")


def test_a_batched_value_reaching_the_loss_without_a_reduction_is_refused():
    """C3: one entry of a cat of a batch sum and every example's value."""
    def loss(out, y):
        return torch.cat([out.sum().view(1), out[:, 0]])[0].backward
    _plain_refusal(loss, "op cat .* reaches the loss without a sum or mean over the batch")


def test_a_non_numeric_scale_is_refused():
    """C8: the loss scaled by a complex number."""
    def loss(out, y):
        return (F.mse_loss(out, y) * (2 + 0j)).backward
    _plain_refusal(loss, re.escape("scales the loss by (2+0j)"))


def test_a_model_input_without_the_batch_in_dim_0_is_refused():
    """C15: the loader's batch transposed before the forward (examples along dim 1)."""
    from dpfx.loop.data import PoissonLoader

    x, y = torch.randn(6, 6), torch.randn(6, 4)
    loader = PoissonLoader(torch.utils.data.TensorDataset(x, y), batch_sampler=[list(range(6))])
    xb, _ = next(iter(loader))
    model = _mlp(6)
    dp = _plain(model)
    with pytest.raises(dpfx.PrivacyError, match="a model input couples examples: op input .* "
                       "does not carry the batch's examples in dim 0, one row each"):
        dp(xb.t())
    assert _untouched(model)


# -- the captured loss -----------------------------------------------------------------------------
def _captured_refusal(loss_fn, targets, match, backward=None):
    model = _mlp()
    dp = _captured(model, loss_fn)
    with pytest.raises(dpfx.PrivacyError, match=match) as e:
        loss = dp.loss(torch.randn(3, 8), *targets)
        (backward or (lambda l: l.backward()))(loss)
    assert _untouched(model)
    return str(e.value)


def test_a_data_dependent_size_scaling_the_captured_loss_is_refused():
    """C5: the captured loss divided by a nonzero count (captured as an unbacked size)."""
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        _captured_refusal(
            lambda out, y, m: F.mse_loss(out, y, reduction="sum") / m.nonzero().size(0),
            [torch.randn(3, 4), torch.tensor([1.0, 0.0, 1.0])],
            r"scales the loss by \w+, which depends on the data")


def test_a_scale_dpfx_cannot_undo_is_refused():
    """C14: the captured loss divided by B - 1 (the plain loop trains the same loss)."""
    _captured_refusal(lambda out, y: F.mse_loss(out, y, reduction="sum") / (out.size(0) - 1),
                      [torch.randn(3, 4)], "depends on the batch size in a way dpfx cannot undo")


def test_a_loss_function_returning_more_than_the_loss_is_refused():
    """K1: the loss function returns a tuple."""
    _captured_refusal(lambda out, y: (F.mse_loss(out, y), out.sum()), [torch.randn(3, 4)],
                      "must return one tensor, the loss")


def test_a_size_that_is_not_a_multiple_of_the_batch_is_refused():
    """K3: the captured loss divided by a target's dynamic second dim."""
    m = torch.randn(3, 5)
    torch._dynamo.mark_dynamic(m, 1)
    _captured_refusal(lambda out, y, m: F.mse_loss(out, y, reduction="sum") / m.size(1),
                      [torch.randn(3, 4), m], "that is not a multiple of the batch size")


def test_backward_of_a_captured_loss_with_other_roots_is_refused():
    """K8: torch.autograd.backward on the captured loss and another tensor."""
    other = torch.ones((), requires_grad=True)
    _captured_refusal(lambda out, y: F.mse_loss(out, y), [torch.randn(3, 4)],
                      "takes that loss alone",
                      backward=lambda l: torch.autograd.backward([l, other * 2]))
    assert other.grad is None


T = 4       # sequence length


# -- Hugging Face labels= --------------------------------------------------------------------------
def test_labels_under_per_user_for_a_head_that_indexes_along_k_are_refused():
    """H2: a question-answering head under per_user called with start and end positions."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertForQuestionAnswering(transformers.BertConfig(
        vocab_size=17, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    dp = _plain(dpfx.per_user(model))
    users, k = 2, 3
    with pytest.raises(dpfx.PrivacyError, match="BertForQuestionAnswering under per_user was "
                                                "given labels="):
        dp(input_ids=torch.randint(1, 17, (users, k, T)),
           start_positions=torch.randint(0, T, (users, k)),
           end_positions=torch.randint(0, T, (users, k)))
    assert _untouched(model)


# -- the captured loss's inputs from elsewhere -----------------------------------------------------
def test_a_captured_loss_whose_target_length_changes_is_refused():
    """Note [A captured loss's other sizes are fixed]: a target of (B, T) whose T changes from
    one call to the next is refused with the padding and the plain loop named, not a crash."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def loss(out, y):       # a token mean over (B, T) positions
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    dp = _captured(model, loss)
    dp.loss(torch.randn(3, 5, 8), torch.randint(0, 4, (3, 5))).backward()
    model.zero_grad(set_to_none=True)
    with pytest.raises(dpfx.PrivacyError, match="dims after the batch changed between calls"):
        dp.loss(torch.randn(3, 6, 8), torch.randint(0, 4, (3, 6))).backward()
    assert _untouched(model)


CLASS_WEIGHTS = torch.tensor([1.0, 2.0, 0.5, 1.5])


def test_a_global_tensor_in_a_captured_loss_is_named_as_such():
    """K6's neighbour: class weights the loss closes over are not a parameter; the refusal says
    what dpfx cannot tell about them and names the plain loop, which takes them as a constant
    (and trains exactly)."""
    from support.reference import assert_close, loop_dp_sgd_grads

    def loss(out, y):
        return F.cross_entropy(out, y, weight=CLASS_WEIGHTS, reduction="sum")

    model = _mlp()
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    dp = dpfx.compile(model, loss=loss, max_grad_norm=1.0, noise_multiplier=0.0,
                      loss_reduction="sum", backend="eager")
    with pytest.raises(dpfx.PrivacyError, match=r"from outside its arguments .* training loop"):
        dp.loss(x, y).backward()
    assert _untouched(model)
    plain = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, loss_reduction="sum",
                         backend="eager")
    loss(plain(x), y).backward()
    assert_close({k: p.grad for k, p in model.named_parameters()},
                 loop_dp_sgd_grads(model, loss, (x,), y, max_grad_norm=1.0,
                                   loss_reduction="sum"), rtol=1e-4, atol=1e-6)


def test_self_check_refuses_a_compiled_backward_that_drops_a_gradient(monkeypatch):
    """S2's neighbour: a compiled backward that returns no gradient where the verified graph
    has one is refused as a disagreement (it was an AttributeError inside the check)."""
    real_lower = dpfx.backend.lower

    def lower(gm, example_inputs, kwargs, backend):
        compiled = real_lower(gm, example_inputs, kwargs, backend)
        if not kwargs.get("is_backward"):
            return compiled

        def wrong(args):
            outs = list(compiled(args))
            first = next(i for i, o in enumerate(outs) if isinstance(o, torch.Tensor))
            outs[first] = None      # the planted bug: one gradient never returned
            return outs

        wrong._boxed_call = True
        return wrong

    monkeypatch.setattr(dpfx.backend, "lower", lower)
    model = _mlp()
    dp = dpfx.compile(model, max_grad_norm=1.0, noise_multiplier=0.0, self_check="always")
    with pytest.raises(dpfx.PrivacyError, match="compiled backward graph disagrees"):
        F.cross_entropy(dp(torch.randn(4, 8)), torch.randint(0, 4, (4,))).backward()
    assert _untouched(model)
