"""Where RL starts (`engine.run.rl_start`): one rule every process of the stage reads from the
run's root, instead of a config the pipeline rewrites in flight."""

from __future__ import annotations

from pathlib import Path

from engine.config import load_config
from engine.run import rl_start, run_store, stage_store
from storage.commit import begin_step, commit_step
from storage.layout import RunLayout


def commit_sft_checkpoint(config_args: list[str], step: int) -> str:
    """A committed SFT checkpoint of the run (one small file: the rule reads markers only)."""
    config = load_config(config_args)
    sft = stage_store(run_store(config), "sft")
    folder = RunLayout.checkpoint_dir(step)
    begin_step(sft, folder)
    sft.write_bytes(f"{folder}/model.safetensors", b"weights")
    commit_step(sft, folder, ["model.safetensors"], step=step)
    return sft.url(folder)


def test_rl_starts_from_the_newest_committed_sft_checkpoint_of_its_own_run(
    tmp_path: Path,
) -> None:
    args = ["--storage.uri", f"file://{tmp_path}", "--run.name", "r"]
    config = load_config([*args, "--trainer.init-checkpoint", "file:///elsewhere/step_000009"])
    # No SFT result yet: the configured checkpoint (SFT's start, when SFT runs) or the model.
    assert rl_start(config, run_store(config)) == "file:///elsewhere/step_000009"
    assert rl_start(load_config(args), run_store(load_config(args))) is None
    commit_sft_checkpoint(args, 5)
    newest = commit_sft_checkpoint(args, 10)
    assert rl_start(config, run_store(config)) == newest
    # An uncommitted (crashed) write past it does not count.
    begin_step(stage_store(run_store(config), "sft"), RunLayout.checkpoint_dir(15))
    stage_store(run_store(config), "sft").write_bytes(
        f"{RunLayout.checkpoint_dir(15)}/model.safetensors", b"half"
    )
    assert rl_start(config, run_store(config)) == newest


def test_a_run_without_sft_ignores_an_sft_result_and_another_run_does_not_see_it(
    tmp_path: Path,
) -> None:
    args = ["--storage.uri", f"file://{tmp_path}", "--run.name", "r"]
    commit_sft_checkpoint(args, 10)
    no_sft = load_config([*args, "--sft.enabled", "false"])
    assert rl_start(no_sft, run_store(no_sft)) is None
    other = load_config(["--storage.uri", f"file://{tmp_path}", "--run.name", "other"])
    assert rl_start(other, run_store(other)) is None
