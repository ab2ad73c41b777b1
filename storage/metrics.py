"""Metric lines: one immutable object per stage and step, and `metrics.jsonl` made from them.

Object stores cannot append, and a run has several writers of metrics (the trainer, the
orchestrator, evaluation). So each writes one object per step,
`<run>/metrics/<stage>/step_NNNNNN.jsonl`, holding that step's JSON line: one PUT per step on any
backend, no two writers on one object, and a crash loses at most the line being written. A
resumed run overwrites the lines of steps it repeats. `compact_metrics` concatenates every line
into `<run>/metrics.jsonl` for tools that want one file.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from storage.layout import RunLayout
from storage.paths import join
from storage.store import ObjectStore


def write_metrics(store: ObjectStore, stage: str, step: int, values: Mapping[str, Any]) -> None:
    """Store one step's metric line (call on rank 0 only)."""
    line = {"stage": stage, "step": step, "time": time.time(), **values}
    store.write_bytes(
        RunLayout.metrics_path(stage, step), (json.dumps(line, sort_keys=True) + "\n").encode()
    )


def latest_metric_step(store: ObjectStore, stage: str) -> int | None:
    """The newest step `stage` wrote a line for (one listing, no line read), or None."""
    names = store.list(RunLayout.metrics_dir(stage))
    steps = (RunLayout.parse_step(name.removesuffix(".jsonl")) for name in names)
    return max((step for step in steps if step is not None), default=None)


def read_metrics(store: ObjectStore, stage: str) -> list[dict[str, Any]]:
    """Every stored line of `stage`, in step order."""
    lines = []
    folder = RunLayout.metrics_dir(stage)
    for name in store.list(folder):
        lines.append(json.loads(store.read_bytes(join(folder, name))))
    return sorted(lines, key=lambda line: line["step"])


def recent_metrics(store: ObjectStore, stage: str, count: int) -> list[dict[str, Any]]:
    """The lines of `stage`'s last `count` steps, in step order: what a status needs, without
    reading a long run's every line (one file a step, named so their order is the steps')."""
    folder = RunLayout.metrics_dir(stage)
    names = sorted(store.list(folder))[-count:] if count > 0 else []
    lines = [json.loads(store.read_bytes(join(folder, name))) for name in names]
    return sorted(lines, key=lambda line: line["step"])


def compact_metrics(store: ObjectStore) -> int:
    """Write `<run>/metrics.jsonl`: every stage's lines, ordered by time; returns the count."""
    stages = store.list(RunLayout.METRICS_DIR)
    lines = [line for stage in stages for line in read_metrics(store, stage)]
    lines.sort(key=lambda line: (line.get("time", 0.0), line["stage"], line["step"]))
    store.write_bytes(
        RunLayout.METRICS,
        "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines).encode(),
    )
    return len(lines)
