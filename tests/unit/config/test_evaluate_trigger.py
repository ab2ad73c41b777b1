"""A checkpoint event's evaluation reads the run the event names, from the run's own root."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import PrimeflowConfig
from flows.evaluate import default_eval_name, run_config_at
from tests.unit.config.test_reproduce import recorded_run


def test_the_run_is_read_from_its_root_not_the_deployments_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, root = recorded_run(tmp_path)
    elsewhere = tmp_path / "deployment-cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    deployment = PrimeflowConfig()  # file://./runs, the deployment's own default
    got = run_config_at(root, deployment.storage)
    assert got.storage.uri == config.storage.uri and got.run.name == config.run.name
    assert got.trainer.optim.lr == config.trainer.optim.lr
    assert not any(elsewhere.iterdir()), "nothing may be written under the deployment's store"
    with pytest.raises(ValueError, match="no run at"):
        run_config_at(f"file://{tmp_path}/runs/nobody", deployment.storage)


def test_a_triggered_evaluation_writes_under_its_own_name() -> None:
    assert default_eval_name("rl", 3, triggered=True) == "rl-step-3"
    assert default_eval_name("rl", 3, triggered=False) == "rl"
    assert default_eval_name("sft", None, triggered=True) == "base"
