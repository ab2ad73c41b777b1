"""Deployment runs through a real process worker: cancellation, a killed flow process, resume.

One Prefect server (session fixture), one `prefect worker` for the module, the tiny debug config
(a few SFT and RL steps on the offline tiny model, one vLLM CPU server, one trainer process).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.client.schemas.objects import FlowRun
from prefect.states import Cancelling

from engine.config import load_config
from engine.process_groups import GROUPS_FILE
from flows.deploy import REPO_ROOT
from storage.commit import committed_steps, read_commit
from storage.layout import RunLayout
from storage.store import ObjectStore
from tasks.reporting import artifact_key
from tests.integration.prefect.deployments import checkpoint_trigger, leave_quiet
from tests.integration.prefect.events import checkpoint_events

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DEPLOYMENT = "post-train/reverse-text"
TINY = load_config(["@", str(REPO_ROOT / "configs/debug/tiny.toml")]).model_dump(
    mode="json", exclude_unset=True
)


@pytest.fixture(scope="module")
def worker(prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Deploy, then run one process worker for the module; yields the worker's PRIMEFLOW_HOME."""
    home = tmp_path_factory.mktemp("worker-home")
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PRIMEFLOW_HOME": str(home)}
    # A new flow run is picked up within a second, not within the default 10 s query interval.
    env["PREFECT_WORKER_QUERY_SECONDS"] = "1"
    exe = Path(sys.executable).with_name("primeflow")
    deployed = subprocess.run(
        [str(exe), "deploy"], capture_output=True, text=True, timeout=300, env=env
    )
    assert deployed.returncode == 0, deployed.stderr + deployed.stdout
    # Every checkpoint these runs commit would start an `evaluate/on-checkpoint` run on this
    # worker, with a vLLM server of its own, beside the run under test: its trigger is paused
    # (test_deployments.py tests it), and stays paused for the modules after this one.
    asyncio.run(checkpoint_trigger(paused=True))
    log = (home / "worker.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", "primeflow-local"],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield home
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
        leave_quiet()


def start_run(run_name: str, runs: Path, **overrides: Any) -> UUID:
    async def create() -> UUID:
        async with get_client() as client:
            deployment = await client.read_deployment_by_name(DEPLOYMENT)
            flow_run = await client.create_flow_run_from_deployment(
                deployment.id,
                parameters={
                    "config": TINY,
                    "overrides": {
                        "run.name": run_name,
                        "storage.uri": f"file://{runs}",
                        **overrides,
                    },
                },
            )
            return flow_run.id

    return asyncio.run(create())


def read_run(flow_run_id: UUID) -> FlowRun:
    async def read() -> FlowRun:
        async with get_client() as client:
            return await client.read_flow_run(flow_run_id)

    return asyncio.run(read())


