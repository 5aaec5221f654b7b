import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Tests run on 2 cores: keep torch from oversubscribing them.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    # A fresh dynamo per test: automatic dynamic shapes would otherwise carry symbolic sizes from
    # one test's model into the next one of the same class.
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
