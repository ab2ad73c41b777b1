"""`primeflow pools status`: each tenant's progress, from its own run's metric lines."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.config import PrimeflowConfig
from engine.run import run_store
from engine.tenancy.files import TenantFiles
from engine.tenancy.supervisor import status_of
from storage.metrics import recent_metrics, write_metrics


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PRIMEFLOW_HOME", str(tmp_path / "home"))
    return tmp_path


def tenant(tmp_path: Path, name: str) -> PrimeflowConfig:
    return PrimeflowConfig.model_validate(
        {
            "run": {"name": name},
            "storage": {"uri": f"file://{tmp_path}/runs"},
            "pools": {"name": "p"},
            "trainer": {"lora": {"rank": 8}},
        }
    )


def test_status_shows_each_tenants_newest_step_rate_and_heartbeat(tmp_path: Path) -> None:
    config = tenant(tmp_path, "a")
    files = TenantFiles("p", "a")
    attempt = files.request(config)
    files.answer(attempt, "admitted", step=0)  # the trainer's word: it says no more until the end
    store = run_store(config)
    began = time.time() - 100
    for step in range(1, 16):  # a step every 6 s, the newest 10 s ago
        write_metrics(store, "rl", step, {"time": began + 6 * step, "loss": 0.0})
    waiting = TenantFiles("p", "b")
    waiting.request(tenant(tmp_path, "b"))  # asked, nothing trained yet

    now = status_of("p")["tenants_now"]
    a, b = now["a"], now["b"]
    assert a["status"] == "admitted" and a["step"] == 0
    assert a["last_step"] == 15
    assert 9 < a["last_step_age_s"] < 30
    assert a["steps_per_min"] == pytest.approx(10.0)
    assert 0 <= a["heartbeat_age_s"] < 5
    assert "last_step" not in b and 0 <= b["heartbeat_age_s"] < 5
    # Once the tenant withdrew, the trainer's last word is all there is.
    files.withdraw(attempt)
    assert status_of("p")["tenants_now"]["a"] == files.last_state()


def test_recent_metrics_reads_only_the_last_steps(tmp_path: Path) -> None:
    store = run_store(tenant(tmp_path, "a"))
    for step in (1, 2, 10, 11):  # step_000010 sorts after step_000002
        write_metrics(store, "rl", step, {"loss": float(step)})
    assert [line["step"] for line in recent_metrics(store, "rl", 3)] == [2, 10, 11]
    assert recent_metrics(store, "rl", 0) == [] and recent_metrics(store, "sft", 5) == []
