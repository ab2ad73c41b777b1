"""Shared pools with two LoRA tenants, end to end: `primeflow pools up` (a real vLLM CPU server
with runtime LoRA and the shared trainer), two `primeflow rl` runs as tenants (each a flow run
of its own, admitted through the pools' Prefect concurrency limit), one killed mid-run.

Each tenant starts from an adapter with random B of its own, so a server that sampled one
tenant's request with another's adapter (or the base) would show in that tenant's trainer
`mismatch_kl`, as in `tests/integration/trainer/test_lora_rl.py`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine.config import load_config
from engine.models.resolve import resolve_model
from engine.process_groups import GROUPS_FILE
from engine.tenancy import TenantFiles, pool_dir, read_pool_record
from flows.deploy import REPO_ROOT
from storage.commit import committed_steps, read_commit
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.store import ObjectStore
from tests.integration.adapters import random_adapter
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


def tenant(pools: SharedPools, tmp: Path, name: str, env: str, seed: int) -> subprocess.Popen:
    """`primeflow rl` for tenant `name` of the shared pools, from an adapter of its own (made
    on its first start)."""
    folder = tmp / f"start-{name}"
    start = ObjectStore(f"file://{folder}").url(RunLayout.checkpoint_dir(0))
    if not folder.exists():
        model = Path(resolve_model("primeflow/tiny-qwen3"))
        assert LORA is not None
        random_adapter(model, LORA, folder, seed=seed)
    overlay = write(
        tmp / f"{name}.toml",
        f"""max_steps = {STEPS}
seq_len = 256
{SHARED}
[run]
name = "{name}"
[storage]
uri = "file://{tmp}/runs"
[trainer]
init_checkpoint = "{start}"
[trainer.checkpoint]
interval = 1
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


def assert_sampled_from_own_adapter(store: ObjectStore) -> None:
    """The trainer's log-probs of every step's sampled tokens match the server's."""
    lines = read_metrics(store, "rl")
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
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

    def adapters() -> list[str]:
        response = httpx.get(
            f"{record.servers[0]}/v1/models",
            headers={"Authorization": f"Bearer {record.api_key}"},
            timeout=30,
        )
        return [card["id"] for card in response.json()["data"] if "@v" in card["id"]]

    wait_until(lambda: adapters() == [], 60, "the tenants' adapters to be unloaded")

    # Run again, the killed tenant resumes on the same pools: what it had committed stays.
    again = tenant(shared_pools, tmp_path, "doomed", "reverse_text", seed=1)
    assert again.wait(600) == 0, (tmp_path / "doomed.log").read_text()[-3000:]
    assert committed_steps(doomed_store, RunLayout.ROLLOUTS) == list(range(1, STEPS + 1))
    for step, created in kept.items():
        assert read_commit(doomed_store, RunLayout.rollouts_dir(step)).created_at == created
    assert committed_steps(doomed_store, RunLayout.CHECKPOINTS)[-1] == STEPS
    assert_sampled_from_own_adapter(doomed_store)
