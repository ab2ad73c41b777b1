"""Shared pools with two LoRA tenants, end to end: `primeflow pools up` (a real vLLM CPU server
with runtime LoRA and the shared trainer), two `primeflow rl` runs as tenants (each a flow run
of its own, admitted through the pools' Prefect concurrency limit), one killed mid-run.

Each tenant starts from an adapter with random B of its own, so a server that sampled one
tenant's request with another's adapter (or the base) would show in that tenant's trainer
`mismatch_kl`, as in `tests/integration/trainer/test_lora_rl.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

import httpx
import pytest
from prefect import get_client
from prefect.client.schemas.objects import State

from engine.config import load_config
from engine.models.resolve import resolve_model
from engine.process_groups import GROUPS_FILE, recorded_groups
from engine.tenancy.files import PoolRecord, TenantFiles, pool_dir, read_pool_record
from engine.tenancy.supervisor import TRAINER
from flows.deploy import REPO_ROOT
from storage.commit import committed_steps, latest_committed_step, read_commit
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.store import ObjectStore
from tasks.pools import limit_name
from tests.integration.adapters import random_adapter
from tests.integration.faults.helpers import commit_times
from tests.integration.prefect.test_flow_runs import group_alive, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]
POOLS = "it-shared"
STEPS = 5
CONFIGS = REPO_ROOT / "configs" / "multi_tenant"
EXE = str(Path(sys.executable).with_name("primeflow"))
#: On top of the example's configs, for the pools and every tenant: the offline tiny model as
#: the base (the example's is made by a 4-minute SFT) and short leases.
SHARED = f"""
[model]
name = "primeflow/tiny-qwen3"
[pools]
name = "{POOLS}"
lease_s = 6.0
heartbeat_s = 1.0
"""
#: The adapters' shape, the example's.
LORA = load_config(["@", str(CONFIGS / "pools.toml")]).trainer.lora


@dataclass
class SharedPools:
    home: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes]

    @property
    def logs(self) -> Path:
        return pool_dir(POOLS) / "logs"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def shared_pools(
    prefect_api: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedPools]:
    """`primeflow pools up` for the module; `pools down` after it, leaving no process."""
    home = tmp_path_factory.mktemp("tenants-home")
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PRIMEFLOW_HOME": str(home)}
    overlay = write(
        home / "pools-test.toml",
        SHARED + '[inference]\nkv_cache_gb = 0.25\ndtype = "float32"\nextra_args = ["-O0"]\n',
    )
    log = (home / "pools-up.log").open("wb")
    process = subprocess.Popen(
        [EXE, "pools", "up", "@", str(CONFIGS / "pools.toml"), "@", str(overlay)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    os.environ["PRIMEFLOW_HOME"] = str(home)  # where this process reads the pools' files
    pools = SharedPools(home, env, process)
    try:
        wait_until(
            lambda: (r := read_pool_record(POOLS)) is not None and r.status == "running",
            600,
            f"the shared pools to start (see {home / 'pools-up.log'})",
        )
        yield pools
        groups = json.loads((pools.logs / GROUPS_FILE).read_text())["groups"]
        assert {"inference-0", "trainer-tenants"} <= set(groups), groups
        down = subprocess.run(
            [EXE, "pools", "down", "--name", POOLS], env=env, capture_output=True, timeout=180
        )
        assert down.returncode == 0, down
        assert process.wait(60) == 0
        wait_until(
            lambda: not any(group_alive(pgid) for pgid in groups.values()),
            60,
            f"the pools' process groups {groups} to end",
        )
        assert read_pool_record(POOLS).status == "stopped"  # type: ignore[union-attr]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
        os.environ.pop("PRIMEFLOW_HOME", None)


def tenant(
    pools: SharedPools,
    tmp: Path,
    name: str,
    env: str,
    seed: int,
    *,
    steps: int = STEPS,
    interval: int = 1,
) -> subprocess.Popen:
    """`primeflow rl` for tenant `name` of the shared pools, from an adapter of its own (made
    on its first start): `steps` steps, a resume checkpoint every `interval`."""
    folder = tmp / f"start-{name}"
    start = ObjectStore(f"file://{folder}").url(RunLayout.checkpoint_dir(0))
    if not folder.exists():
        model = Path(resolve_model("primeflow/tiny-qwen3"))
        assert LORA is not None
        random_adapter(model, LORA, folder, seed=seed)
    overlay = write(
        tmp / f"{name}.toml",
        f"""max_steps = {steps}
