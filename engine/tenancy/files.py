"""The files through which tenants and a shared pool pair talk: one folder per pool pair on
this host, `<PRIMEFLOW_HOME>/pools/<name>/`.

    pool.json                    the pair: status, its servers, the trainer, the slots
    tenants/<run>/request.json   a run asks to train (its resolved config), per attempt
    tenants/<run>/lease.json     the run renews it while it lives
    tenants/<run>/state.json     the trainer answers: admitted, finished, failed, refused...
                                 (each answer names the attempt's latest admission)

Each file is written whole and renamed into place, so a reader never sees half of one. The
servers listen on loopback and the trainer's processes are this host's, so the folder is
local: tenants on other hosts would need a network route the pools do not open.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from engine.config import PrimeflowConfig
from engine.process_groups import process_exists
from engine.run import primeflow_home

#: What the trainer says about a tenant's attempt.
TenantStatus = Literal["admitted", "finished", "failed", "refused", "released"]
#: A tenant's attempt that the trainer no longer trains.
ENDED: frozenset[str] = frozenset({"finished", "failed", "refused", "released"})


class NoSuchPoolError(RuntimeError):
    """No shared pool pair of that name is up on this host; the message says how to start it."""


def pool_dir(name: str) -> Path:
    return primeflow_home() / "pools" / name


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return document if isinstance(document, dict) else None


@dataclass(frozen=True)
class PoolRecord:
    """What tenants need to know about a running pool pair (and a supervisor, to end it)."""

    name: str
    status: Literal["starting", "running", "stopped"]
    supervisor_pid: int
    model: str
    #: The adapters every tenant trains: rank, alpha and target modules (`trainer.lora`).
    lora: dict[str, Any]
    tenants: int
    servers: list[str] = field(default_factory=list)
    api_key: str = ""
    started_at: float = field(default_factory=time.time)

    def write(self) -> None:
        path = pool_dir(self.name) / "pool.json"
        _write_json(path, asdict(self))
        path.chmod(0o600)  # it holds the servers' key

    @classmethod
    def read(cls, name: str) -> PoolRecord:
        """The running pool pair `name`, or `NoSuchPoolError`."""
        record = read_pool_record(name)
        if (
            record is None
            or record.status != "running"
            or not process_exists(record.supervisor_pid)
        ):
            raise NoSuchPoolError(
                f"no shared pools named {name!r} are running on this host (looked in "
                f"{pool_dir(name)}): start them with `primeflow pools up --pools.name {name} "
                "@ <config>`"
            )
        return record


def read_pool_record(name: str) -> PoolRecord | None:
    """Pool pair `name`'s record as last written (running, or not), None if there is none."""
    document = _read_json(pool_dir(name) / "pool.json")
    return PoolRecord(**document) if document is not None else None


class TenantFiles:
    """One tenant's three files in pool `pool`'s folder."""

    def __init__(self, pool: str, tenant: str) -> None:
        self.pool, self.tenant = pool, tenant
        self.folder = pool_dir(pool) / "tenants" / tenant

    def request(self, config: PrimeflowConfig) -> str:
        """Ask to train `config` (a new attempt: any earlier one is over); its attempt id."""
        attempt = uuid.uuid4().hex
        self.renew(attempt)
        _write_json(
            self.folder / "request.json",
            {
                "attempt": attempt,
                "pid": os.getpid(),
                "requested_at": time.time(),
                "config": config.model_dump(mode="json"),
            },
        )
        return attempt

    def read_request(self) -> tuple[str, PrimeflowConfig] | None:
        document = _read_json(self.folder / "request.json")
        if document is None:
            return None
        return str(document["attempt"]), PrimeflowConfig.model_validate(document["config"])

    def requested_attempt(self) -> str | None:
        """The attempt the tenant asks for, without validating its config (what a poll needs)."""
        document = _read_json(self.folder / "request.json")
        return None if document is None else str(document["attempt"])

    def withdraw(self, attempt: str) -> None:
        """End `attempt` from the tenant's side (finished, failed or cancelled)."""
        if self.requested_attempt() == attempt:
            (self.folder / "request.json").unlink(missing_ok=True)
        (self.folder / "lease.json").unlink(missing_ok=True)

    def renew(self, attempt: str) -> None:
        _write_json(
            self.folder / "lease.json",
            {"attempt": attempt, "pid": os.getpid(), "renewed_at": time.time()},
        )

    def lease_age(self, attempt: str) -> float | None:
        """Seconds since `attempt` last renewed its lease; None if it holds none."""
        lease = _read_json(self.folder / "lease.json")
        if lease is None or lease.get("attempt") != attempt:
            return None
        return max(0.0, time.time() - float(lease["renewed_at"]))

    def answer(
        self,
        attempt: str,
        status: TenantStatus,
        admitted_at: float | None = None,
        **details: Any,
    ) -> None:
        """The trainer's word on `attempt` (`details`: step, slot, error...), with the time
        it last admitted it (none for an attempt refused or failed before its admission).

        Every answer names that admission because each overwrites the one before: a tenant
        that reads only `finished` still learns that a restarted trainer admitted it again.
        """
        document = {"attempt": attempt, "status": status, "at": time.time(), **details}
        if admitted_at is not None:
            document["admitted_at"] = admitted_at
        _write_json(self.folder / "state.json", document)

    def last_state(self) -> dict[str, Any] | None:
        """The trainer's last word on this tenant, whichever attempt it was about."""
        return _read_json(self.folder / "state.json")

    def state(self, attempt: str) -> dict[str, Any] | None:
        """The trainer's last word on `attempt`, None before it said anything."""
        document = self.last_state()
        return document if document is not None and document.get("attempt") == attempt else None


def tenant_names(pool: str) -> list[str]:
    folder = pool_dir(pool) / "tenants"
    return (
        sorted(path.name for path in folder.iterdir() if path.is_dir()) if folder.exists() else []
    )


def lora_of(config: PrimeflowConfig) -> dict[str, Any]:
    """What must be equal between a pool pair and its tenants: the adapters' shape."""
    lora = config.trainer.lora
    assert lora is not None
    return {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "target_modules": sorted(lora.target_modules),
    }


def refusal(record: PoolRecord, config: PrimeflowConfig) -> str | None:
    """Why `config` cannot be a tenant of the pools `record` describes, in one line; None: it
    can (what the tenant's stage and the CLI's preflight both say)."""
    problems = misfits(record.model, record.lora, config)
    if not problems:
        return None
    return f"this run cannot train on pools {record.name!r}: {'; '.join(problems)}"


def misfits(model: str, lora: dict[str, Any], config: PrimeflowConfig) -> list[str]:
    """Why `config` cannot be a tenant of pools that train `model` with adapters `lora`
    (`lora_of`); empty: it can."""
    problems = []
    if config.trainer.model != model:
        problems.append(f"trainer.model is {config.trainer.model!r}, the pools train {model!r}")
    if config.trainer.lora is None:
        problems.append("trainer.lora is not set: the pools train adapters only")
    elif lora_of(config) != lora:
        problems.append(f"trainer.lora is {lora_of(config)}, the pools' adapters are {lora}")
    return problems
