"""`primeflow inference` keeps the pool's logs with the run, wherever the run root is."""

from __future__ import annotations

import uuid
from pathlib import Path

from engine.config import PrimeflowConfig
from engine.inference.serve import upload_logs
from engine.run import run_store


def config_at(uri: str) -> PrimeflowConfig:
    return PrimeflowConfig.model_validate({"storage": {"uri": uri}, "run": {"name": "serve"}})


def test_logs_are_uploaded_to_a_remote_run_root(tmp_path: Path) -> None:
    config = config_at(f"memory://serve-{uuid.uuid4().hex}")
    (tmp_path / "inference-0.log").write_text("server log\n")
    (tmp_path / "inference-pool.json").write_text('{"status": "stopped"}\n')
    (tmp_path / "trainer.log").write_text("not ours\n")
    upload_logs(config, tmp_path)
    store = run_store(config)
    assert store.list("logs") == ["inference-0.log", "inference-pool.json"]
    assert store.read_bytes("logs/inference-0.log") == b"server log\n"


def test_local_run_roots_hold_the_logs_already(tmp_path: Path) -> None:
    config = config_at(f"file://{tmp_path / 'runs'}")
    logs = tmp_path / "runs" / "serve" / "logs"
    logs.mkdir(parents=True)
    (logs / "inference-0.log").write_text("server log\n")
    upload_logs(config, logs)
    assert sorted(p.name for p in logs.iterdir()) == ["inference-0.log"]
