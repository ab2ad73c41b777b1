"""`make test` (pytest-xdist workers, `--dist loadgroup`) keeps each integration module on one
worker and hands the longest groups out first.

Under pytest 9.2 with pytest-xdist 3.8 the group mark alone did nothing (pytest-dev/pytest-xdist
#1386): the two tests of one module went to two workers, so a module's run (the e2e pipeline)
was built on both. Here the repository's own `tests/conftest.py` groups a throwaway suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
#: A test that records which xdist worker ran it.
RECORD = """
import os
from pathlib import Path


def test_{name}() -> None:
    Path("{out}", "{module}-{name}").write_text(os.environ["PYTEST_XDIST_WORKER"])
"""


def test_tests_of_one_integration_module_share_a_worker(pytester: pytest.Pytester) -> None:
    out = pytester.mkdir("workers")
    pytester.makeconftest(CONFTEST.read_text())
    for module in ("alpha", "beta"):
        tests = "".join(RECORD.format(name=n, out=out, module=module) for n in ("one", "two"))
        pytester.makepyfile(**{f"tests/integration/test_{module}": tests})
    result = pytester.runpytest_subprocess(
        "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=4)
    workers = {path.name: path.read_text() for path in out.iterdir()}
    assert len(workers) == 4
    for module in ("alpha", "beta"):
        assert workers[f"{module}-one"] == workers[f"{module}-two"], workers


#: A module whose tests use `fixture` and append the module's name to one file as they run.
MODULE = """
import pytest


@pytest.fixture
def {fixture}() -> None:
    return None
"""
APPEND = """

def test_{index}({fixture}: None) -> None:
    with open("{out}", "a") as file:
        file.write("{name}\\n")
"""


def test_the_longest_groups_run_first_and_the_flow_runs_apart(pytester: pytest.Pytester) -> None:
    """One worker runs the groups in the order they are handed out: the e2e run, the flow runs
    (apart from the Prefect group, though they use its server), the Prefect group, the vLLM
    group, then the other groups, and the tests of no group last; xdist alone would start with
    the module of most tests."""
    out = pytester.path / "order.txt"
    pytester.makeconftest(CONFTEST.read_text())
    suite = {  # module: (the fixture its tests use, how many tests)
        "tests/e2e/test_reverse_text": ("run", 1),
        "tests/integration/inference/test_served": ("pool", 1),
        "tests/integration/prefect/test_deployed": ("prefect_api", 1),
        "tests/integration/prefect/test_flow_runs": ("prefect_api", 1),
        "tests/integration/test_many": ("folder", 3),
        # of no group, and collected before the module groups (the suite collects tests/unit
        # first, `testpaths`)
        "tests/gpu/test_alone": ("tmp_path", 1),
    }
    for module, (fixture, count) in suite.items():
        name = module.rsplit("/", 1)[-1]
        tests = [APPEND.format(index=i, fixture=fixture, out=out, name=name) for i in range(count)]
        pytester.makepyfile(**{module: MODULE.format(fixture=fixture) + "".join(tests)})
    result = pytester.runpytest_subprocess(
        "-n", "1", "--dist", "loadgroup", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=8)
    assert out.read_text().split() == [
        "test_reverse_text",
        "test_flow_runs",
        "test_deployed",
        "test_served",
        *["test_many"] * 3,
        "test_alone",
    ]
