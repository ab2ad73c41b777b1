"""`trainer.num_threads` reaches the ranks as OMP_NUM_THREADS (and nothing is set without it)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import load_config
from engine.trainer import pool as pool_module
from engine.trainer.pool import TrainerPool


class FakePopen:
    seen: dict[str, Any] = {}

    def __init__(self, command: list[str], **kwargs: Any) -> None:
        FakePopen.seen = {"command": command, **kwargs}
        self.pid = 12345

    def poll(self) -> int:
        return 0


@pytest.mark.parametrize(("flag", "expected"), [([], None), (["--trainer.num-threads", "1"], "1")])
def test_num_threads_sets_omp_num_threads(monkeypatch, flag, expected) -> None:
    monkeypatch.setattr(pool_module.subprocess, "Popen", FakePopen)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    pool = TrainerPool(load_config(flag), "rl")
    pool.start()
    assert FakePopen.seen["env"].get("OMP_NUM_THREADS") == expected
    pool.stop()
