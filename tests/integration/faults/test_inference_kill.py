"""A vLLM server SIGKILLed while the orchestrator samples from it.

The server is one of its own (killing the session's shared server would break the tests after
this one), started from the shared server's config. The run must stop on its own, quickly, with
one line naming the server; what it committed stays as it was, and the same run started again
on a live server carries on from there. Inside the RL stage, Prefect's retry starts the pool
again before it samples, and the stage completes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from engine.config import PrimeflowConfig
from engine.envs import SamplerFailedError
from engine.inference.control import ServerDiedError
from engine.inference.on_demand import PoolOnDemand
from engine.inference.pool import InferencePool
from engine.orchestrator.main import run_orchestrator
from engine.run import run_store
from storage.commit import latest_committed_step
from storage.layout import RunLayout
from tests.integration.faults.helpers import (
    assert_every_step_committed_once,
    assert_unchanged,
    commit_times,
    poll_until,
    rollouts_at,
    run_rl_stage,
)
from tests.integration.vllm import Weights, pool_config

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.slow_suite]

MAX_STEPS = 4


def kill_servers_after(
    config: PrimeflowConfig, server: InferencePool, step: int, seen: dict[str, Any]
) -> None:
    """Once rollouts `step` is committed (the loop is sampling the next), SIGKILL every server's
    process group; record what was committed then."""
    store = run_store(config)
    if poll_until(lambda: rollouts_at(store) >= step):
        for pgid in server.process_groups.values():
            os.killpg(pgid, signal.SIGKILL)
        seen["at"] = time.monotonic()
        seen["rollouts"] = commit_times(store, RunLayout.ROLLOUTS)


@pytest.mark.timeout(360)
def test_killed_server_stops_the_run_with_one_line_and_the_run_resumes(
    pool: InferencePool,
    weights: Weights,
    rl_config: Any,
    tmp_path: Path,
    leftovers: Any,
) -> None:
    # Async level MAX_STEPS: every step may use the base policy, so no trainer is needed here.
    config = rl_config(max_steps=MAX_STEPS, orchestrator={"max_async_level": MAX_STEPS})
    store = run_store(config)
    doomed = InferencePool(pool_config(weights), log_dir=tmp_path / "doomed-logs")
    doomed.start()
    (endpoint,) = doomed.endpoints
    seen: dict[str, Any] = {}
    killer = threading.Thread(target=kill_servers_after, args=(config, doomed, 1, seen))
    killer.start()
    try:
        with pytest.raises(SamplerFailedError) as failed:
            run_orchestrator(config, doomed)
        stopped = time.monotonic()
        killer.join()
    finally:
        doomed.stop()

    # Stopped on its own within the client's retries, with one line naming the dead server.
    assert stopped - seen["at"] < 30
    message = str(failed.value)
    assert "\n" not in message and endpoint.base_url in message, message
    assert "ConnectError" in message or "RemoteProtocolError" in message, message
    assert 1 <= max(seen["rollouts"]) <= (latest_committed_step(store, RunLayout.ROLLOUTS) or 0)
    assert latest_committed_step(store, RunLayout.ROLLOUTS) < MAX_STEPS
    assert leftovers() == []

    # Started again on a live server: continues after its last committed step, loses nothing.
    assert run_orchestrator(config, pool) == 0
    assert_every_step_committed_once(store, MAX_STEPS, checkpoints=False)
    assert_unchanged(seen["rollouts"], commit_times(store, RunLayout.ROLLOUTS))


@pytest.mark.timeout(240)
def test_a_reload_on_a_dead_server_says_it_is_dead(
    weights: Weights, tmp_path: Path, leftovers: Any
) -> None:
    """Not "Connection refused; all servers still serve policy version N": the server is named
    as not running, with why it ended and its log, and no retry is made against it
    (`ServerDiedError`, which the orchestrator does not retry)."""
    doomed = InferencePool(pool_config(weights), log_dir=tmp_path / "doomed-logs")
    doomed.start()
    try:
        for pgid in doomed.process_groups.values():
            os.killpg(pgid, signal.SIGKILL)
        (server,) = doomed.fleet.servers
        assert poll_until(lambda: server.process.poll() is not None)
        with pytest.raises(ServerDiedError) as died:
            doomed.reload(weights.other)
    finally:
        doomed.stop()
    message = str(died.value)
    assert "\n" not in message and "still serve" not in message, message
    assert "inference server 0 is not running" in message, message
    assert "SIGKILL" in message and str(server.log_path) in message, message
    assert leftovers() == []


@pytest.mark.timeout(600)
def test_the_stage_retry_starts_a_killed_pool_again_and_completes(
    weights: Weights, rl_config: Any, tmp_path: Path, prefect_api: str, leftovers: Any
) -> None:
    """`rl_loop` (trainer and orchestrator) on a pool of its own, started on demand as the
    flows do; its server SIGKILLed once step 1 is committed. The stage fails; Prefect's retry
    finds the pool dead, stops it and starts a new one (`PoolOnDemand.get`) instead of failing
    against it, and completes: every step committed and trained once."""
    config = rl_config(max_steps=MAX_STEPS)
    store = run_store(config)
    started: list[InferencePool] = []

    def start() -> InferencePool:
        fresh = InferencePool(pool_config(weights), log_dir=tmp_path / f"pool-{len(started)}")
        started.append(fresh)
        fresh.start()
        return fresh

    seen: dict[str, Any] = {}
    killer = threading.Thread(
        target=lambda: (
            poll_until(lambda: started and started[0].endpoints)
            and kill_servers_after(config, started[0], 1, seen)
        )
    )
    killer.start()
    try:
        result = run_rl_stage(config, PoolOnDemand(start))
    finally:
        killer.join()
        for pool in started:
            pool.stop()

    assert "at" in seen, "the server was never killed"
    assert len(started) == 2  # the dead pool was replaced, once
    assert result.checkpoint_step == MAX_STEPS
    assert_every_step_committed_once(store, MAX_STEPS)
    assert_unchanged(seen["rollouts"], commit_times(store, RunLayout.ROLLOUTS))
    assert leftovers() == []