def wait_until(predicate: Any, timeout_s: float, what: str, poll_s: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def recorded_groups(run_dir: Path) -> dict[str, int]:
    try:
        return json.loads((run_dir / RunLayout.LOGS / GROUPS_FILE).read_text())["groups"]
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def group_alive(pgid: int) -> bool:
    return any(
        p.info["status"] != psutil.STATUS_ZOMBIE
        for p in psutil.process_iter(["status"])
        if _pgid(p.pid) == pgid
    )


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def final_state(flow_run_id: UUID, timeout_s: float) -> FlowRun:
    return wait_until(
        lambda: (run := read_run(flow_run_id)).state and run.state.is_final() and run,
        timeout_s,
        "the flow run to finish",
        poll_s=2.0,
    )


@pytest.mark.timeout(1200)
def test_cancelling_a_run_leaves_no_pool_process(worker: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    flow_run_id = start_run("cancel-me", runs, max_steps=1000)  # RL runs until cancelled
    run_dir = runs / "cancel-me"
    # Both pools are up once RL runs (SFT's few steps may end before the vLLM server, which
    # starts beside them, is up): the vLLM server and a torchrun group.
    groups = wait_until(
        lambda: (g := recorded_groups(run_dir)) and "inference-0" in g and "trainer-rl" in g and g,
        600,
        "the inference and RL trainer pools to start",
    )
    assert read_run(flow_run_id).name == "cancel-me"  # run.name given through overrides

    async def cancel() -> None:
        async with get_client() as client:
            await client.set_flow_run_state(flow_run_id, Cancelling(), force=True)

    asyncio.run(cancel())
    state = final_state(flow_run_id, 180).state
    assert state is not None and state.is_cancelled(), state
    wait_until(
        lambda: not any(group_alive(pgid) for pgid in groups.values()),
        60,
        f"the pools' process groups {groups} to end",
    )


@pytest.mark.timeout(2400)
def test_killed_flow_process_then_rerun_resumes_and_completes(worker: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    store = ObjectStore(f"file://{runs}/resume-me")
    max_steps = 4
    first = start_run("resume-me", runs, max_steps=max_steps)
    wait_until(
        lambda: committed_steps(store, RunLayout.CHECKPOINTS),
        900,
        "the first RL checkpoint",
    )
    pid = int(str(read_run(first).infrastructure_pid).rsplit(":", 1)[-1])
    os.kill(pid, signal.SIGKILL)
    before = {
        step: read_commit(store, RunLayout.checkpoint_dir(step)).created_at
        for step in committed_steps(store, RunLayout.CHECKPOINTS)
    }
    assert final_state(first, 120).state.is_crashed()  # type: ignore[union-attr]

    second = start_run("resume-me", runs, max_steps=max_steps)
    done = final_state(second, 900)
    assert done.state is not None and done.state.is_completed(), done.state
    assert committed_steps(store, RunLayout.CHECKPOINTS)[-1] == max_steps
    assert committed_steps(store, RunLayout.ROLLOUTS) == list(range(1, max_steps + 1))
    for step, created in before.items():  # committed before the kill: never written again
        if step in committed_steps(store, RunLayout.CHECKPOINTS):
            assert read_commit(store, RunLayout.checkpoint_dir(step)).created_at == created

    async def artifacts() -> list[list]:
        async with get_client() as client:
            return [
                await client.read_artifacts(
                    artifact_filter=ArtifactFilter(
                        key=ArtifactFilterKey(any_=[artifact_key("resume-me", kind)])
                    )
                )
                for kind in ("summary", "reward-plot")
            ]

    summary, plot = asyncio.run(artifacts())
    assert summary and "Reward on the held-out split" in str(summary[0].data)
    # The plot is an image the UI draws: a data: URL holding the run's own PNG.
    assert plot and plot[0].type == "image"
    header, encoded = str(plot[0].data).split(",", 1)
    assert header == "data:image/png;base64"
    assert base64.b64decode(encoded) == (runs / "resume-me" / "report" / "reward.png").read_bytes()
    # The server takes events in the background: the last checkpoint's may land late. Under a
    # full suite on 2 cores it once took more than 30 s (run alone, the test passed).
    wait_until(
        lambda: max_steps in {e.payload["step"] for e in checkpoint_events("resume-me", "rl")},
        120,
        "the last RL checkpoint's event",
    )

    # Run it once more: everything is committed, so no server or trainer starts (their logs
    # and the pool's record are not touched) and the run completes again.
    logs = runs / "resume-me" / RunLayout.LOGS
    pool_files = sorted([logs / "inference-pool.json", *logs.glob("trainer-*.log")])
    assert len(pool_files) == 3, pool_files
    touched = {path: path.stat().st_mtime_ns for path in pool_files}
    again = final_state(start_run("resume-me", runs, max_steps=max_steps), 300)
    assert again.state is not None and again.state.is_completed(), again.state
    assert {path: path.stat().st_mtime_ns for path in pool_files} == touched
