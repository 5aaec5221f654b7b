"""How much of each sweep that compiles the default run draws.

Each example of such a sweep is a dpfx.compile (dynamo, aot_autograd, the passes), about a second
on 2 cores, so these sweeps were the largest share of the suite's time. `make test` keeps within
its 20 minutes on 2 cores by drawing a third of each hypothesis sweep's examples (at least 3; all
of a sweep of 3 or fewer), by running each idiom of the loss corpora under one loss reduction,
the two reductions alternating along the corpus, so that each meets half the idioms, and by
running the captured form of every other idiom of the plain loop's corpus (the plain loop runs
them all). `make test-all` (DPFX_TEST_SWEEP=full) runs every example and every idiom under both
reductions in both forms."""
import os

FULL = os.environ.get("DPFX_TEST_SWEEP") == "full"


def examples(n: int) -> int:
    return n if FULL else max(min(n, 3), -(-n // 3))


def reductions(names: list[str], name: str) -> tuple[str, ...]:
    """The loss reductions corpus entry ``name`` (of ``names``, in their order) runs under."""
    if FULL:
        return ("mean", "sum")
    return (("mean", "sum")[names.index(name) % 2],)


def with_reductions(names: list[str]) -> list[tuple[str, str]]:
    """(name, reduction) for each entry of ``names`` under the reductions it runs under."""
    return [(n, r) for n in names for r in reductions(names, n)]


def every_other(names: list[str]) -> list[str]:
    """All of ``names`` in the full sweep; by default every other one."""
    return list(names) if FULL else list(names)[::2]
