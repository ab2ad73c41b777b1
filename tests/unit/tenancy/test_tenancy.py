"""The files between tenants and shared pools: attempts, leases, answers, fit."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from engine.config import PrimeflowConfig, with_overrides
from engine.tenancy.files import (
    NoSuchPoolError,
    PoolRecord,
    TenantFiles,
    lora_of,
    misfits,
    pool_dir,
    read_pool_record,
    tenant_names,
)


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PRIMEFLOW_HOME", str(tmp_path))
    return tmp_path


def tenant(name: str = "a", **overrides: object) -> PrimeflowConfig:
    config = PrimeflowConfig.model_validate(
        {"run": {"name": name}, "pools": {"name": "p"}, "trainer": {"lora": {"rank": 8}}}
    )
    return with_overrides(config, overrides)


def record(status: str = "running", pid: int | None = None) -> PoolRecord:
    config = tenant()
    return PoolRecord(
        name="p",
        status=status,  # type: ignore[arg-type]
        supervisor_pid=os.getpid() if pid is None else pid,
        model=str(config.trainer.model),
        lora=lora_of(config),
        tenants=2,
        servers=["http://127.0.0.1:1"],
        api_key="secret",
    )


def test_a_request_is_one_attempt_with_its_lease_and_answers() -> None:
    files = TenantFiles("p", "a")
    first = files.request(tenant())
    assert files.read_request() is not None
    attempt, config = files.read_request()  # type: ignore[misc]
    assert attempt == first and config == tenant()
    assert files.lease_age(first) is not None and files.lease_age(first) < 5  # type: ignore[operator]
    assert files.state(first) is None
    files.answer(first, "admitted", step=0)
    assert files.state(first)["status"] == "admitted"  # type: ignore[index]

    # A new start is a new attempt: the trainer's word on the old one is not about it.
    second = files.request(tenant())
    assert second != first and files.state(second) is None
    assert files.lease_age(first) is None  # the lease is the new attempt's
    files.withdraw(first)  # a stale attempt withdraws nothing of the new one
    assert files.read_request() is not None
    files.withdraw(second)
    assert files.read_request() is None and files.lease_age(second) is None
    assert tenant_names("p") == ["a"]


def test_a_lease_ages_until_renewed() -> None:
    files = TenantFiles("p", "a")
    attempt = files.request(tenant())
    lease = pool_dir("p") / "tenants" / "a" / "lease.json"
    document = json.loads(lease.read_text())
    lease.write_text(json.dumps({**document, "renewed_at": time.time() - 100}))
    assert 99 < files.lease_age(attempt) < 200  # type: ignore[operator]
    files.renew(attempt)
    assert files.lease_age(attempt) < 5  # type: ignore[operator]


def test_only_a_running_pool_with_a_live_supervisor_is_found() -> None:
    with pytest.raises(NoSuchPoolError, match=r"no shared pools named 'p' .*primeflow pools up"):
        PoolRecord.read("p")
    record().write()
    assert PoolRecord.read("p").api_key == "secret"
    assert (pool_dir("p") / "pool.json").stat().st_mode & 0o777 == 0o600
    record("stopped").write()
    with pytest.raises(NoSuchPoolError):
        PoolRecord.read("p")
    assert read_pool_record("p").status == "stopped"  # type: ignore[union-attr]
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    record(pid=dead).write()
    with pytest.raises(NoSuchPoolError):
        PoolRecord.read("p")


def test_a_tenant_must_train_the_pools_model_and_adapter_shape() -> None:
    pool = record()
    assert misfits(pool.model, pool.lora, tenant()) == []
    assert misfits(pool.model, pool.lora, tenant(**{"trainer.lora.rank": 16})) == [
        "trainer.lora is {'rank': 16, 'alpha': 16.0, 'target_modules': "
        f"{sorted(tenant().trainer.lora.target_modules)}}}, the pools' adapters are {pool.lora}"  # type: ignore[union-attr]
    ]
    other = tenant(**{"model.name": "./elsewhere"})
    assert [p.split(",")[0] for p in misfits(pool.model, pool.lora, other)] == [
        "trainer.model is './elsewhere'"
    ]
    assert time.time() - pool.started_at < 60
