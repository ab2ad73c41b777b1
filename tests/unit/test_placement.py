"""Core lists: parsing, config errors, and binding a process (in a child, to leave ours alone)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.config import ConfigError, load_config
from engine.placement import parse_cores


@pytest.mark.parametrize(
    ("spec", "cores"),
    [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0,2,4-5", {0, 2, 4, 5}), ("0-1|2-3", {0, 1, 2, 3})],
)
def test_core_lists_parse(spec: str, cores: set[int]) -> None:
    assert parse_cores(spec) == cores


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("", "not a core list"),
        ("a", "not a core list"),
        ("1-", "not a core list"),
        ("3-1", "backwards"),
    ],
)
def test_bad_core_lists_say_what_is_wrong(spec: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_cores(spec)


def test_bad_core_lists_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"^command line: trainer\.cpu_cores: .*'0-x'"):
        load_config(["--trainer.cpu-cores", "0-x"])
    with pytest.raises(ConfigError, match=r"inference.*'two'"):
        load_config(["--inference.cpu-cores", '["two"]'])


def bound_child(spec: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import os, sys; from engine.placement import bind_to_cores; "
        "bind_to_cores(sys.argv[1], 'trainer.cpu_cores'); "
        "print(sorted(os.sched_getaffinity(0)))"
    )
    return subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True)


def test_binding_restricts_the_process_to_its_cores() -> None:
    first = min(os.sched_getaffinity(0))
    child = bound_child(str(first))
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == f"[{first}]"


def test_binding_to_a_core_the_process_may_not_use_names_the_setting() -> None:
    beyond = max(os.sched_getaffinity(0)) + 1
    child = bound_child(str(beyond))
    assert child.returncode != 0
    assert f"trainer.cpu_cores = '{beyond}': cores [{beyond}] are not available" in child.stderr
