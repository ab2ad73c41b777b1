"""What a module that deploys leaves on the Prefect server the tests share: nothing that goes on
making work for the modules after it.

`primeflow deploy` creates an inactive schedule and an `evaluate/on-checkpoint` trigger. Left
active, the schedule keeps adding runs that no worker takes (the server marks each Late), and
the trigger starts an evaluation run for every checkpoint any later test commits: on SQLite,
those writes held the database for a minute at a time (`database is locked` in the server's
log), and a later test's Prefect requests waited as long.
"""

from __future__ import annotations

import asyncio

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType

ON_CHECKPOINT = "evaluate/on-checkpoint"
SCHEDULED = "evaluate/scheduled"


async def checkpoint_trigger(*, paused: bool) -> None:
    """Pause or resume the automations of the `evaluate/on-checkpoint` deployment."""
    async with get_client() as client:
        deployment = await client.read_deployment_by_name(ON_CHECKPOINT)
        automations = await client.read_resource_related_automations(
            f"prefect.deployment.{deployment.id}"
        )
        assert automations, f"{ON_CHECKPOINT} has no trigger to pause"
        for automation in automations:
            if paused:
                await client.pause_automation(automation.id)
            else:
                await client.resume_automation(automation.id)


async def quiet_deployments() -> None:
    """Pause the checkpoint trigger and the schedule, and delete the runs they made that no
    worker will take."""
    await checkpoint_trigger(paused=True)
    async with get_client() as client:
        scheduled = await client.read_deployment_by_name(SCHEDULED)
        for schedule in scheduled.schedules:
            await client.update_deployment_schedule(scheduled.id, schedule.id, active=False)
        waiting = await client.read_flow_runs(
            deployment_filter=DeploymentFilter(
                name=DeploymentFilterName(
                    any_=[SCHEDULED.split("/")[1], ON_CHECKPOINT.split("/")[1]]
                )
            ),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType.SCHEDULED, StateType.PENDING])
                )
            ),
        )
        for run in waiting:
            await client.delete_flow_run(run.id)


def leave_quiet() -> None:
    asyncio.run(quiet_deployments())