seq_len = 256
{SHARED}
[run]
name = "{name}"
[storage]
uri = "file://{tmp}/runs"
[trainer]
init_checkpoint = "{start}"
[trainer.checkpoint]
interval = {interval}
[trainer.optim]
lr = 1e-2
[orchestrator]
batch_size = 8
rollouts_per_example = 4
max_concurrent = 16      # two batches in flight: the kill below finds steps still to train
[orchestrator.sampling]
max_tokens = 24
""",
    )
    configs = ["@", str(CONFIGS / "tenant.toml"), "@", str(CONFIGS / f"{env}.toml")]
    log = (tmp / f"{name}.log").open("wb")
    return subprocess.Popen(
        [EXE, "rl", *configs, "@", str(overlay)],
        env=pools.env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def adapters(record: PoolRecord) -> dict[str, str]:
    """The adapters the pools' server lists: name (`<run>@v<version>-<uid>`) → folder."""
    response = httpx.get(
        f"{record.servers[0]}/v1/models",
        headers={"Authorization": f"Bearer {record.api_key}"},
        timeout=30,
    )
    response.raise_for_status()
    return {card["id"]: card["root"] for card in response.json()["data"] if "@v" in card["id"]}


def assert_sampled_from_own_adapter(store: ObjectStore, steps: int = STEPS) -> None:
    """One trainer metric line per step, and its log-probs of every step's sampled tokens
    match the server's."""
    lines = read_metrics(store, "rl")
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    assert all(line["mismatch_kl"] < 1e-3 for line in lines), lines


def test_two_tenants_share_the_pools_and_one_dies_alone(
    shared_pools: SharedPools, tmp_path: Path
) -> None:
    doomed = tenant(shared_pools, tmp_path, "doomed", "reverse_text", seed=1)
    survivor = tenant(shared_pools, tmp_path, "survivor", "alphabet_sort", seed=2)
    doomed_store = ObjectStore(f"file://{tmp_path}/runs/doomed")
    survivor_store = ObjectStore(f"file://{tmp_path}/runs/survivor")

    # Kill the first tenant's whole process (its flow run, orchestrator and lease) once the
    # shared trainer has committed its first step: the async bound (max_async_level = 1) keeps
    # its orchestrator from having committed the rollouts of every step by then.
    wait_until(
        lambda: committed_steps(doomed_store, RunLayout.CHECKPOINTS),
        600,
        f"the doomed tenant's first checkpoint (see {tmp_path / 'doomed.log'})",
        poll_s=0.2,
    )
    os.killpg(doomed.pid, signal.SIGKILL)
    doomed.wait()
    kept = {
        step: read_commit(doomed_store, RunLayout.rollouts_dir(step)).created_at
        for step in committed_steps(doomed_store, RunLayout.ROLLOUTS)
    }

    # The other tenant and the pools go on as if nothing happened.
    assert survivor.wait(600) == 0, (tmp_path / "survivor.log").read_text()[-3000:]
    assert committed_steps(survivor_store, RunLayout.CHECKPOINTS)[-1] == STEPS
    assert committed_steps(survivor_store, RunLayout.ROLLOUTS) == list(range(1, STEPS + 1))
    assert_sampled_from_own_adapter(survivor_store)
    assert shared_pools.process.poll() is None
    record = read_pool_record(POOLS)
    assert record is not None and record.status == "running"

    # The shared trainer let the dead tenant go when its lease lapsed, and the pools unloaded
    # its adapters; a finished tenant unloaded its own.
    files = TenantFiles(POOLS, "doomed")
    wait_until(
        lambda: (s := files.last_state()) and s["status"] == "released" and s,
        60,
        "the shared trainer to let the killed tenant go",
    )

    wait_until(lambda: adapters(record) == {}, 60, "the tenants' adapters to be unloaded")

    # Run again, the killed tenant resumes on the same pools: what it had committed stays.
    again = tenant(shared_pools, tmp_path, "doomed", "reverse_text", seed=1)
    assert again.wait(600) == 0, (tmp_path / "doomed.log").read_text()[-3000:]
    assert committed_steps(doomed_store, RunLayout.ROLLOUTS) == list(range(1, STEPS + 1))
    for step, created in kept.items():
        assert read_commit(doomed_store, RunLayout.rollouts_dir(step)).created_at == created
    assert committed_steps(doomed_store, RunLayout.CHECKPOINTS)[-1] == STEPS
    assert_sampled_from_own_adapter(doomed_store)


