import os
import sys

import pytest
import torch
import torch._inductor.config

sys.path.insert(0, os.path.dirname(__file__))

# Tests run on 2 cores, in 2 pytest-xdist workers under `make test`. ATen's ops get the cores
# shared among the workers: two workers' thread teams on two cores made the suite 10-15% slower
# (cold Inductor cache, 2026-11-26). Inductor's kernels keep the parallel code users compile
# (cpp.threads: the cores, at most 2); dpfx's own C kernels are tested at 1 and 2 threads by name.
_CORES = max(1, min(2, os.cpu_count() or 1))
torch.set_num_threads(max(1, _CORES // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
torch._inductor.config.cpp.threads = _CORES

# Note [Inductor lowers the fake values dpfx proved] (dpfx/lower/shape_patches.py): in every test
# that lowers a dpfx graph, Inductor's propagation runs anyway, on the side, and must give every
# node the value dpfx kept; the graph is then lowered on the kept values, as outside the tests.
import dpfx.lower.shape_patches  # noqa: E402

dpfx.lower.shape_patches._CHECK_KEPT_VALUES = True

# Note [A trusted warm start] (dpfx/lower/trust.py): tests compile the same models under the same
# settings again and again, and many plant a fault in a pass or spy on one; each compile proves
# its graphs again, as an auditor's run would. tests/lower/test_warm_start.py runs the trusted
# path users get.
os.environ.setdefault("DPFX_REPROVE", "1")


@pytest.fixture(autouse=True)
def _seed():
    # A fresh dynamo per test: automatic dynamic shapes would otherwise carry symbolic sizes from
    # one test's model into the next one of the same class.
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield



@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The default run's budget (tests/support/default_run.py): the tests listed there are
    marked slow. When the whole suite is collected, a listed test that no longer exists is an
    error, so the list stays true when tests are renamed."""
    from support.default_run import SLOW_IN_THE_DEFAULT_RUN

    seen = set()
    for item in items:
        if item.nodeid in SLOW_IN_THE_DEFAULT_RUN:
            item.add_marker(pytest.mark.slow)
            seen.add(item.nodeid)
    whole_suite = not config.args or list(config.args) == config.getini("testpaths")
    missing = sorted(set(SLOW_IN_THE_DEFAULT_RUN) - seen)
    if whole_suite and missing and not hasattr(config, "workerinput"):
        raise pytest.UsageError(f"tests/support/default_run.py lists tests that are not "
                                f"collected: {missing}")
