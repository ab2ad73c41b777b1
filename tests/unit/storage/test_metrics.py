"""Metric lines as one object per stage and step, and the metrics.jsonl made from them."""

from __future__ import annotations

import json

from storage.layout import RunLayout
from storage.metrics import compact_metrics, read_metrics, write_metrics
from storage.store import ObjectStore


def test_lines_round_trip_per_stage_and_a_repeated_step_replaces_its_line() -> None:
    store = ObjectStore("memory://metrics-test/run")
    write_metrics(store, "rl", 2, {"loss": 0.5})
    write_metrics(store, "rl", 1, {"loss": 1.0})
    write_metrics(store, "rl", 2, {"loss": 0.25})  # a resumed run repeats step 2
    lines = read_metrics(store, "rl")
    assert [(line["step"], line["loss"]) for line in lines] == [(1, 1.0), (2, 0.25)]
    assert all(line["stage"] == "rl" for line in lines)


def test_compact_writes_every_stage_in_time_order() -> None:
    store = ObjectStore("memory://metrics-test/compact")
    write_metrics(store, "sft", 1, {"loss": 2.0})
    write_metrics(store, "rl", 1, {"reward": 0.1})
    write_metrics(store, "eval-base", 0, {"avg@1": 0.0})
    assert compact_metrics(store) == 3
    lines = [json.loads(x) for x in store.read_bytes(RunLayout.METRICS).decode().splitlines()]
    assert [line["stage"] for line in lines] == ["sft", "rl", "eval-base"]
    assert [line["time"] for line in lines] == sorted(line["time"] for line in lines)