#: The restart test's tenants: a resume checkpoint every 3 steps, so a killed trainer finds
#: policy versions published past the newest checkpoint, served, to roll back.
RESTART_STEPS = 8
RESTART_INTERVAL = 3


def version_of(adapter: str) -> int:
    return int(adapter.split("@v")[1].split("-")[0])


#: What the server logs as it loads and unloads an adapter: (what, name).
ADAPTER_EVENT = re.compile(r"(Loaded new|Removed) LoRA adapter: name '([^']+)'")


def adapter_events(server_log: str, tenant: str) -> list[tuple[str, str]]:
    """The server's loads ("Loaded new") and unloads ("Removed") of `tenant`'s adapters, in
    the order it made them (a poll of its list would miss one that lasted under a poll)."""
    return [
        (what, name)
        for what, name in ADAPTER_EVENT.findall(server_log)
        if name.startswith(f"{tenant}@v")
    ]


def test_a_killed_shared_trainer_restarts_and_every_tenant_completes(
    shared_pools: SharedPools, tmp_path: Path
) -> None:
    """Issue 34, item 2: the shared trainer is SIGKILLed while a tenant's server holds a policy
    version past that tenant's newest checkpoint. The supervisor restarts it, the tenants
    resume from their checkpoints (rolling back what they published past them), and both
    complete, each step committed once; the server lives on, and each rolled-back adapter
    leaves it for good."""
    names = {"restart-a": "reverse_text", "restart-b": "alphabet_sort"}
    runs = {
        name: tenant(
            shared_pools,
            tmp_path,
            name,
            env,
            seed=seed,
            steps=RESTART_STEPS,
            interval=RESTART_INTERVAL,
        )
        for seed, (name, env) in enumerate(names.items(), start=3)
    }
    stores = {name: ObjectStore(f"file://{tmp_path}/runs/{name}") for name in names}
    record = read_pool_record(POOLS)
    assert record is not None

    def newest(name: str) -> int:
        return latest_committed_step(stores[name], RunLayout.CHECKPOINTS) or 0

    def past_checkpoint() -> bool:
        checkpoint = newest("restart-a")
        return checkpoint >= RESTART_INTERVAL and any(
            version_of(adapter) > checkpoint
            for adapter in adapters(record)
            if adapter.startswith("restart-a@v")
        )

    wait_until(past_checkpoint, 600, "restart-a to serve a version past a checkpoint", 0.1)
    trainer = recorded_groups(shared_pools.logs)[TRAINER]
    os.killpg(trainer, signal.SIGKILL)
    doomed = {
        adapter
        for adapter in adapters(record)
        if version_of(adapter) > newest(adapter.split("@v")[0])
    }
    assert any(adapter.startswith("restart-a@v") for adapter in doomed), doomed
    rollouts = {name: commit_times(store, RunLayout.ROLLOUTS) for name, store in stores.items()}

    for name, process in runs.items():
        assert process.wait(600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

    # The supervisor restarted the trainer; the server never died.
    assert recorded_groups(shared_pools.logs)[TRAINER] != trainer
    assert shared_pools.process.poll() is None
    assert read_pool_record(POOLS).status == "running"  # type: ignore[union-attr]
    server_log = (shared_pools.logs / "inference-0.log").read_text()
    assert "EngineDeadError" not in server_log and "FileNotFoundError" not in server_log
    # Every tenant completed, each step committed once: the rollouts committed before the
    # kill were kept as they were, and the trainer's steps past its checkpoint were trained
    # again in place (one metric line per step).
    for name, store in stores.items():
        assert committed_steps(store, RunLayout.ROLLOUTS) == list(range(1, RESTART_STEPS + 1))
        kept = commit_times(store, RunLayout.ROLLOUTS)
        assert {step: kept[step] for step in rollouts[name]} == rollouts[name]
        assert committed_steps(store, RunLayout.CHECKPOINTS)[-1] == RESTART_STEPS
        assert_sampled_from_own_adapter(store, RESTART_STEPS)
        log = (tmp_path / f"{name}.log").read_text()
        assert "has already been loaded" not in log
    # Each rolled-back adapter left the server for good while its tenant still held another
    # (the run unloads what it holds only once its stage ended).
    for adapter in doomed:
        events = adapter_events(server_log, adapter.split("@v")[0])
        left = [i for i, event in enumerate(events) if event == ("Removed", adapter)]
        assert left and left[-1] < len(events) - 1, (adapter, events)
        assert ("Loaded new", adapter) not in events[left[0] :], f"{adapter} was loaded again"


def test_a_cancelled_tenant_stops_and_frees_its_slot_within_30_s(
    shared_pools: SharedPools, tmp_path: Path
) -> None:
    """Issue 34, item 1: `prefect flow-run cancel` of a tenant started by `primeflow rl` (a
    flow run in that process, no worker to kill it) stops it: within 30 s its process is
    gone, the shared trainer has let it go and its Prefect concurrency slot is free; the
    flow run stays Cancelled."""
    # A tenant killed by an earlier test holds its slot until its lease lapses (a minute).
    wait_until(lambda: slots_taken() == 0, 120, "the earlier tenants' slots to lapse")
    process = tenant(shared_pools, tmp_path, "cancelled", "reverse_text", seed=7, steps=200)
    log = tmp_path / "cancelled.log"
    store = ObjectStore(f"file://{tmp_path}/runs/cancelled")
    wait_until(
        lambda: committed_steps(store, RunLayout.CHECKPOINTS),
        600,
        f"the tenant's first checkpoint (see {log})",
        poll_s=0.2,
    )
    assert slots_taken() == 1
    found = re.search(r"/runs/flow-run/([0-9a-f-]{36})", log.read_text())
    assert found is not None, log.read_text()
    flow_run_id = found.group(1)
    cancel = subprocess.run(
        [sys.executable, "-m", "prefect", "flow-run", "cancel", flow_run_id],
        env=shared_pools.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    cancelled_at = time.monotonic()

    assert process.wait(30) == 1
    assert "primeflow: the rl flow run was cancelled" in log.read_text()
    files = TenantFiles(POOLS, "cancelled")
    wait_until(
        lambda: (s := files.last_state()) and s["status"] == "released",
        max(0.0, 30 - (time.monotonic() - cancelled_at)),
        "the shared trainer to let the cancelled tenant go",
        poll_s=0.2,
    )
    assert slots_taken() == 0
    assert time.monotonic() - cancelled_at < 30
    trained = committed_steps(store, RunLayout.CHECKPOINTS)[-1]
    assert trained < 200
    state = asyncio.run(flow_run_state(flow_run_id))
    assert state is not None and state.is_cancelled(), state


def slots_taken() -> int:
    """Slots of the pools' Prefect concurrency limit held now."""

    async def read() -> int:
        async with get_client() as client:
            limit = await client.read_global_concurrency_limit_by_name(limit_name(POOLS))
            return limit.active_slots

    return asyncio.run(read())


async def flow_run_state(flow_run_id: str) -> State | None:
    async with get_client() as client:
        return (await client.read_flow_run(UUID(flow_run_id))).state
