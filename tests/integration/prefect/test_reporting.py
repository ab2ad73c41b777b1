"""The stage monitor turns committed storage state into Prefect artifacts and events."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from storage.checkpoints import announced_steps, apply_retention, log_commit, write_checkpoint
from storage.commit import committed_steps
from storage.layout import RunLayout
from storage.metrics import write_metrics
from storage.store import ObjectStore
from tasks.reporting import ABORT_REPORT_S, StageMonitor, announce_checkpoints, artifact_key
from tests.integration.prefect.events import event_steps

pytestmark = pytest.mark.integration


def commit_checkpoint(store: ObjectStore, step: int) -> None:
    """What the trainer does at a checkpoint step: write and commit it, then log the commit."""
    weights = {"w": torch.full((2,), float(step))}
    write_checkpoint(store, step, weights=weights, config={"model_type": "t"})
    log_commit(store, step)


def fake_trainer(store: ObjectStore, steps: int) -> None:
    """What the trainer pool leaves in storage: one metric line per step, a checkpoint every 2,
    of which retention keeps only the newest, at once (before the monitor can look)."""
    for step in range(1, steps + 1):
        write_metrics(store, "rl", step, {"loss": 1.0 / step, "reward": 0.1 * step})
        if step % 2 == 0:
            commit_checkpoint(store, step)
            apply_retention(store, keep_last=1)
        time.sleep(0.05)


async def _artifacts(key: str) -> list:
    async with get_client() as client:
        return await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )


def test_monitor_reports_progress_table_and_checkpoint_events(
    prefect_api: str, tmp_path: Path
) -> None:
    store = ObjectStore(f"file://{tmp_path}/runs/mon-test")
    run = "mon-test"

    @flow(name="monitor-test")
    def stage() -> int:
        with StageMonitor(store, run, "rl", total_steps=6, interval_s=0.1, table_every=2) as mon:
            fake_trainer(store, 6)
        return mon.last_step

    assert stage() == 6
    progress = asyncio.run(_artifacts(artifact_key(run, "rl", "progress")))
    assert progress and float(progress[0].data) == 100.0
    table = asyncio.run(_artifacts(artifact_key(run, "rl", "metrics")))
    assert table, "no metrics table artifact"
    assert "reward" in str(table[0].data)
    # Columns as a person reads them (the lines themselves are stored with sorted keys).
    data = table[0].data
    columns = list((json.loads(data) if isinstance(data, str) else data)[0])
    assert columns == ["step", "loss", "reward", "stage", "time"], columns

    # Steps 2 and 4 were deleted before any poll could see them; their events still went out.
    assert event_steps(run, "rl", [2, 4, 6]) == [2, 4, 6]
    assert committed_steps(store, RunLayout.CHECKPOINTS) == [6]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_off_a_terminal_progress_goes_to_the_run_log_as_lines(
    prefect_api: str, tmp_path: Path
) -> None:
    """Output to a file shows no bar; the flow run's log gets a progress line instead (at most
    every `line_every_s`, and at the last step)."""
    store = ObjectStore(f"file://{tmp_path}/runs/lines")
    handler = Lines()
    logging.getLogger("prefect.flow_runs").addHandler(handler)

    @flow(name="monitor-lines")
    def stage() -> None:
        monitor = StageMonitor(
            store, "lines", "rl", total_steps=3, also=("eval-online",), interval_s=0.1,
            line_every_s=3600,
        )  # fmt: skip
        with monitor:
            write_metrics(store, "eval-online", 1, {"eval/greedy/avg@1": 0.75})
            for step in (1, 2, 3):
                write_metrics(store, "rl", step, {"loss": 0.5, "reward/mean": 0.25})
                time.sleep(0.3)

    try:
        stage()
    finally:
        logging.getLogger("prefect.flow_runs").removeHandler(handler)
    progress = [line for line in handler.lines if line.startswith("rl: step")]
    # The first line, then none for an hour but the last step's (pytest's output is no TTY);
    # the evaluation of step 1 is still the newest at step 3.
    numbers = "loss 0.5, reward/mean 0.25, eval/greedy/avg@1 0.75"
    assert progress == [f"rl: step 1/3, {numbers}", f"rl: step 3/3, {numbers}"]


def test_a_checkpoint_committed_while_nobody_watched_is_announced_once_when_watched_again(
    prefect_api: str, tmp_path: Path
) -> None:
    store = ObjectStore(f"file://{tmp_path}/runs/unwatched")
    run = "unwatched"

    @flow(name="monitor-unwatched")
    def stage() -> None:
        with StageMonitor(store, run, "rl", total_steps=4, interval_s=0.1):
            write_metrics(store, "rl", 2, {"loss": 0.5})
            commit_checkpoint(store, 2)

    stage()
    assert announced_steps(store) == [2]
    # The flow process is killed here; its trainer goes on and commits step 4 unwatched.
    commit_checkpoint(store, 4)
    # The next run of the flow finds every step done and announces what nobody did, once.
    assert announce_checkpoints(store, run, "rl", RunLayout.CHECKPOINTS) == [4]
    assert announce_checkpoints(store, run, "rl", RunLayout.CHECKPOINTS) == []
    assert announced_steps(store) == [2, 4]
    assert event_steps(run, "rl", [2, 4]) == [2, 4]  # each once
    time.sleep(2)  # and no late duplicate either
    assert event_steps(run, "rl", [2, 4], timeout_s=0) == [2, 4]


def test_a_stage_that_fails_does_not_wait_on_a_report_that_hangs(
    prefect_api: str, tmp_path: Path
) -> None:
    """A cancelled tenant must give its slot back within seconds: once, its last report waited
    a minute on a Prefect request the server never answered. Here a report hangs in `on_step`
    (a metrics sink that blocks); the stage fails, and its end waits only `ABORT_REPORT_S`."""
    store = ObjectStore(f"file://{tmp_path}/runs/hung")
    inside, release = threading.Event(), threading.Event()

    def hanging_sink(line: object) -> None:
        inside.set()
        release.wait(60)

    @flow(name="monitor-hung")
    def stage() -> float:
        try:
            with StageMonitor(
                store, "hung", "rl", total_steps=3, interval_s=0.1, on_step=hanging_sink
            ):
                write_metrics(store, "rl", 1, {"loss": 0.5})
                assert inside.wait(30), "the monitor never reported step 1"
                failed_at = time.monotonic()
                raise RuntimeError("the stage failed")
        except RuntimeError:
            return time.monotonic() - failed_at

    try:
        waited = stage()
    finally:
        release.set()
    assert waited < ABORT_REPORT_S + 2, waited
