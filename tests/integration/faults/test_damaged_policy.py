"""A committed policy version that no server can rebuild, mid-run: a delta file altered after
its commit, or a delta's base deleted.

The pool is then put back on the base weights, as a restarted pool would be, so it must
rebuild the newest version from storage, through the damaged link. Before issue 35 the
orchestrator failed the reload three times and the stage, and its retry, and every re-run, the
same way. Now the orchestrator discards the version it cannot rebuild (logging why), serves an
older one meanwhile, and the trainer, finding its newest version gone, publishes it again in
full: the stage completes on its first attempt with every step trained once.

The tiny model is served in fp32, where an ordinary update changes nearly every weight and
every version is full (docs/training.md); at lr 1e-9 without weight decay only the smallest
weights change, so versions 1.. are deltas, as bf16 versions are on a GPU.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from engine.config import PrimeflowConfig
from engine.inference.pool import InferencePool
from engine.run import logs_dir, run_store
from storage.commit import delete_step, latest_committed_step, read_commit
from storage.layout import RunLayout, is_delta_file
from storage.metrics import read_metrics
from storage.policies import DELTA, committed_version, is_published
from storage.store import ObjectStore
from tests.integration.faults.helpers import (
    assert_every_step_committed_once,
    poll_until,
    run_rl_stage,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.slow_suite]

MAX_STEPS = 6
#: The fault strikes once this version, or a newer one, is committed as a delta.
STRIKE_AT = 2


def newest_delta(store: ObjectStore) -> int | None:
    """The newest committed version when it is a delta at or past `STRIKE_AT`."""
    step = latest_committed_step(store, RunLayout.POLICIES)
    if step is None or step < STRIKE_AT:
        return None
    version = committed_version(store, step)
    return step if version is not None and version.kind == DELTA else None


def flip_bytes(store: ObjectStore, step: int) -> str:
    """Flip 4 bytes in the middle of version `step`'s delta file (its marker keeps the old
    checksum); the file's name."""
    step_dir = RunLayout.policy_dir(step)
    (name,) = [n for n in read_commit(store, step_dir).files if is_delta_file(n)]
    data = bytearray(store.read_bytes(f"{step_dir}/{name}"))
    middle = len(data) // 2
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    store.write_bytes(f"{step_dir}/{name}", bytes(data))
    return name


def damage_then_reset_pool(
    config: PrimeflowConfig, pool: InferencePool, base: Path, fault: str, seen: dict[str, Any]
) -> None:
    """Once a delta version is the newest: damage it (`corrupt`) or delete its base
    (`delete-base`), then put the pool back on the base weights (version 0)."""
    store = run_store(config)
    if not poll_until(lambda: newest_delta(store) is not None):
        return
    step = newest_delta(store)
    assert step is not None
    version = committed_version(store, step)
    assert version is not None and version.base is not None
    if fault == "corrupt":
        seen["file"] = flip_bytes(store, step)
        seen["damaged"] = (step, version.uid)
    else:
        delete_step(store, RunLayout.policy_dir(version.base))
    seen["step"] = step
    pool.reload(base, version=0)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("fault", ["corrupt", "delete-base"])
def test_a_version_no_server_can_rebuild_is_republished_and_the_run_completes(
    pool: InferencePool,
    tiny_model: Path,
    rl_config: Any,
    prefect_api: str,
    leftovers: Any,
    caplog: pytest.LogCaptureFixture,
    fault: str,
) -> None:
    config = rl_config(max_steps=MAX_STEPS, trainer={"optim": {"lr": 1e-9, "weight_decay": 0.0}})
    store = run_store(config)
    seen: dict[str, Any] = {}
    striker = threading.Thread(
        target=damage_then_reset_pool, args=(config, pool, tiny_model, fault, seen)
    )
    striker.start()
    with caplog.at_level(logging.WARNING, logger="engine.orchestrator.loop"):
        result = run_rl_stage(config, pool)
    striker.join()

    assert "step" in seen, "no delta version was committed: the fault never struck"
    # The stage completed on its first attempt: its trainer never had to resume.
    log = (logs_dir(config) / "trainer-rl.log").read_text()
    assert "resumed rl from" not in log
    assert result.checkpoint_step == MAX_STEPS
    assert_every_step_committed_once(store, MAX_STEPS)
    assert [line["step"] for line in read_metrics(store, "rl")] == list(range(1, MAX_STEPS + 1))

    # The damage was logged, naming its cause, and what could not be rebuilt was discarded.
    step = seen["step"]
    warnings = [r.getMessage() for r in caplog.records if "cannot be served" in r.getMessage()]
    assert warnings, caplog.text
    if fault == "corrupt":
        assert any(f"{seen['file']}: xxh3_128 is" in w for w in warnings), warnings
    else:
        assert any(
            f"is a delta on version {step - 1}, which is not committed any more" in w
            for w in warnings
        ), warnings
    if fault == "corrupt":  # the altered write is gone (its step may be committed anew)
        assert not is_published(store, *seen["damaged"])
    # The trainer published its newest version again, in full, once a reader discarded it.
    assert "publishing it again in full" in log
    assert not [t for t in threading.enumerate() if t.name == "orchestrator" and t.is_alive()]
    assert leftovers() == []
