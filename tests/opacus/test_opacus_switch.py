"""Opacus's own example loops switch to dpfx by their imports alone (benchmarks/opacus_switch.py).

Each test runs one example with Opacus and with dpfx.opacus (the source's ``from opacus``
imports rewritten, nothing else), from the same seed: dpfx's epsilon is within 2% of Opacus's
(PLD against PRV; RDP is the same analysis) and its loss on the training set falls, as
Opacus's does. The IMDB loop runs by default (its dpfx compile is the shortest); the others are slow.
"""
import os
import sys

import pytest

pytest.importorskip("opacus")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
import opacus_switch  # noqa: E402


def check_switch(name: str, **overrides):
    theirs = opacus_switch.run(name, "opacus", **overrides)
    ours = opacus_switch.run(name, "dpfx", **overrides)
    assert ours["steps"] == theirs["steps"] > 0
    assert ours["epsilon"] == pytest.approx(theirs["epsilon"], rel=0.02)
    assert ours["loss_before"] == pytest.approx(theirs["loss_before"], rel=0.01)  # DPLSTM vs nn.LSTM init
    assert theirs["loss_after"] < theirs["loss_before"]
    assert ours["loss_after"] < ours["loss_before"]


def test_only_the_imports_change():
    for name in opacus_switch.EXAMPLES:
        theirs = opacus_switch.source(name, "opacus").splitlines()
        ours = opacus_switch.source(name, "dpfx").splitlines()
        assert len(theirs) == len(ours)
        assert all(a == b or b.startswith("from dpfx.opacus") for a, b in zip(theirs, ours))


def test_imdb_loop_switches():
    check_switch("imdb", epochs=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mnist", "char_lstm", "image_classifier"])
def test_example_loop_switches_slow(name):
    check_switch(name)
