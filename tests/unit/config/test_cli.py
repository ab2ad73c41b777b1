"""The `primeflow` command as a user runs it: exit codes, dry-run JSON, help, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from engine.config import PrimeflowConfig
from engine.config.loader import union_field_paths
from flows.cli import COMMANDS, EXIT_USAGE, main


def primeflow(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the installed console script in a fresh process, the way a user does."""
    exe = Path(sys.executable).with_name("primeflow")
    return subprocess.run(
        [str(exe), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


@pytest.mark.parametrize("command", [c for c, spec in COMMANDS.items() if spec.run is not None])
def test_dry_run_prints_the_resolved_config(command: str, capsys: pytest.CaptureFixture) -> None:
    assert main([command, "--dry-run", "--trainer.optim.lr", "2e-5", "--max-steps", "7"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["trainer"]["optim"]["lr"] == 2e-5
    assert resolved["orchestrator"]["max_steps"] == 7
    PrimeflowConfig.model_validate(resolved)


@pytest.mark.parametrize(
    ("command", "args"),
    [("server", ["start"]), ("deploy", [])],
)
def test_dry_run_works_for_commands_without_config(command: str, args: list[str], capsys) -> None:
    assert main([command, *args, "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)


def test_bad_config_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[orchestrator]\nbatch_size = 0\n")
    result = primeflow("rl", "@", str(bad), "--dry-run")
    assert result.returncode == EXIT_USAGE
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert str(bad) in lines[0] and "orchestrator.batch_size" in lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_pools_up_without_its_base_model_is_one_line_before_anything_starts(
    tmp_path: Path,
) -> None:
    """The example's pools serve a base made by another command first: run without it, `pools
    up` says which folder is missing (exit 2) and starts no Prefect server and no pool."""
    config = Path(__file__).resolve().parents[3] / "configs" / "multi_tenant" / "pools.toml"
    home = tmp_path / "home"
    result = primeflow(
        "pools", "up", "@", str(config), cwd=tmp_path, env={"PRIMEFLOW_HOME": str(home)}
    )
    assert result.returncode == EXIT_USAGE, result.stderr
    assert result.stderr.strip() == (
        "primeflow pools: model.name: model path "
        "./runs/tiny-shared-base/sft/checkpoints/step_000400 does not exist"
    )
    assert result.stdout == "" and not home.exists()


def test_unknown_flag_and_unknown_command(capsys) -> None:
    assert main(["sft", "--trainer.optim.lrr", "1", "--dry-run"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "trainer.optim.lrr" in err and len(err.strip().splitlines()) == 1
    assert main(["fly"]) == EXIT_USAGE
    assert "unknown command 'fly'" in capsys.readouterr().err


def _leaf_flags(model: type, prefix: str = "") -> set[str]:
    """Every flag a user can set, as the help shows it (kebab case)."""
    flags: set[str] = set()
    union_paths = union_field_paths(model)
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        # An optional section (`trainer.lora: LoraConfig | None`) shows its own fields.
        args = get_args(info.annotation)
        options = [arg for arg in args if arg is not type(None)]
        optional = type(None) in args and len(options) == 1
        annotation = options[0] if optional else info.annotation
        nested = getattr(annotation, "model_fields", None)
        if nested is not None and path not in union_paths:
            flags |= _leaf_flags(annotation, f"{path}.")
        elif path not in union_paths:
            flags.add("--" + path.replace("_", "-"))
    return flags


def test_help_lists_every_field_with_default_and_description() -> None:
    result = primeflow("trainer", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    missing = sorted(f for f in _leaf_flags(PrimeflowConfig) if f not in text)
    assert not missing, f"help misses {missing}"
    assert "Peak learning rate." in text
    assert "default: 2048" in text  # the shared seq_len
    assert "--trainer.loss.ratio-cap" in text  # a union variant's field


def test_top_level_help_lists_the_commands() -> None:
    result = primeflow("--help")
    assert result.returncode == 0
    for command in COMMANDS:
        assert command in result.stdout
