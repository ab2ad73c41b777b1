"""The S3-compatible server goes down mid-run and comes back with its objects.

The server is `RestartableMotoServer` (tests/integration/servers.py): moto's S3 over real HTTP on
loopback, whose listener is closed (connections refused) and opened again while its objects
persist in the process. This is a restart *within the retry window*: the run must ride it out
through the store's retries, lose nothing and commit every step once.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from engine.config import PrimeflowConfig
from engine.inference.pool import InferencePool
from engine.orchestrator.main import run_orchestrator
from engine.run import run_store
from storage.layout import RunLayout
from tests.integration.faults.helpers import (
    assert_every_step_committed_once,
    assert_unchanged,
    commit_times,
    poll_until,
    rollouts_at,
)
from tests.integration.servers import RestartableMotoServer, S3Endpoint
from tests.integration.storage.test_transient import restartable  # noqa: F401  (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.slow_suite]

MAX_STEPS = 4
OUTAGE_S = 2.0


def outage_after(
    config: PrimeflowConfig, server: RestartableMotoServer, step: int, seen: dict[str, Any]
) -> None:
    """Once rollouts `step` is committed, take the server down for `OUTAGE_S`, then back."""
    store = run_store(config)
    if poll_until(lambda: rollouts_at(store) >= step):
        seen["rollouts"] = commit_times(store, RunLayout.ROLLOUTS)
        seen["latest"] = rollouts_at(store)
        server.stop()
        seen["down"] = datetime.now(UTC).isoformat()
        time.sleep(OUTAGE_S)
        server.start()


@pytest.mark.timeout(300)
def test_s3_server_restarted_mid_run_is_ridden_out_and_every_step_committed_once(
    pool: InferencePool,
    rl_config: Any,
    restartable: tuple[RestartableMotoServer, S3Endpoint],  # noqa: F811
) -> None:
    server, endpoint = restartable
    endpoint.boto3_client().create_bucket(Bucket=endpoint.bucket)
    # retries=8 from 0.2 s wait at least 25 s in all: far longer than the outage.
    storage = {"uri": endpoint.uri("runs"), "retries": 8, "backoff_s": 0.2}
    config = rl_config(
        max_steps=MAX_STEPS, orchestrator={"max_async_level": MAX_STEPS}, storage=storage
    )
    store = run_store(config)
    seen: dict[str, Any] = {}
    fault = threading.Thread(target=outage_after, args=(config, server, 1, seen))
    fault.start()
    assert run_orchestrator(config, pool) == 0
    fault.join()

    # The outage fell inside the run: it had steps left when the server went down and wrote
    # the last step's marker after that (a marker's time is taken before its PUT); meanwhile
    # the loop polled the store for checkpoints every 0.1 s, through the outage.
    assert seen["latest"] < MAX_STEPS
    after = commit_times(store, RunLayout.ROLLOUTS)
    assert after[MAX_STEPS] > seen["down"]
    assert_every_step_committed_once(store, MAX_STEPS, checkpoints=False)
    assert_unchanged(seen["rollouts"], after)
