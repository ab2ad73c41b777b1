"""The shared pool pair that `primeflow pools up` keeps running: one inference pool serving
the base model with runtime LoRA, one trainer pool training every tenant's adapter
(`engine.tenancy.shared_trainer`), both in process groups of their own.

The supervisor records them (`pool.json`, for tenants; `process-groups.json`, for whoever
must kill them), restarts a trainer that died (tenants resume from their last committed
checkpoint, as after any restart), unloads the adapters of tenants that died without doing
so themselves, and stops both pools however it ends. A tenant never stops the pools.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import asdict
from typing import Any

import httpx

from engine.config import PrimeflowConfig
from engine.inference.adapters import unload_lineage
from engine.inference.control import control_client
from engine.inference.pool import InferencePool
from engine.process_groups import forget_group, kill_recorded_groups, record_group
from engine.run import run_store
from engine.stage_trainer import Logger
from engine.tenancy.files import (
    PoolRecord,
    TenantFiles,
    lora_of,
    pool_dir,
    read_pool_record,
    tenant_names,
)
from engine.trainer.pool import TrainerPool
from storage.metrics import recent_metrics

log = logging.getLogger("primeflow.pools")
#: Trainer restarts before the supervisor gives up (a trainer that keeps dying has a bug).
MAX_TRAINER_RESTARTS = 3
#: How often the supervisor looks at its pools.
CHECK_S = 1.0
TRAINER = "trainer-tenants"
#: How long `stop_running` waits for the supervisor to stop its pools before killing them.
DOWN_GRACE_S = 60.0


class SharedPoolsError(RuntimeError):
    """The shared pools cannot go on; the message says which part failed and where its log is."""


class SharedPools:
    """The pools of `config.pools.name`: start, supervise, stop."""

    def __init__(self, config: PrimeflowConfig, logger: Logger = log) -> None:
        if config.pools.name is None or config.trainer.lora is None:
            raise ValueError("shared pools need pools.name and trainer.lora")
        self.config = config
        self.logger = logger
        self.name = config.pools.name
        self.logs = pool_dir(self.name) / "logs"
        self.inference = InferencePool.for_run(config, self.logs)
        self.trainer = TrainerPool(config, "tenants", log_path=self.logs / f"{TRAINER}.log")
        self.restarts = 0
        #: (tenant, attempt) whose adapters were unloaded after its lease lapsed.
        self._cleaned: set[tuple[str, str]] = set()
        self._cleaned_at = 0.0

    def _record(self, status: str) -> PoolRecord:
        record = PoolRecord(
            name=self.name,
            status=status,  # type: ignore[arg-type]
            supervisor_pid=os.getpid(),
            model=str(self.config.trainer.model),
            lora=lora_of(self.config),
            tenants=self.config.pools.tenants,
            servers=[e.base_url for e in self.inference.endpoints],
            api_key=self.inference.api_key if status == "running" else "",
        )
        record.write()
        return record

    def start(self) -> PoolRecord:
        """Start both pools; the record says `running` once tenants can use them."""
        try:
            PoolRecord.read(self.name)
        except RuntimeError:
            pass
        else:
            raise SharedPoolsError(f"shared pools {self.name!r} are running already")
        self._record("starting")
        try:
            self.inference.start()
            for group, pgid in self.inference.process_groups.items():
                record_group(self.logs, group, pgid)
            self._start_trainer()
        except BaseException:
            self.stop()
            raise
        return self._record("running")

    def _start_trainer(self) -> None:
        self.trainer.start()
        record_group(self.logs, TRAINER, self.trainer.pgid)

    def check(self) -> None:
        """One look: restart a trainer that died, clean up after dead tenants; raise
        `SharedPoolsError` when a server died or the trainer keeps dying."""
        dead = self.inference.exited()
        if dead:
            raise SharedPoolsError(
                f"inference servers of pools {self.name!r} exited: {dead}; logs in {self.logs}"
            )
        code = self.trainer.poll()
        if code is not None:
            cause = self.trainer.last_error() or f"status {code}"
            if self.restarts >= MAX_TRAINER_RESTARTS:
                raise SharedPoolsError(
                    f"the shared trainer of pools {self.name!r} died {self.restarts + 1} times, "
                    f"last of {cause}; see {self.trainer.log_path}"
                )
            self.restarts += 1
            self.logger.warning("the shared trainer died (%s); restart %d", cause, self.restarts)
            self.trainer.stop()
            self.trainer = TrainerPool(self.config, "tenants", log_path=self.trainer.log_path)
            self._start_trainer()
        if time.monotonic() - self._cleaned_at > self.config.pools.heartbeat_s:
            self._cleaned_at = time.monotonic()
            self._unload_dead_tenants()

    def _unload_dead_tenants(self) -> None:
        """Unload the adapters of tenants whose lease lapsed (a tenant that ends normally
        unloads its own)."""
        for tenant in tenant_names(self.name):
            files = TenantFiles(self.name, tenant)
            attempt = files.requested_attempt()
            if attempt is None or (tenant, attempt) in self._cleaned:
                continue
            age = files.lease_age(attempt)
            if age is not None and age <= self.config.pools.lease_s:
                continue
            unload_lineage(tenant, self._clients)
            self._cleaned.add((tenant, attempt))
            self.logger.info("tenant %s is gone: its adapters are unloaded", tenant)

    def _clients(self) -> list[httpx.Client]:
        timeout = self.config.inference.reload_timeout_s
        return [
            control_client(e.base_url, self.inference.api_key, timeout)
            for e in self.inference.endpoints
        ]

    def serve(self, stop: threading.Event) -> None:
        """Supervise until `stop` is set; the caller has started the pools and stops them."""
        while not stop.wait(CHECK_S):
            self.check()

    def stop(self) -> None:
        """Stop the trainer, then the servers; safe to call more than once."""
        self.trainer.stop()
        forget_group(self.logs, TRAINER)
        groups = self.inference.process_groups
        self.inference.stop()
        for group in groups:
            forget_group(self.logs, group)
        self._record("stopped")


def stop_running(name: str, grace_s: float = DOWN_GRACE_S) -> list[str] | None:
    """Stop the running pools `name` from another process: SIGTERM their supervisor, wait
    for it to stop both pools, kill what is left after `grace_s`. The process groups killed
    that way, or None when no such pools were running."""
    record = read_pool_record(name)
    if record is None or record.status == "stopped":
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(record.supervisor_pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        record = read_pool_record(name)
        if record is None or record.status == "stopped":
            break
        time.sleep(0.5)
    return kill_recorded_groups(pool_dir(name) / "logs")


def status_of(name: str) -> dict[str, Any]:
    """The pools' record (without their key) and what the trainer last said of each tenant."""
    record = read_pool_record(name)
    document: dict[str, Any] = {"name": name, "status": "absent"}
    if record is not None:
        document = {key: value for key, value in asdict(record).items() if key != "api_key"}
    document["tenants_now"] = {tenant: tenant_now(name, tenant) for tenant in tenant_names(name)}
    return document


