"""Names renamed in this release, accepted under their old names for one release with a
DeprecationWarning that names the new one: the keyword ``target_quantile`` (now
``target_unclipped_quantile``, Opacus's name) at every entry point that takes it, an adaptive
state saved under it, and ``dpfx.stats`` (now ``dpfx.norms``).
"""
import inspect
import warnings

import pytest
import torch
from torch.utils.data import TensorDataset

import dpfx
from dpfx.privacy.adaptive import AdaptiveClip
from support.models import MLP

ADAPTIVE = dict(max_grad_norm=1.0, noise_multiplier=1.0, clipping="adaptive",
                count_noise_multiplier=5.0)
NAMED_NEW = "target_quantile= is renamed target_unclipped_quantile="


def compiled(**quantile):
    return dpfx.compile(MLP(), **ADAPTIVE, **quantile).dp_config


def made_private(**quantile):
    model = MLP()
    data = TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return dpfx.make_private(model, optimizer, data, batch_size=4, **ADAPTIVE,
                             **quantile).model.dp_config


def made_private_with_epsilon(**quantile):
    model = MLP()
    data = TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = {k: v for k, v in ADAPTIVE.items() if k != "noise_multiplier"}
    return dpfx.make_private_with_epsilon(
        model, optimizer, data, batch_size=4, target_epsilon=8.0, target_delta=1e-5, epochs=1,
        **settings, **quantile).model.dp_config


def trained(tmp_path, **quantile):
    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("dpfx.hf")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                          save_strategy="no", per_device_train_batch_size=4)
    rows = [{"x": torch.randn(8), "labels": torch.tensor(0)} for _ in range(16)]
    return hf.DPTrainer(model=MLP(), args=args, train_dataset=rows, **ADAPTIVE,
                        **quantile).model.dp_config


def clipping(**quantile):
    return dpfx.Clipping("adaptive", count_noise_multiplier=5.0, **quantile)


ENTRIES = {"compile": compiled, "make_private": made_private,
           "make_private_with_epsilon": made_private_with_epsilon, "DPTrainer": trained,
           "Clipping": clipping}


def call(entry, tmp_path, **quantile):
    kwargs = dict(tmp_path=tmp_path) if entry == "DPTrainer" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpfx.DPFXWarning)
        return ENTRIES[entry](**kwargs, **quantile)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_the_old_quantile_keyword_warns_and_sets_what_the_new_one_sets(entry, tmp_path):
    new = call(entry, tmp_path, target_unclipped_quantile=0.7)
    with pytest.warns(DeprecationWarning, match=NAMED_NEW) as caught:
        old = call(entry, tmp_path, target_quantile=0.7)
    assert old == new and new != call(entry, tmp_path)      # 0.7 is not the default
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1 and deprecations[0].filename == __file__   # the caller's line


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_the_old_quantile_keyword_is_checked_under_the_new_name(entry, tmp_path):
    with pytest.warns(DeprecationWarning, match=NAMED_NEW), \
            pytest.raises(dpfx.OptionValueError, match="target_unclipped_quantile must be"):
        call(entry, tmp_path, target_quantile=2.0)


def test_both_names_of_the_quantile_at_once_are_refused():
    with pytest.raises(dpfx.OptionError, match="give target_unclipped_quantile= alone"):
        dpfx.compile(MLP(), **ADAPTIVE, target_quantile=0.7, target_unclipped_quantile=0.7)


def test_the_entry_points_show_the_new_keyword_only():
    for fn in (dpfx.compile, dpfx.make_private, dpfx.Clipping):
        parameters = inspect.signature(fn).parameters
        assert "target_unclipped_quantile" in parameters and "target_quantile" not in parameters


def test_an_adaptive_state_saved_under_the_old_name_resumes():
    saved = AdaptiveClip(1.0, 0.7, 0.2, 5.0)
    saved.released(-3.0, 16)        # the bound moves, so the load below has something to set
    state = saved.state_dict()
    state["target_quantile"] = state.pop("target_unclipped_quantile")
    resumed = AdaptiveClip(1.0, 0.7, 0.2, 5.0)
    resumed.load_state_dict(state)
    assert (resumed.bound, resumed.steps) == (saved.bound, 1) and saved.bound != 1.0
    with pytest.raises(ValueError, match="target_unclipped_quantile=0.7"):
        AdaptiveClip(1.0, 0.5, 0.2, 5.0).load_state_dict(state)


def test_dpfx_stats_is_dpfx_norms_with_a_warning():
    assert dpfx.norms.NormStats.__module__ == "dpfx.ops.norms" and "norms" in dpfx.__all__
    with pytest.warns(DeprecationWarning, match="dpfx.stats is renamed dpfx.norms"):
        assert dpfx.stats is dpfx.norms
    assert "stats" not in dpfx.__all__
    with pytest.raises(AttributeError, match="no attribute 'statistics'"):
        dpfx.statistics
