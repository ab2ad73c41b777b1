"""The RL trainer pool SIGKILLed in the middle of a step, then the stage started again.

The stage is the real `rl_loop` task (torchrun trainer + orchestrator against the session's
vLLM server) inside a flow on the session's Prefect server; its `retries=1` is what starts the
stage again, as in production.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import psutil
import pytest

from engine.config import PrimeflowConfig
from engine.inference.pool import InferencePool
from engine.process_groups import recorded_groups
from engine.run import logs_dir, run_store
from storage.commit import latest_committed_step, read_commit
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.shards import read_rollouts
from storage.store import ObjectStore
from tests.integration.faults.helpers import (
    assert_every_step_committed_once,
    assert_unchanged,
    commit_times,
    kill_tree,
    poll_until,
    rollouts_at,
    run_rl_stage,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.slow_suite]

MAX_STEPS = 4
KILL_AT = 2  # killed after rollouts/step_2 is committed, before checkpoints/step_2 is


def victims(torchrun: int, victim: str) -> list[int]:
    """The processes to kill: torchrun itself (its rank follows), or only its rank."""
    if victim == "torchrun":
        return [torchrun]
    return [child.pid for child in psutil.Process(torchrun).children()]


def kill_trainer_mid_step(
    config: PrimeflowConfig, step: int, victim: str, seen: dict[str, Any]
) -> None:
    """Once the trainer may be training `step` (its rollouts committed, its checkpoint not yet),
    SIGKILL `victim` with everything below it; record what was committed at that moment."""
    store = run_store(config)
    group: list[int] = []

    def mid_step() -> bool:
        checkpoint = latest_committed_step(store, RunLayout.CHECKPOINTS) or 0
        if rollouts_at(store) < step or checkpoint != step - 1:
            return False
        pgid = recorded_groups(logs_dir(config)).get("trainer-rl")
        group[:] = [pgid] if pgid is not None else []
        return bool(group)

    if poll_until(mid_step):
        seen["killed"] = [pid for pid in victims(group[0], victim) for pid in kill_tree(pid)]
        seen["checkpoints"] = commit_times(store, RunLayout.CHECKPOINTS)
        seen["rollouts"] = commit_times(store, RunLayout.ROLLOUTS)


def assert_rows_name_their_lineage(store: ObjectStore, log: str) -> None:
    """Each row carries the lineage of its version: the dead trainer's or the resumed one's
    (as the trainer log names them when they start), '' only for the base model the server
    started with; the resumed trainer's lineage only on versions it published (past K), and
    the newest versions, all its own, name it in their markers."""
    dead, resumed = re.findall(r"policy lineage (\w+) starts at version", log)
    assert dead != resumed
    rows = [
        row for step in range(1, MAX_STEPS + 1) for row in read_rollouts(store, step).to_pylist()
    ]
    for row in rows:
        allowed = {dead, resumed} if row["policy_version"] else {""}
        assert row["policy_lineage"] in allowed, (row["step"], row["policy_version"])
        if row["policy_lineage"] == resumed:
            assert row["policy_version"] > KILL_AT - 1, row["step"]
    assert resumed in {row["policy_lineage"] for row in rows}
    newest = read_commit(store, RunLayout.policy_dir(MAX_STEPS))
    assert newest.meta["lineage_id"] == resumed


@pytest.mark.timeout(480)
@pytest.mark.parametrize("victim", ["torchrun", "rank"])
def test_trainer_killed_mid_step_resumes_and_commits_every_step_once(
    pool: InferencePool, rl_config: Any, prefect_api: str, leftovers: Any, victim: str
) -> None:
    config = rl_config(max_steps=MAX_STEPS)
    store = run_store(config)
    seen: dict[str, Any] = {}
    killer = threading.Thread(target=kill_trainer_mid_step, args=(config, KILL_AT, victim, seen))
    killer.start()
    result = run_rl_stage(config, pool)
    killer.join()

    # The kill landed mid-step (checkpoint 2 not committed): torchrun and its rank, or the rank.
    assert len(seen.get("killed", [])) >= (2 if victim == "torchrun" else 1), seen
    assert max(seen["checkpoints"]) == KILL_AT - 1
    assert result.checkpoint_step == MAX_STEPS

    assert_every_step_committed_once(store, MAX_STEPS)
    assert_unchanged(seen["checkpoints"], commit_times(store, RunLayout.CHECKPOINTS))
    assert_unchanged(seen["rollouts"], commit_times(store, RunLayout.ROLLOUTS))
    # The retry resumed from the newest committed checkpoint, not from the half-written one.
    log = (logs_dir(config) / "trainer-rl.log").read_text()
    assert f"resumed rl from {store.url(RunLayout.checkpoint_dir(KILL_AT - 1))}" in log
    # One trainer metric line per step (the repeated step's line replaced, not doubled).
    assert [line["step"] for line in read_metrics(store, "rl")] == list(range(1, MAX_STEPS + 1))
    assert_rows_name_their_lineage(store, log)
    # Nothing of the first attempt is left: no orchestrator thread, no trainer process.
    assert not [t for t in threading.enumerate() if t.name == "orchestrator" and t.is_alive()]
    assert leftovers() == []
