"""`primeflow reproduce --dry-run` rebuilds a run's config from the manifest it recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import PrimeflowConfig, with_overrides
from engine.run import open_run
from flows.reproduce import flow_of, main
from storage.manifest import read_manifest


def recorded_run(tmp_path: Path, **overrides: object) -> tuple[PrimeflowConfig, str]:
    """A run opened the way every flow opens one, leaving its manifest in a file:// store."""
    config = with_overrides(
        PrimeflowConfig(),
        {
            "storage.uri": f"file://{tmp_path}/runs",
            "run.name": "reverse-7",
            "run.seed": 3,
            "trainer.optim.lr": 2e-5,
            "seq_len": 512,
            **overrides,
        },
    )
    run = open_run(config, command=["prefect", "post-train"])
    return config, run.store.url()


def reproduce(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    assert main(argv, dry_run=True) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


def test_dry_run_prints_the_same_config_under_a_new_name_and_parent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, root = recorded_run(tmp_path)
    rebuilt, _ = reproduce([f"{root}/manifest.json"], capsys)
    assert rebuilt["run"]["name"] == "reverse-7-repro-1"
    assert rebuilt["run"]["parent"] == root
    original = config.model_dump(mode="json")
    for key in ("name", "parent"):
        del original["run"][key], rebuilt["run"][key]
    assert rebuilt == original
    # The rebuilt config is one the flows accept as their parameter.
    assert PrimeflowConfig.model_validate(rebuilt).trainer.optim.lr == 2e-5


def test_a_scrubbed_api_key_becomes_unset_so_the_pool_makes_a_new_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, root = recorded_run(tmp_path, **{"inference.api_key": "sk-live-0123456789"})
    manifest_text = (Path(root.removeprefix("file://")) / "manifest.json").read_text()
    assert "sk-live-0123456789" not in manifest_text
    rebuilt, _ = reproduce([root], capsys)
    assert rebuilt["inference"]["api_key"] is None


def test_each_reproduction_gets_the_next_free_name_or_the_given_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, root = recorded_run(tmp_path)
    first, _ = reproduce([root], capsys)
    open_run(PrimeflowConfig.model_validate(first))  # the first reproduction ran
    second, _ = reproduce([root], capsys)
    assert second["run"]["name"] == "reverse-7-repro-2"
    named, _ = reproduce([root, "--run.name", "again"], capsys)
    assert named["run"]["name"] == "again" and named["run"]["parent"] == root
    # The reproduction's own manifest names the original as its parent run.
    store = open_run(PrimeflowConfig.model_validate(named)).store
    assert read_manifest(store)["parent_run"] == root


def test_it_warns_when_code_or_packages_differ_from_the_recorded_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, root = recorded_run(tmp_path)
    path = Path(root.removeprefix("file://")) / "manifest.json"
    manifest = json.loads(path.read_text())
    _, quiet = reproduce([root], capsys)
    assert "torch" not in quiet
    manifest["code"] = {"commit": "0" * 40, "dirty": False}
    manifest["packages"]["torch"] = "1.0.0"
    path.write_text(json.dumps(manifest))
    _, err = reproduce([root], capsys)
    assert f"code revision {'0' * 40} then" in err
    assert "warning: torch 1.0.0 then" in err


def test_a_missing_manifest_is_one_line_and_a_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([f"file://{tmp_path}/runs/nothing"], dry_run=True) == 1
    assert capsys.readouterr().err.strip().startswith("primeflow reproduce: no manifest at")


@pytest.mark.parametrize(
    ("command", "flow"),
    [
        (["prefect", "rl"], "rl"),
        (["prefect", "sft"], "sft"),
        (["prefect", "post-train"], "post-train"),
        (["prefect", "evaluate"], "post-train"),
        (["primeflow", "pipeline", "@", "x.toml"], "post-train"),
        (None, "post-train"),
    ],
)
def test_the_recorded_flow_runs_again(command: list[str] | None, flow: str) -> None:
    assert flow_of({"command": command}) == flow
