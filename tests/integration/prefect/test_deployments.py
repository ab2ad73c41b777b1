"""`primeflow deploy` against a real Prefect server: deployments, schedule, event trigger, and
parameter validation by the server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.events import emit_event
from prefect.exceptions import PrefectHTTPStatusError

from tasks.reporting import CHECKPOINT_EVENT, run_resource
from tests.integration.prefect.deployments import leave_quiet

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def deployed(
    prefect_api: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    exe = Path(sys.executable).with_name("primeflow")
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    env["PRIMEFLOW_HOME"] = str(tmp_path_factory.mktemp("home"))
    result = subprocess.run(
        [str(exe), "deploy"], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert "post-train/reverse-text" in result.stdout

    async def read() -> dict[str, Any]:
        async with get_client() as client:
            return {
                name: await client.read_deployment_by_name(name)
                for name in [
                    "post-train/reverse-text",
                    "evaluate/scheduled",
                    "evaluate/on-checkpoint",
                ]
            }

    yield asyncio.run(read())
    leave_quiet()  # the schedule and trigger these tests turn on make no work for later modules


async def _runs_of(deployment_id: Any) -> list:
    async with get_client() as client:
        return await client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
        )


def _wait_for_runs(deployment_id: Any, timeout_s: float = 60) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = asyncio.run(_runs_of(deployment_id))
        if runs:
            return runs
        time.sleep(1)
    return []


def test_deployments_exist_with_their_pool_and_parameters(deployed: dict[str, Any]) -> None:
    pipeline = deployed["post-train/reverse-text"]
    assert pipeline.work_pool_name == "primeflow-local"
    assert pipeline.parameters["config"]["orchestrator"]["rollouts_per_example"] == 4
    assert "config" in pipeline.parameter_openapi_schema["properties"]
    assert not deployed["evaluate/scheduled"].schedules[0].active


def test_activated_schedule_produces_scheduled_runs(deployed: dict[str, Any]) -> None:
    scheduled = deployed["evaluate/scheduled"]

    async def activate() -> None:
        async with get_client() as client:
            await client.update_deployment_schedule(
                scheduled.id, scheduled.schedules[0].id, active=True
            )
            await client.resume_deployment(scheduled.id)  # as the UI's schedule toggle does

    asyncio.run(activate())
    runs = _wait_for_runs(scheduled.id)
    assert runs, "no scheduled run appeared after activating the schedule"
    assert all(run.state.is_scheduled() for run in runs)
    assert runs[0].parameters["run"] == "reverse-text"


def test_checkpoint_event_triggers_an_evaluation(deployed: dict[str, Any]) -> None:
    on_checkpoint = deployed["evaluate/on-checkpoint"]
    time.sleep(2)  # the trigger service loads new automations every few seconds
    emit_event(
        CHECKPOINT_EVENT,
        resource=run_resource("trigger-test", "rl"),
        payload={
            "run": "trigger-test",
            "stage": "rl",
            "step": 3,
            "uri": "s3://b/runs/trigger-test/checkpoints/step_000003",
            "root": "s3://b/runs/trigger-test",
        },
    )
    runs = _wait_for_runs(on_checkpoint.id)
    assert runs, "the checkpoint event triggered no evaluation run"
    parameters = runs[0].parameters
    assert parameters["run"] == "trigger-test"
    assert str(parameters["step"]) == "3" and parameters["stage"] == "rl"
    assert parameters["root"] == "s3://b/runs/trigger-test"


def test_server_rejects_an_invalid_parameter_naming_the_field(deployed: dict[str, Any]) -> None:
    pipeline = deployed["post-train/reverse-text"]

    async def bad_run() -> None:
        async with get_client() as client:
            await client.create_flow_run_from_deployment(
                pipeline.id, parameters={"config": {"orchestrator": {"batch_size": "many"}}}
            )

    with pytest.raises(PrefectHTTPStatusError) as err:
        asyncio.run(bad_run())
    assert err.value.response.status_code in (409, 422)
    assert "batch_size" in err.value.response.text
