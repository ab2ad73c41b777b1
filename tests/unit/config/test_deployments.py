"""deployments/prefect.yaml stays in step with the configs and the flows it names."""

from __future__ import annotations

from pathlib import Path

from engine.config import PrimeflowConfig, load_config
from flows.deploy import PREFECT_FILE, deployment_names, read_deployments

ROOT = Path(__file__).resolve().parents[3]


#: The config file each deployment restates.
RESTATES = {
    "reverse-text": "configs/reverse_text/pipeline.toml",
    "scheduled": "configs/reverse_text/pipeline.toml",
    "on-checkpoint": "configs/reverse_text/pipeline.toml",
    "tiny-shared": "configs/multi_tenant/pools.toml",
}


def test_deployment_configs_equal_the_tomls_they_restate() -> None:
    deployments = read_deployments()
    assert {d["name"] for d in deployments} == set(RESTATES)
    for deployment in deployments:
        path = ROOT / RESTATES[deployment["name"]]
        toml = load_config(["@", str(path)]).model_dump(mode="json", exclude={"run"})
        config = PrimeflowConfig.model_validate(deployment["parameters"]["config"])
        assert config.model_dump(mode="json", exclude={"run"}) == toml, deployment["name"]


def test_deployments_name_flows_that_exist() -> None:
    assert deployment_names(PREFECT_FILE) == [
        "post-train/reverse-text",
        "evaluate/scheduled",
        "evaluate/on-checkpoint",
        "pools/tiny-shared",
    ]
    by_name = {d["name"]: d for d in read_deployments()}
    assert by_name["scheduled"]["schedules"][0]["active"] is False
    trigger = by_name["on-checkpoint"]["triggers"][0]
    assert trigger["expect"] == ["primeflow.checkpoint.committed"]
    assert set(trigger["parameters"]) == {"run", "stage", "step", "root"}
