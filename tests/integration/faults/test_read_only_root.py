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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.config import PrimeflowConfig
from engine.inference.pool import InferencePool
from engine.orchestrator.main import run_orchestrator
from engine.run import local_run_dir, run_store
from storage.commit import latest_committed_step
from storage.errors import PermanentStorageError
from storage.layout import RunLayout
from tests.integration.faults.helpers import (
    assert_every_step_committed_once,
    assert_unchanged,
    commit_times,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_STEPS = 4


def make_read_only(root: Path) -> Callable[[], None]:
    """Make `root` and everything below it unwritable; return the function that undoes it."""
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", str(root)], check=True)
        return lambda: subprocess.run(["chmod", "-R", "u+w", str(root)], check=True)
    done = subprocess.run(["chattr", "-R", "+i", str(root)], capture_output=True, text=True)
    if done.returncode != 0:
        subprocess.run(["chattr", "-R", "-i", str(root)], capture_output=True)
        pytest.skip(f"running as root and `chattr +i` is refused here: {done.stderr.strip()}")
    return lambda: subprocess.run(["chattr", "-R", "-i", str(root)], check=True)


def read_only_after(config: PrimeflowConfig, step: int, seen: dict[str, Any]) -> None:
    """Once rollouts `step` is committed, make the run root read-only."""
    store = run_store(config)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (latest_committed_step(store, RunLayout.ROLLOUTS) or 0) >= step:
            seen["undo"] = make_read_only(local_run_dir(config))
            seen["rollouts"] = commit_times(store, RunLayout.ROLLOUTS)
            return
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_read_only_run_root_fails_with_one_line_naming_the_uri_and_resumes_once_fixed(
    pool: InferencePool, rl_config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    config = rl_config(max_steps=MAX_STEPS, orchestrator={"max_async_level": MAX_STEPS})
    store = run_store(config)
    seen: dict[str, Any] = {}
    fault = threading.Thread(target=read_only_after, args=(config, 1, seen))
    fault.start()
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(PermanentStorageError) as failed:
            run_orchestrator(config, pool)
        fault.join()
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
        if "undo" in seen:
            seen["undo"]()

    # Writable again: the same run continues and commits every step once.
    assert run_orchestrator(config, pool) == 0
    assert_every_step_committed_once(store, MAX_STEPS, checkpoints=False)
    assert_unchanged(seen["rollouts"], commit_times(store, RunLayout.ROLLOUTS))