#: Steps over which `tenant_now` measures a tenant's rate.
RATE_WINDOW = 10


def tenant_now(pool: str, tenant: str) -> dict[str, Any] | None:
    """The trainer's last word on `tenant` (admitted, released, ...: its `step` is the step
    of that word), and while the tenant asks to train: its newest trained step from its run's
    metrics (`last_step`, `last_step_age_s`), its rate over the last steps (`steps_per_min`)
    and the age of its lease (`heartbeat_age_s`: a tenant renews it while it lives)."""
    files = TenantFiles(pool, tenant)
    document = dict(files.last_state() or {})
    try:
        request = files.read_request()
    except ValueError as exc:  # a request this version cannot read: say so, show the rest
        return {**document, "request_error": str(exc)}
    if request is None:
        return document or None
    attempt, config = request
    document["heartbeat_age_s"] = files.lease_age(attempt)
    lines = recent_metrics(run_store(config), "rl", RATE_WINDOW + 1)
    if lines:
        newest = lines[-1]
        document["last_step"] = newest["step"]
        document["last_step_age_s"] = max(0.0, time.time() - float(newest["time"]))
        if len(lines) > 1 and newest["time"] > lines[0]["time"]:
            steps = newest["step"] - lines[0]["step"]
            document["steps_per_min"] = 60.0 * steps / (newest["time"] - lines[0]["time"])
    return document
