"""How many examples a hypothesis sweep that compiles draws.

Each example of such a sweep is a dpfx.compile (dynamo, aot_autograd, the passes), about a second
on 2 cores, so these sweeps were the largest share of the suite's time. `make test` draws half of
each sweep's examples (at least 3; all of a sweep of 3 or fewer), which keeps the default run
within its 20 minutes on 2 cores; `make test-all` (DPFX_TEST_SWEEP=full) draws them all."""
import os

FULL = os.environ.get("DPFX_TEST_SWEEP") == "full"


def examples(n: int) -> int:
    return n if FULL else max(min(n, 3), (n + 1) // 2)
