"""The pyarrow snippet of docs/storage.md runs as written against shards the writer made."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from storage.shards import write_rollouts
from storage.store import ObjectStore
from tests.unit.storage.samples import rows

DOC = Path(__file__).resolve().parents[3] / "docs" / "storage.md"


def _snippet(name: str) -> str:
    match = re.search(rf"<!-- snippet: {name} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/storage.md has no '{name}' snippet"
    return match.group(1)


def test_pyarrow_snippet_reads_committed_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    write_rollouts(ObjectStore("runs/my-run"), 42, rows(10, step=42), max_rows_per_shard=4)
    namespace: dict[str, object] = {}
    exec(compile(_snippet("pyarrow"), str(DOC), "exec"), namespace)
    assert namespace["rollouts"].num_rows == 10  # type: ignore[attr-defined]
    assert capsys.readouterr().out.split() == ["10", "0.5", "0.75"]
