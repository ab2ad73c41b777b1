"""The run root turns read-only while the orchestrator commits steps.

As a normal user the run root is made read-only with chmod. Root ignores file modes, so as root
every file and folder of the run root is made immutable (`chattr +i`, which binds root too);
where the filesystem does not support that, the test is skipped rather than passing vacuously.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from engine.config import PrimeflowConfig
from engine.inference.pool import InferencePool
from engine.orchestrator.main import run_orchestrator
from engine.run import local_run_dir, run_store
from storage.commit import committed_steps
from storage.errors import PermanentStorageError
from storage.layout import RunLayout
from tasks.stages import StageFailedError
from tests.integration.faults.helpers import (
    assert_every_step_committed_once,
    assert_unchanged,
    commit_times,
    poll_until,
    rollouts_at,
    run_rl_stage,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_STEPS = 4


def read_only_commands(scratch: Path) -> tuple[list[str], list[str]]:
    """The commands that make a tree unwritable and writable again, for whoever runs the test.

    Probed here, in the test's thread, so an unsupported filesystem skips the test before the
    run starts rather than after.
    """
    if os.geteuid() != 0:
        return ["chmod", "-R", "a-w"], ["chmod", "-R", "u+w"]
    scratch.mkdir()
    probe = subprocess.run(["chattr", "+i", str(scratch)], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"running as root and `chattr +i` is refused here: {probe.stderr.strip()}")
    subprocess.run(["chattr", "-i", str(scratch)], check=True)
    return ["chattr", "-R", "+i"], ["chattr", "-R", "-i"]


def read_only_after(
    config: PrimeflowConfig, step: int, lock: list[str], seen: dict[str, Any]
) -> None:
    """Once rollouts `step` is committed, make the run root read-only with `lock`."""
    store = run_store(config)
    if poll_until(lambda: rollouts_at(store) >= step):
        # Not checked: a temporary file the writer renames away mid-walk is reported, and the
        # rest of the tree is still locked. The run's error in the test proves the effect.
        subprocess.run([*lock, str(local_run_dir(config))], capture_output=True)
        seen["locked"] = True
        seen["rollouts"] = commit_times(store, RunLayout.ROLLOUTS)


@pytest.mark.timeout(300)
def test_read_only_run_root_fails_with_one_line_naming_the_uri_and_resumes_once_fixed(
    pool: InferencePool, rl_config: Any, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    lock, unlock = read_only_commands(tmp_path / "probe")
    config = rl_config(max_steps=MAX_STEPS, orchestrator={"max_async_level": MAX_STEPS})
    store = run_store(config)
    seen: dict[str, Any] = {}
    fault = threading.Thread(target=read_only_after, args=(config, 1, lock, seen))
    fault.start()
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(PermanentStorageError) as failed:
            run_orchestrator(config, pool)
        # One error, one line, naming the object under the run root it could not write; no
        # retry loop (permanent) and no traceback logged on the way.
        message = str(failed.value)
        assert "\n" not in message and message.startswith(store.url("")), message
        assert failed.value.uri.startswith(store.url(RunLayout.ROLLOUTS)) or (
            failed.value.uri.startswith(store.url("metrics"))
        ), message
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
        assert commit_times(store, RunLayout.ROLLOUTS) == seen["rollouts"]
    finally:
        fault.join()
        if seen.get("locked"):
            subprocess.run([*unlock, str(local_run_dir(config))], check=True)

    # Writable again: the same run continues and commits every step once.
    assert run_orchestrator(config, pool) == 0
    assert_every_step_committed_once(store, MAX_STEPS, checkpoints=False)
    assert_unchanged(seen["rollouts"], commit_times(store, RunLayout.ROLLOUTS))


@pytest.mark.timeout(420)
def test_read_only_checkpoints_fail_the_rl_stage_with_one_line_naming_the_uri(
    pool: InferencePool, rl_config: Any, prefect_api: str, tmp_path: Path, leftovers: Any
) -> None:
    """The trainer's side: it cannot commit its first checkpoint. The stage (and its retry)
    fail with the rank's error in one line; once writable, the run completes."""
    lock, unlock = read_only_commands(tmp_path / "probe")
    config = rl_config(max_steps=2)
    store = run_store(config)
    checkpoints = local_run_dir(config) / RunLayout.CHECKPOINTS
    checkpoints.mkdir(parents=True)
    subprocess.run([*lock, str(checkpoints)], check=True)
    try:
        with pytest.raises(StageFailedError) as failed:
            run_rl_stage(config, pool)
        rollouts = commit_times(store, RunLayout.ROLLOUTS)
    finally:
        subprocess.run([*unlock, str(checkpoints)], check=True)

    message = str(failed.value)
    assert "\n" not in message, message
    assert f"PermanentStorageError: {store.url(RunLayout.checkpoint_dir(1))}" in message, message
    assert committed_steps(store, RunLayout.CHECKPOINTS) == []
    assert run_rl_stage(config, pool)["checkpoint_step"] == 2
    assert_every_step_committed_once(store, 2)
    assert_unchanged(rollouts, commit_times(store, RunLayout.ROLLOUTS))
    assert leftovers() == []
