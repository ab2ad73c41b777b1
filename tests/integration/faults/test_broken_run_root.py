"""The run root turns read-only, or its disk fills up, while the run commits steps.

Read-only: as a normal user, chmod. Root ignores file modes, so as root every file and folder is
made immutable (`chattr +i`, which binds root too). Disk full: the run root is a tmpfs (root
only: it needs `mount`), shrunk to exactly what it holds. Where the tool is refused, the test is
skipped rather than passing vacuously.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.inference.pool import InferencePool
from engine.orchestrator.main import run_orchestrator
from engine.run import local_run_dir, run_store
from engine.stage_trainer import StageFailedError
from storage.commit import committed_steps
from storage.errors import PermanentStorageError
from storage.layout import RunLayout
from storage.store import ObjectStore
from tests.integration.faults.helpers import (
    assert_every_step_committed_once,
    assert_unchanged,
    commit_times,
    poll_until,
    rollouts_at,
    run_rl_stage,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.slow_suite]

MAX_STEPS = 6


@dataclass(frozen=True)
class Fault:
    """How to break a folder (`lock`), mend it (`unlock`) and tidy up after the test."""

    lock: Callable[[], object]
    unlock: Callable[[], object]
    cleanup: Callable[[], object] = lambda: None
    #: What the error's reason says (EACCES/EPERM, or ENOSPC).
    reason: str = r"Permission denied|Operation not permitted"


def read_only(folder: Path, scratch: Path) -> Fault:
    """chmod as a normal user, `chattr +i` as root (probed on `scratch` first, in the test's
    thread, so a refusal skips the test before the run starts)."""
    lock, unlock = ["chmod", "-R", "a-w"], ["chmod", "-R", "u+w"]
    if os.geteuid() == 0:
        scratch.mkdir()
        probe = subprocess.run(["chattr", "+i", str(scratch)], capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"running as root and `chattr +i` is refused here: {probe.stderr.strip()}")
        subprocess.run(["chattr", "-i", str(scratch)], check=True)
        lock, unlock = ["chattr", "-R", "+i"], ["chattr", "-R", "-i"]
    return Fault(
        # Not checked: a temporary file the writer renames away mid-walk is reported, and the
        # rest of the tree is still locked. The run's error in the test proves the effect.
        lock=lambda: subprocess.run([*lock, str(folder)], capture_output=True),
        unlock=lambda: subprocess.run([*unlock, str(folder)], check=True),
    )


def disk_full(folder: Path) -> Fault:
    """`folder` becomes a 64 MiB tmpfs; `lock` shrinks it to the blocks it uses."""
    folder.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")

    def shrink() -> None:
        for _ in range(20):  # a write in flight may grow it between statvfs and remount
            stats = os.statvfs(folder)
            used = max(stats.f_blocks - stats.f_bfree, 1) * stats.f_frsize
            if _remount(folder, f"size={used}").returncode == 0:
                return
        raise RuntimeError(f"could not shrink the tmpfs at {folder}")

    return Fault(
        lock=shrink,
        unlock=lambda: _remount(folder, "size=64m").check_returncode(),
        cleanup=lambda: subprocess.run(["umount", "-l", str(folder)], check=True),
        reason="No space left on device",
    )


def _remount(folder: Path, options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["mount", "-o", f"remount,{options}", str(folder)], capture_output=True, text=True
    )


def strike_after(store: ObjectStore, step: int, fault: Fault, seen: dict[str, Any]) -> None:
    """Once rollouts `step` is committed, break the run root."""
    if poll_until(lambda: rollouts_at(store) >= step):
        fault.lock()
        seen["locked"] = True
        seen["rollouts"] = commit_times(store, RunLayout.ROLLOUTS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["read-only", "disk-full"])
def test_broken_run_root_fails_with_one_line_naming_the_uri_and_resumes_once_fixed(
    pool: InferencePool,
    rl_config: Any,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    kind: str,
) -> None:
    config = rl_config(max_steps=MAX_STEPS, orchestrator={"max_async_level": MAX_STEPS})
    root = local_run_dir(config)
    fault = read_only(root, tmp_path / "probe") if kind == "read-only" else disk_full(root)
    store = run_store(config)
    seen: dict[str, Any] = {}
    striker = threading.Thread(target=strike_after, args=(store, 1, fault, seen))
    striker.start()
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(PermanentStorageError) as failed:
            run_orchestrator(config, pool)
        # One error, one line, naming the object under the run root it could not write; no
        # retry loop (permanent) and no traceback logged on the way.
        message = str(failed.value)
        assert "\n" not in message and message.startswith(store.url("")), message
        assert re.search(fault.reason, failed.value.reason), message
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
        # The run can fail on its next write before the striker has listed what was committed.
        striker.join()
        assert commit_times(store, RunLayout.ROLLOUTS) == seen["rollouts"]
        fault.unlock()
        seen["locked"] = False

        # Mended: the same run continues and commits every step once.
        assert run_orchestrator(config, pool) == 0
        assert_every_step_committed_once(store, MAX_STEPS, checkpoints=False)
        assert_unchanged(seen["rollouts"], commit_times(store, RunLayout.ROLLOUTS))
    finally:
        striker.join()
        if seen.get("locked"):
            fault.unlock()
        fault.cleanup()


@pytest.mark.timeout(420)
def test_read_only_checkpoints_fail_the_rl_stage_with_one_line_naming_the_uri(
    pool: InferencePool, rl_config: Any, prefect_api: str, tmp_path: Path, leftovers: Any
) -> None:
    """The trainer's side: it cannot commit its first checkpoint. The stage (and its retry)
    fail with the rank's error in one line; once writable, the run completes."""
    config = rl_config(max_steps=2)
    store = run_store(config)
    checkpoints = local_run_dir(config) / RunLayout.CHECKPOINTS
    checkpoints.mkdir(parents=True)
    fault = read_only(checkpoints, tmp_path / "probe")
    fault.lock()
    try:
        with pytest.raises(StageFailedError) as failed:
            run_rl_stage(config, pool)
        rollouts = commit_times(store, RunLayout.ROLLOUTS)
    finally:
        fault.unlock()

    message = str(failed.value)
    assert "\n" not in message, message
    assert f"PermanentStorageError: {store.url(RunLayout.checkpoint_dir(1))}" in message, message
    assert committed_steps(store, RunLayout.CHECKPOINTS) == []
    assert run_rl_stage(config, pool).checkpoint_step == 2
    assert_every_step_committed_once(store, 2)
    assert_unchanged(rollouts, commit_times(store, RunLayout.ROLLOUTS))
    assert leftovers() == []
