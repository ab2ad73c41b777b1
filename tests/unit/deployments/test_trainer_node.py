"""The other nodes of a multi-node trainer join the flow's rendezvous with the flow's config."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import PrimeflowConfig
from engine.trainer.pool import torchrun_command
from flows.trainer_node import NodeConfigError, follower_config, stage_of_task


def multi_node(endpoint: str = "localhost:29411", nnodes: int = 3) -> PrimeflowConfig:
    return PrimeflowConfig.model_validate(
        {
            "run": {"name": "big-run"},
            "trainer": {
                "parallel": {"nnodes": nnodes, "nproc_per_node": 8, "rdzv_endpoint": endpoint}
            },
        }
    )


def test_a_follower_runs_the_first_nodes_torchrun_at_the_first_nodes_host() -> None:
    first = multi_node()
    other = follower_config(first, "job-abc-0.primeflow-trainer", nnodes=3)
    path = Path("/tmp/config.json")
    ours, theirs = torchrun_command(first, "rl", path), torchrun_command(other, "rl", path)
    differ = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
    assert differ == [
        ("--rdzv-endpoint=localhost:29411", "--rdzv-endpoint=job-abc-0.primeflow-trainer:29411")
    ]
    assert "--rdzv-id=big-run" in theirs and "--nnodes=3" in theirs
    assert other.trainer.parallel.nproc_per_node == 8


def test_the_default_port_is_torchruns_when_the_endpoint_has_none() -> None:
    other = follower_config(multi_node(endpoint="node0"), "node0.cluster", nnodes=None)
    assert other.trainer.parallel.rdzv_endpoint == "node0.cluster:29400"


def test_a_job_of_another_size_than_the_config_is_an_error_not_a_hang() -> None:
    with pytest.raises(NodeConfigError, match=r"job has 4 nodes.*nnodes is 3"):
        follower_config(multi_node(), "h", nnodes=4)
    with pytest.raises(NodeConfigError, match="no other trainer nodes"):
        follower_config(PrimeflowConfig(), "h", nnodes=None)


@pytest.mark.parametrize(
    ("name", "stage"),
    [("rl-loop-4fa", "rl"), ("sft-warmup-0", "sft"), ("rl-loop", "rl"), ("evaluate-1c2", None)],
)
def test_stage_tasks_are_known_by_name(name: str, stage: str | None) -> None:
    assert stage_of_task(name) == stage
