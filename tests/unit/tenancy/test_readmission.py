"""Every answer of the shared trainer names the tenant's latest admission (issue 34): a trainer
that admits a tenant again and finishes it between two of its stage's polls overwrites the
`admitted` answer, and the stage must still see that it was admitted again.
(`tests/integration/inference/test_adapter_servers.py` plays the whole race on real servers.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.tenancy.files import TenantFiles


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRIMEFLOW_HOME", str(tmp_path / "home"))


def test_every_answer_names_the_latest_admission() -> None:
    files = TenantFiles("p", "r")
    files.answer("a", "admitted", 1.0, step=0)
    files.answer("a", "admitted", 2.0, step=6)
    files.answer("a", "finished", 2.0, step=8)
    state = files.state("a")
    assert state is not None and state["status"] == "finished" and state["step"] == 8
    assert state["admitted_at"] == 2.0
    files.answer("b", "refused", error="no slot")
    assert "admitted_at" not in files.state("b")  # type: ignore[operator]
