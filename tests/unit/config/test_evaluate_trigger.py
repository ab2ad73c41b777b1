"""A checkpoint event's evaluation reads the run the event names, from the run's own root."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import PrimeflowConfig
from engine.stages import eval_step
from flows.evaluate import default_eval_name, evaluate, run_config_at
from storage.checkpoints import apply_retention, log_commit, write_checkpoint
from storage.errors import NotCommittedError
from storage.layout import RunLayout
from storage.store import ObjectStore
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
    assert default_eval_name("sft", 0, triggered=True) == "base"


def test_evaluating_a_checkpoint_retention_deleted_fails_before_any_server_starts(
    tmp_path: Path,
) -> None:
    _, root = recorded_run(tmp_path)
    store = ObjectStore(root)
    for step in (1, 2):
        write_checkpoint(store, step, weights={"w": torch.ones(1)}, config={"model_type": "t"})
        log_commit(store, step)
        apply_retention(store, keep_last=1)
    # `.fn` runs the flow's body; reaching the pool would start vLLM, which the error prevents.
    with pytest.raises(NotCommittedError, match="deleted by retention") as failed:
        evaluate.fn(PrimeflowConfig(), root=root, stage="rl", step=1)
    assert failed.value.uri == store.url(RunLayout.checkpoint_dir(1))


def test_one_rule_picks_the_checkpoint_an_evaluation_takes(tmp_path: Path) -> None:
    store = ObjectStore(f"file://{tmp_path}/run")
    assert eval_step(store, "rl", "latest", served=5) == 0  # nothing committed: the model itself
    assert eval_step(store, "rl", None, served=5) == 5  # what the pool serves
    for step in (2, 4):
        write_checkpoint(store, step, weights={"w": torch.ones(1)}, config={"model_type": "t"})
    assert eval_step(store, "rl", "latest", served=5) == 4
    assert eval_step(store, "rl", 2, served=5) == 2
    assert eval_step(store, "sft", "latest", served=5) == 0  # SFT's checkpoints live apart
    with pytest.raises(NotCommittedError, match="never committed"):
        eval_step(store, "rl", 3, served=5)
