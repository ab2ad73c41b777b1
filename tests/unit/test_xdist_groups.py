"""`make test` (pytest-xdist workers, `--dist loadgroup`) keeps each integration module on one
worker.

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
