"""How the fault tests run a stage and strike mid-run, and what they check afterwards."""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil
from prefect import flow

from engine.config import PrimeflowConfig
from engine.inference.on_demand import PoolOnDemand
from engine.inference.pool import InferencePool
from engine.results import StageResult
from engine.run import run_of
from storage.checkpoints import fetch_checkpoint, load_trainer_state
from storage.commit import MARKER, committed_steps, latest_committed_step, read_commit
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.shards import read_rollouts
from storage.store import ObjectStore
from tasks.stages import rl_loop


def poll_until(predicate: Callable[[], object], timeout_s: float = 300.0) -> bool:
    """Check `predicate` every 50 ms until it holds (True) or `timeout_s` passes (False).

    Fault threads use it to strike the moment storage shows the run where the fault belongs.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def rollouts_at(store: ObjectStore) -> int:
    """The newest committed rollout step, 0 before the first."""
    return latest_committed_step(store, RunLayout.ROLLOUTS) or 0


def run_rl_stage(
    config: PrimeflowConfig, pool: InferencePool | PoolOnDemand, name: str = "rl-under-fault"
) -> StageResult:
    """`rl_loop` as the pipeline runs it: a task (retries=1) of a flow run on a Prefect server,
    on the session's running pool (or on the pools `pool` starts on demand)."""
    pools = pool if isinstance(pool, PoolOnDemand) else PoolOnDemand(lambda: pool, pool)

    @flow(name=name, validate_parameters=False)
    def stage() -> StageResult:
        return rl_loop(config, run_of(config), pools)

    return stage()


def commit_times(store: ObjectStore, parent: str) -> dict[int, str]:
    """step → `created_at` of its marker, for every committed step under `parent`."""
    return {
        step: read_commit(store, f"{parent}/{RunLayout.step_name(step)}").created_at
        for step in committed_steps(store, parent)
    }


def assert_every_step_committed_once(
    store: ObjectStore, max_steps: int, *, checkpoints: bool = True
) -> None:
    """Rollouts (and checkpoints) 1..max_steps are committed, verify against their markers, and
    nothing else (no debris of a killed writer) is left beside them; each checkpoint was
    trained on its own rollout step; the newest policy version is the last step's and every
    version left is committed. The orchestrator's metric lines are 1..max_steps, once."""
    steps = list(range(1, max_steps + 1))
    parents = (RunLayout.ROLLOUTS, RunLayout.CHECKPOINTS) if checkpoints else (RunLayout.ROLLOUTS,)
    for parent in parents:
        assert committed_steps(store, parent) == steps, parent
        assert sorted(store.list(parent)) == [RunLayout.step_name(s) for s in steps], parent
    if checkpoints:
        versions = committed_steps(store, RunLayout.POLICIES)
        assert versions and versions[-1] == max_steps, versions
        names = [RunLayout.step_name(s) for s in versions]
        assert sorted(store.list(RunLayout.POLICIES)) == names
    orchestrator = read_metrics(store, "orchestrator")
    assert [line["step"] for line in orchestrator] == steps
    assert all(math.isfinite(line["reward/mean"]) for line in orchestrator)
    for step in steps:
        table = read_rollouts(store, step)  # sizes, checksums, schema, row count
        assert set(table.column("step").to_pylist()) == {step}
        if not checkpoints:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            folder = fetch_checkpoint(store, step, Path(tmp) / "ckpt", trainer_state=True)
            progress = load_trainer_state(folder).progress
        assert progress["step"] == step and progress["data"] == {"rollout_step": step}
        assert store.exists(f"{RunLayout.checkpoint_dir(step)}/{MARKER}")


def assert_unchanged(before: dict[int, str], after: dict[int, str]) -> None:
    """Steps committed before the fault were never written again (immutable commits)."""
    assert before, "nothing was committed before the fault"
    assert {step: after.get(step) for step in before} == before


def leftover_processes(keep_groups: Iterable[int], wait_s: float = 30.0) -> list[str]:
    """This process's live descendants outside `keep_groups`, after giving exiting ones `wait_s`
    to go."""
    keep = set(keep_groups)
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for child in psutil.Process().children(recursive=True):
            try:
                if child.status() != psutil.STATUS_ZOMBIE and os.getpgid(child.pid) not in keep:
                    left.append(f"{child.pid} {' '.join(child.cmdline())[:120]}")
            except (psutil.NoSuchProcess, ProcessLookupError):
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def kill_tree(pid: int) -> list[int]:
    """SIGKILL `pid` and every descendant at once (as losing the machine would); their pids."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    # Not `psutil.wait_procs`: it would reap our own children and steal their exit status from
    # the `Popen` that supervises them (which then reads 0, as if the pool had succeeded).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(proc) for proc in procs):
        time.sleep(0.05)
    return [proc.pid for proc in procs]


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
