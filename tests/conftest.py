"""Plumbing every test folder shares: which tests must share a pytest-xdist worker.

`make test` runs on `TEST_WORKERS` pytest-xdist workers (3; 0 runs serially) with `--dist
loadgroup`. A session server (vLLM, Prefect) starts once per worker that needs it, so every
test using one is put in that server's group and runs on one worker: each server still starts
once per run, and the other workers take the tests that need none. The other integration and
end-to-end tests are grouped by module, so a module-scoped fixture (a run, a server of the
module's own) is built once; unit tests go to whichever worker is free.

The groups that take longest are handed out first (`LONGEST_FIRST`), then the other groups, and
the tests of no group last, to fill the end of the run: xdist would order the groups by their
number of tests, and the Prefect group (two thirds of it the two flow-run tests) then
kept one worker busy alone for the last 46-62 s of the run. `test_flow_runs.py`
runs apart from the rest of the Prefect group (`APART`), with a Prefect server of its own on its
worker, so the two halves run side by side (docs/benchmarks.md, "The longest groups first").

Every process of the run (the workers, and the servers, trainers and flow runs they start)
gets `OMP_WAIT_POLICY=PASSIVE` unless the caller set it: on the 2-core machine those processes
share the cores, and libgomp's default is to spin at every barrier before sleeping, which burns
the core another process was waiting for. It cut the suite's user CPU by ~2 minutes and brought
its time to 0.8-0.9x (docs/benchmarks.md, "OpenMP threads that sleep"). It is set here, before any
test imports torch, because libgomp reads it once, when it is loaded.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

#: The fixture that starts a session server → the group of the tests that use it (the first
#: match wins: a test needing both servers joins the vLLM group, whose worker starts Prefect).
SERVER_GROUPS = (("pool", "vllm"), ("lora_pool", "vllm"), ("prefect_api", "prefect"))
#: Folders whose tests are kept together by module.
BY_MODULE = ("tests/integration/", "tests/e2e/")
#: Modules that use a session server but run on a worker of their own, which starts a second one.
APART = ("tests/integration/prefect/test_flow_runs.py",)
#: The groups handed out first, in this order (the longest; the rest follow in their order).
LONGEST_FIRST = (
    "tests/e2e/test_reverse_text.py",
    "tests/integration/prefect/test_flow_runs.py",
    "prefect",
    "vllm",
)
_RANK = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    """Keep the order `pytest_collection_modifyitems` gives, not xdist's by number of tests."""
    config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        group = next((name for fixture, name in SERVER_GROUPS if fixture in fixtures), None)
        module = item.nodeid.split("::", 1)[0]
        if (group is None and module.startswith(BY_MODULE)) or module in APART:
            group = module
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            if getattr(config.option, "loadgroup", False) and hasattr(item, "_id"):
                _suffix_group(item, group)
        item.stash[_RANK] = _rank(group)
    items.sort(key=lambda item: item.stash[_RANK])


def _rank(group: str | None) -> int:
    """The longest groups in their order, then the other groups, then the tests of no group:
    those are short and go to any worker, so they fill the end of the run, where a module
    group handed out last (a trainer module's ~50 s) kept one worker busy while two waited."""
    if group in LONGEST_FIRST:
        return LONGEST_FIRST.index(group)
    return len(LONGEST_FIRST) + (group is None)


def _suffix_group(item: pytest.Item, group: str) -> None:
    """Write the group into the test's id, where xdist's scheduler reads it.

    pytest 9.2 derives `nodeid` from a structured id, so the suffix xdist 3.8 writes to the
    old `_nodeid` is lost and every test is scheduled alone (pytest-dev/pytest-xdist#1386):
    a module's run would be built once per worker, a session server started on each."""
    from _pytest.nodeid import NodeId

    item._id = NodeId.parse(f"{item.nodeid}@{group}")
