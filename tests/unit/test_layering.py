"""The layering rules of docs/architecture.md hold, and `lint-imports` (`make lint`) fails when
one is broken: a copy of the packages gets a planted violation of each kind."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "storage", "tasks", "flows")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}  # the copy, not the installed checkout
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("layers")
    for package in PACKAGES:
        shutil.copytree(
            REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(REPO / "pyproject.toml", root)
    return root


def test_the_tree_keeps_every_contract(copy: Path) -> None:
    result = lint(copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("edits", "contracts"),
    [
        ({"storage/planted.py": "import prefect\n"}, ["never import Prefect"]),
        ({"storage/planted.py": "import engine.config\n"}, ["storage imports", "flows above"]),
        ({"engine/planted.py": "import tasks.stages\n"}, ["never import Prefect", "flows above"]),
        (  # a cycle needs both directions
            {"flows/planted.py": "import flows.cli\n", "flows/cli.py": "import flows.planted\n"},
            ["no import cycles"],
        ),
        ({"engine/trainer/planted.py": "import engine.inference.pool\n"}, ["pools never import"]),
        (
            {"engine/tenancy/shared_trainer.py": "import engine.inference.pool\n"},
            ["never imports the inference pool"],
        ),
        (
            {"engine/tenancy/attached.py": "import engine.trainer.model\n"},
            ["never imports the trainer pool"],
        ),
    ],
)
def test_a_planted_violation_fails_the_check(
    copy: Path, edits: dict[str, str], contracts: list[str]
) -> None:
    """Each edit appends an import to a module of the copy (a new one, or an existing one)."""
    originals = {
        path: (copy / path).read_text() if (copy / path).exists() else None for path in edits
    }
    for path, code in edits.items():
        (copy / path).write_text((originals[path] or "") + "\n" + code)
    try:
        result = lint(copy)
    finally:
        for path, original in originals.items():
            if original is None:
                (copy / path).unlink()
            else:
                (copy / path).write_text(original)
    assert result.returncode != 0
    found = verdicts(result.stdout)
    assert len(found) == 7, result.stdout
    broken = [name for name, status in found if status == "BROKEN"]
    assert broken == [name for name, _ in found if any(c in name for c in contracts)], broken


def verdicts(output: str) -> list[tuple[str, str]]:
    """(contract name, KEPT or BROKEN) from lint-imports' summary (names wrap over lines)."""
    summary = output.split("--------------------------------------", 1)[1].split("Contracts:")[0]
    flat = " ".join(summary.split())
    return [(name.strip(), status) for name, status in re.findall(r"(.+?) (KEPT|BROKEN)", flat)]


def test_a_flow_runs_process_imports_neither_torch_nor_transformers() -> None:
    """A flow run's process (and `primeflow pipeline`) drives pools and reads storage's names
    and headers; tensors live in the trainer and vLLM. Importing torch and transformers cost
    each such process ~2 s of its ~5 s start on the 2-core machine."""
    code = "import sys, flows.pipeline; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
