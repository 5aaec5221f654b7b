"""One bad option, one error type, at every entry point, before the model is touched.

``dpfx.compile``, ``make_private``, ``DPTrainer``, ``DPOptimizer`` and ``dpfx.opacus``'s
``make_private`` take their options through one validation (privacy/validate.py and
``dpfx.Clipping``): a value none of them can take raises ``dpfx.OptionValueError`` (a
``ValueError``, as before) naming the option, and the user's model and optimizer are as they
were. ``dpfx.Clipping`` and the loose clipping keywords are the same option.
"""
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dpfx
from dpfx.opacus import PrivacyEngine
from support.models import MLP

ADAPTIVE = dict(clipping="adaptive", count_noise_multiplier=5.0)
GOOD = dict(max_grad_norm=1.0, noise_multiplier=1.0)


def data():
    return TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,)))


def via_compile(model, **bad):
    dpfx.compile(model, **{**GOOD, **bad})


def via_make_private(model, **bad):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    size = {} if "sample_rate" in bad else dict(batch_size=4)
    dpfx.make_private(model, optimizer, data(), **size, **{**GOOD, **bad})


def via_opacus(model, **bad):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    PrivacyEngine().make_private(module=model, optimizer=optimizer,
                                 data_loader=DataLoader(data(), batch_size=4),
                                 **{**GOOD, **bad})


def via_dp_optimizer(model, **bad):
    dp_model = dpfx.compile(model, **GOOD)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dpfx.DPOptimizer(optimizer, dp_model, accountant=dpfx.privacy.Accountant(), **bad)


def via_trainer(model, tmp_path, **bad):
    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("dpfx.hf")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                          save_strategy="no", per_device_train_batch_size=4)
    rows = [{"x": torch.randn(8), "labels": torch.tensor(0)} for _ in range(16)]
    hf.DPTrainer(model=model, args=args, train_dataset=rows, **{**GOOD, **bad})


ENTRIES = {"compile": via_compile, "make_private": via_make_private, "opacus": via_opacus,
           "DPTrainer": via_trainer}
# the same bad value of each option, given to every entry point that takes the option
CASES = [
    (dict(max_grad_norm=-1.0), "max_grad_norm must be finite and > 0", list(ENTRIES)),
    (dict(noise_multiplier=-1.0), "noise_multiplier must be a finite number >= 0",
     list(ENTRIES)),
    (dict(target_unclipped_quantile=2.0, **ADAPTIVE),
     "target_unclipped_quantile must be a number in \\(0, 1\\)",
     ["compile", "make_private", "DPTrainer"]),     # Opacus's surface clips flat or per layer
    (dict(clipping="quantile"), "clipping must be one of", list(ENTRIES)[:2] + ["DPTrainer"]),
]


@pytest.mark.parametrize("bad,match,entry", [
    pytest.param(bad, match, entry, id=f"{entry}-{next(iter(bad))}")
    for bad, match, entries in CASES for entry in entries])
def test_a_bad_option_raises_one_type_at_every_entry_point(bad, match, entry, tmp_path):
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    call = ENTRIES[entry]
    kwargs = dict(tmp_path=tmp_path) if entry == "DPTrainer" else {}
    with warnings.catch_warnings(), pytest.raises(dpfx.OptionValueError, match=match) as err:
        warnings.simplefilter("ignore", dpfx.DPFXWarning)
        call(model, **kwargs, **bad)
    # catchable as before: a ValueError, and an option mistake
    assert isinstance(err.value, ValueError) and isinstance(err.value, dpfx.OptionError)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert type(model) is MLP and not hasattr(model, "_dpfx_backend")
    assert not any(p._backward_hooks for p in model.parameters())


def test_a_bad_sample_rate_raises_one_type_at_every_entry_point_that_takes_it():
    for entry in (via_make_private, via_dp_optimizer):
        model = MLP()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(dpfx.OptionValueError, match="sample_rate must be in \\(0, 1\\]"):
            entry(model, sample_rate=-0.5)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert all(p.grad is None for p in model.parameters())


def test_clipping_is_one_option_object_or_its_keywords():
    keywords = dict(clipping="adaptive", target_unclipped_quantile=0.7, clip_lr=0.1,
                    count_noise_multiplier=3.0)
    spec = dpfx.Clipping("adaptive", target_unclipped_quantile=0.7, clip_lr=0.1,
                         count_noise_multiplier=3.0)
    by_keywords = dpfx.compile(MLP(), **GOOD, **keywords).dp_config
    by_object = dpfx.compile(MLP(), **GOOD, clipping=spec).dp_config
    assert by_keywords == by_object and by_object.clip == spec
    assert (by_object.clipping, by_object.target_unclipped_quantile, by_object.clip_lr,
            by_object.count_noise_multiplier) == ("adaptive", 0.7, 0.1, 3.0)
    # the defaults are Clipping's, whichever way the option comes
    plain = dpfx.compile(MLP(), **GOOD).dp_config
    assert plain.clip == dpfx.Clipping("flat") and plain.clipping_gamma == 0.01
    assert dpfx.compile(MLP(), max_grad_norm={"": 1.0}, noise_multiplier=1.0) \
        .dp_config.clipping == "per_layer"
    # make_private passes the object on unchanged
    model = MLP()
    private = dpfx.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data(),
                                batch_size=4, clipping=spec, **GOOD)
    assert private.model.dp_config.clip == spec
    # the object carries its own options: none beside it
    with pytest.raises(dpfx.OptionError, match="give clip_lr in it, not beside it"):
        dpfx.compile(MLP(), **GOOD, clipping=spec, clip_lr=0.3)
    with pytest.raises(dpfx.OptionError, match="a name .* or a dpfx.Clipping"):
        dpfx.compile(MLP(), **GOOD, clipping=3)
    with pytest.raises(dpfx.OptionValueError, match="clip_lr must be a finite number > 0"):
        dpfx.Clipping("adaptive", clip_lr=0.0)
