"""A trainer rank stopped with SIGSTOP mid-stage: the watchdog finds the stage hung, saves the
stacks of every process, fails the attempt with one line naming them, and the retry resumes.

A stopped process is the hang nothing else notices: it holds its sockets and files, exits never,
and answers no signal but SIGKILL. The stage is the real `rl_loop` task on the session's
Prefect server (its `retries=1` restarts it, as in production) with the watchdog's allowance
cut to seconds.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Any

import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from engine.config import PrimeflowConfig
from engine.inference.pool import InferencePool
from engine.process_groups import recorded_groups
from engine.run import logs_dir, run_store
from storage.metrics import read_metrics
from tasks.reporting import artifact_key
from tests.integration.faults.helpers import (
    assert_every_step_committed_once,
    poll_until,
    run_rl_stage,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.slow_suite]

MAX_STEPS = 5
STOP_AFTER = 2  # trainer steps done before its rank is stopped


def stop_the_rank(config: PrimeflowConfig, seen: dict[str, Any]) -> None:
    """Once the trainer has logged `STOP_AFTER` steps, SIGSTOP its rank (not torchrun)."""
    store = run_store(config)
    logs = logs_dir(config)

    def ranks() -> list[psutil.Process]:
        if len(read_metrics(store, "rl")) < STOP_AFTER:
            return []
        pgid = recorded_groups(logs).get("trainer-rl")
        return psutil.Process(pgid).children() if pgid is not None else []

    if poll_until(lambda: ranks()):
        stopped = ranks()
        for rank in stopped:
            rank.send_signal(signal.SIGSTOP)
        seen["stopped"] = [rank.pid for rank in stopped]


def alive(pid: int) -> bool:
    """Running or stopped; a zombie waiting for its new parent to reap it is dead."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def _hang_artifacts(key: str) -> list:
    async with get_client() as client:
        return await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )


@pytest.mark.timeout(600)
def test_a_stopped_trainer_rank_fails_the_stage_with_its_stacks_and_the_retry_resumes(
    pool: InferencePool, rl_config: Any, prefect_api: str, leftovers: Any
) -> None:
    config = rl_config(max_steps=MAX_STEPS, watchdog={"min_s": 12.0, "factor": 4.0})
    store = run_store(config)
    seen: dict[str, Any] = {}
    striker = threading.Thread(target=stop_the_rank, args=(config, seen))
    striker.start()
    result = run_rl_stage(config, pool, name="rl-hang")
    striker.join()

    assert seen.get("stopped"), "the rank was never stopped"
    assert result.checkpoint_step == MAX_STEPS  # the retry resumed and finished
    assert_every_step_committed_once(store, MAX_STEPS)

    logs = logs_dir(config)
    (report,) = logs.glob("hang-rl-*.txt")
    text = report.read_text()
    for pid in seen["stopped"]:
        assert f"=== pid {pid} [stopped]" in text
    assert "(stopped: SIGSTOP or a debugger" in text
    # The supervisor's own threads are there, the orchestrator's with its stack.
    assert "the stage's supervisor" in text and "engine/orchestrator" in text
    # The UI names it: the stacks are an artifact of the run.
    (artifact,) = asyncio.run(_hang_artifacts(artifact_key(config.run.name, "rl", "hang")))
    assert str(report) in str(artifact.data)
    # The stopped rank was killed with its group: nothing of the first attempt is left.
    assert not [pid for pid in seen["stopped"] if alive(pid)]
    assert leftovers() == []
