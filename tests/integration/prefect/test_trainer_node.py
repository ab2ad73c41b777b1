"""A trainer node reads its flow run's config and running stage from a real Prefect server."""

from __future__ import annotations

import pytest
from prefect.client.orchestration import get_client
from prefect.states import Completed, Running

from engine.config import PrimeflowConfig
from flows.pipeline import rl
from flows.trainer_node import flow_run_config, follow, running_stage
from tasks.stages import rl_loop, sft_warmup

pytestmark = pytest.mark.integration


def test_trainer_node_follows_the_flow_runs_config_stage_and_end(prefect_api: str) -> None:
    config = {
        "trainer": {"parallel": {"nnodes": 2, "rdzv_endpoint": "localhost:29433"}},
        "max_steps": 7,
    }
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(
            rl, parameters={"config": config, "overrides": {"seq_len": 512}}, state=Running()
        )
        # The node resolves the config as the flow does: overrides applied, run name derived.
        resolved = flow_run_config(client, flow_run.id)
        assert resolved.run.name == f"rl-{flow_run.name}"
        assert resolved.seq_len == 512 and resolved.max_steps == 7
        assert isinstance(resolved, PrimeflowConfig)

        assert running_stage(client, flow_run.id) is None
        # Named as Prefect's task engine names task runs: `<task name>-<dynamic key>`.
        client.create_task_run(
            sft_warmup, flow_run.id, dynamic_key="0", name="sft-warmup-0", state=Completed()
        )
        assert running_stage(client, flow_run.id) is None  # a finished stage is not joined
        stage = client.create_task_run(
            rl_loop, flow_run.id, dynamic_key="1", name="rl-loop-1", state=Running()
        )
        assert running_stage(client, flow_run.id) == ("rl", f"{stage.id}/{stage.run_count}")

        client.set_flow_run_state(flow_run.id, Completed(), force=True)
        client.set_task_run_state(stage.id, Completed(), force=True)
        assert follow(client, flow_run.id, "node0", nnodes=2, poll_s=0.1) == 0
