"""The Prefect server restarted (same port, same SQLite database) while an RL stage runs.

Prefect supervises and reports; it is not on the data path. A restart while the stage works must
not fail the stage or its flow run, nor cost a step: the stage goes on, and the server ends up
recording the flow run as completed.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from prefect.client.schemas.objects import FlowRun

from engine.config import PrimeflowConfig
from engine.inference.pool import InferencePool
from engine.run import run_store
from flows.server import is_healthy
from storage.layout import RunLayout
from tests.integration.conftest import PrefectServer
from tests.integration.faults.helpers import (
    assert_every_step_committed_once,
    assert_unchanged,
    commit_times,
    poll_until,
    rollouts_at,
    run_rl_stage,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.slow_suite]

MAX_STEPS = 4
FLOW = "rl-under-prefect-restart"


def restart_after(
    config: PrimeflowConfig, server: PrefectServer, step: int, seen: dict[str, Any]
) -> None:
    """Once rollouts `step` is committed, stop the Prefect server and start it again."""
    store = run_store(config)
    if poll_until(lambda: rollouts_at(store) >= step):
        seen["rollouts"] = commit_times(store, RunLayout.ROLLOUTS)
        seen["down_at_step"] = rollouts_at(store)
        server.restart()


def flow_runs(name: str) -> list[FlowRun]:
    async def read() -> list[FlowRun]:
        async with get_client() as client:
            return await client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[name]))
            )

    return asyncio.run(read())


@pytest.mark.timeout(360)
def test_prefect_server_restarted_mid_stage_the_stage_and_flow_run_complete(
    pool: InferencePool, rl_config: Any, prefect_server: PrefectServer, leftovers: Any
) -> None:
    config = rl_config(max_steps=MAX_STEPS)
    store = run_store(config)
    seen: dict[str, Any] = {}
    fault = threading.Thread(target=restart_after, args=(config, prefect_server, 1, seen))
    fault.start()
    result = run_rl_stage(config, pool, name=FLOW)
    fault.join()

    # The server really was down while the stage worked (it went on committing meanwhile).
    assert seen["down_at_step"] < MAX_STEPS and is_healthy(prefect_server.api_url)
    assert result.checkpoint_step == MAX_STEPS
    assert_every_step_committed_once(store, MAX_STEPS)
    assert_unchanged(seen["rollouts"], commit_times(store, RunLayout.ROLLOUTS))
    (run,) = flow_runs(FLOW)
    assert run.state is not None and run.state.is_completed(), run.state
    assert leftovers(prefect_server.pid) == []  # the restarted server is the session's
