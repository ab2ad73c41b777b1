"""deployments/prefect.yaml stays in step with the configs and the flows it names."""

from __future__ import annotations

from pathlib import Path

from engine.config import PrimeflowConfig, load_config
from flows.deploy import PREFECT_FILE, deployment_names, read_deployments

ROOT = Path(__file__).resolve().parents[3]


def test_deployment_configs_equal_the_reverse_text_toml() -> None:
    toml = load_config(["@", str(ROOT / "configs/reverse_text/pipeline.toml")]).model_dump(
        mode="json", exclude={"run"}
    )
    for deployment in read_deployments():
        config = PrimeflowConfig.model_validate(deployment["parameters"]["config"])
        assert config.model_dump(mode="json", exclude={"run"}) == toml, deployment["name"]


def test_deployments_name_flows_that_exist() -> None:
    assert deployment_names(PREFECT_FILE) == [
        "post-train/reverse-text",
        "evaluate/scheduled",
        "evaluate/on-checkpoint",
    ]
    by_name = {d["name"]: d for d in read_deployments()}
    assert by_name["scheduled"]["schedules"][0]["active"] is False
    trigger = by_name["on-checkpoint"]["triggers"][0]
    assert trigger["expect"] == ["primeflow.checkpoint.committed"]
    assert set(trigger["parameters"]) == {"run", "stage", "step", "root"}
