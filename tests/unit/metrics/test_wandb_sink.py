"""Metric lines reach W&B (offline here): a local W&B run folder holding the logged values."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from engine.config.wandb import WandbConfig
from engine.wandb_sink import metric_values, wandb_mode, wandb_sink

LINES = [
    {"stage": "rl", "step": 1, "time": 1.0, "reward/mean": 0.25, "loss": 0.5, "note": "x"},
    {"stage": "rl", "step": 2, "time": 2.0, "reward/mean": 0.75, "loss": 0.25},
    {"stage": "eval-rl", "step": 2, "time": 3.0, "avg@8": 0.625, "done": True},
]


def wandb_records(path: Path) -> list[Any]:
    """The protobuf `Record`s of an offline run's `.wandb` file.

    The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks, each with a
    7-byte header (checksum, length, type: 1 a whole record, 2-4 its first/middle/last part).
    """
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00"
    records, payload, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(payload)
            payload = b""
            records.append(record)
    return records


def wandb_history(path: Path, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """What `run.log` recorded, once the run's last record (`exit`) is on disk: `finish()`
    returns before wandb's core process has flushed an offline run."""
    deadline = time.monotonic() + timeout_s
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(path)):
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s}s"
        time.sleep(0.1)
    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


def test_each_stage_is_logged_against_its_own_step() -> None:
    assert metric_values(LINES[0]) == {"rl/step": 1, "rl/reward/mean": 0.25, "rl/loss": 0.5}
    assert metric_values(LINES[2]) == {"eval-rl/step": 2, "eval-rl/avg@8": 0.625}


def test_mode_is_offline_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode(None) == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode(None) == "online" and wandb_mode("disabled") == "disabled"


def test_wandb_reads_wandb_mode_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # None lets wandb.init take WANDB_MODE in any spelling it knows; a configured mode wins.
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert wandb_mode(None) is None
    assert wandb_mode("online") == "online"


def test_no_project_means_no_wandb(tmp_path: Path) -> None:
    with wandb_sink(WandbConfig(), "r", {}, tmp_path) as sink:
        assert sink is None
    assert not (tmp_path / "wandb").exists()


def test_offline_run_folder_holds_the_logged_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_in_env")
    run_config = {
        "run": {"name": "demo.1"},
        "model": {"name": "tiny", "hub": "hf_secret_value_in_env"},
    }
    settings = WandbConfig(project="primeflow-test", tags=["ci"])
    with wandb_sink(settings, "demo.1", run_config, tmp_path) as sink:
        assert sink is not None
        for line in LINES:
            sink.log(line)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*-demo-1")
    rows = [
        {k: v for k, v in row.items() if not k.startswith("_")}
        for row in wandb_history(run_dir / "run-demo-1.wandb")
    ]
    assert rows == [metric_values(line) for line in LINES]
    recorded = (run_dir / "run-demo-1.wandb").read_bytes()
    assert b"tiny" in recorded and b"hf_secret_value_in_env" not in recorded
