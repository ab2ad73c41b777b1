"""The shared trainer: one model in memory, one LoRA adapter and optimizer per tenant run.

`python -m engine.tenancy.shared_trainer --config pools.json`, one process per rank under torchrun,
as `primeflow pools up` starts it. The base model is loaded and sharded once, with one adapter
slot (FSDP2 fixes a unit's parameters when it shards it). Each tenant is a whole RL `Trainer`
(`engine.trainer.build`) of its own run — optimizer, schedule, publisher, resume
checkpoints, metrics — around that shared model; while it trains, the slot holds its
adapter, and each tenant's adapter waits in device memory beside the model otherwise
(a copy of ~1 % of the model's bytes at each switch).

Rank 0 reads the tenants' files (`engine.tenancy.files`) and decides, for every rank
(`from_main`): whom to admit, whom to let go (its run withdrew, or its lease lapsed: the run
died) and which tenant's committed step to train next, in turn among those that have one.
A tenant's failure (bad data, a damaged checkpoint) fails that tenant only: it is told why
and let go, and the others go on. Every tenant starts, resumes and publishes exactly as a
run with a trainer of its own would (its fresh adapter is drawn from its own `run.seed`).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from engine.config import PrimeflowConfig
from engine.run import rl_start
from engine.tenancy.files import ENDED, TenantFiles, lora_of, misfits, tenant_names
from engine.trainer.build import (
    StageStart,
    Trainer,
    load_start_adapter,
    policy_context,
    rl_plan,
    trainer_on,
)
from engine.trainer.distributed import DistInfo, from_main
from engine.trainer.loss import LossFn, build_loss
from engine.trainer.publish import PolicyPublisher
from engine.trainer.rl import start_publishing, train_rl_step
from engine.trainer.step import StepContext
from engine.trainer.worker import in_process_group, rank_config
from storage.commit import is_committed, latest_committed_step
from storage.layout import RunLayout
from storage.shards import read_rollouts

log = logging.getLogger("primeflow.trainer.tenants")


@dataclass
class Tenant:
    """One tenant's attempt on this rank: its trainer and its adapter while another trains."""

    name: str
    attempt: str
    trainer: Trainer
    publisher: PolicyPublisher
    loss_fn: LossFn
    next_step: int
    #: When this trainer admitted the attempt, named in every answer about it.
    admitted_at: float
    #: The adapter's parameters, sharded as the slot's are (stale while this tenant trains).
    adapter: list[torch.Tensor] = field(default_factory=list)
    last_trained: int = 0


@dataclass(frozen=True)
class Plan:
    """What every rank does next, as rank 0 decided it."""

    #: (tenant, attempt, resolved config as JSON) to start training.
    admit: tuple[tuple[str, str, str], ...] = ()
    #: (tenant, why) to let go.
    release: tuple[tuple[str, str], ...] = ()
    #: The tenant whose next step to train now.
    train: str | None = None

    @property
    def idle(self) -> bool:
        return not self.admit and not self.release and self.train is None


class SharedTrainer:
    """The slot, the tenants and their turns, on one rank."""

    def __init__(self, config: PrimeflowConfig, dist: DistInfo, assets: dict[str, bytes]):
        assert config.pools.name is not None
        self.config = config
        self.pool = config.pools.name
        self.dist = dist
        self.assets = assets
        start = StageStart(config.trainer.init_checkpoint, config.trainer.lora)
        self.ctx: StepContext = policy_context(config, dist, start)
        self.params = [p for _, p in self.ctx.policy.trainable()]
        self.tenants: dict[str, Tenant] = {}
        #: The tenant whose adapter the slot holds.
        self.current: Tenant | None = None
        self._order = itertools.count()

    # -- rank 0: the plan ---------------------------------------------------------------------

    def plan(self) -> Plan:
        """Rank 0: read the tenants' files and decide the next move (collective)."""
        plan = self._read_plan() if self.dist.is_main else Plan()
        return from_main(plan, self.dist)

    def _read_plan(self) -> Plan:
        release: list[tuple[str, str]] = []
        admit: list[tuple[str, str, str]] = []
        lease_s = self.config.pools.lease_s
        for name in tenant_names(self.pool):
            files = TenantFiles(self.pool, name)
            attempt = files.requested_attempt()
            active = self.tenants.get(name)
            if active is not None:
                why = self._gone(files, active.attempt, attempt, lease_s)
                if why is None:
                    continue
                release.append((name, why))
            if attempt is None:
                continue
            age = files.lease_age(attempt)
            state = files.state(attempt)
            if age is None or age > lease_s or (state is not None and state["status"] in ENDED):
                continue
            request = files.read_request()  # a new attempt: only now is its config validated
            if request is None or request[0] != attempt:
                continue
            config = request[1]
            refusal = self._refusal(config, len(self.tenants) - len(release) + len(admit))
            if refusal is not None:
                files.answer(attempt, "refused", error=refusal)
                continue
            admit.append((name, attempt, config.model_dump_json()))
        return Plan(admit=tuple(admit), release=tuple(release), train=self._next_turn(release))

    @staticmethod
    def _gone(
        files: TenantFiles, attempt: str, requested: str | None, lease_s: float
    ) -> str | None:
        if requested != attempt:
            return "withdrawn"
        age = files.lease_age(attempt)
        if age is None or age > lease_s:
            return "its lease is gone" if age is None else f"its lease lapsed ({age:.0f} s old)"
        return None

    def _refusal(self, config: PrimeflowConfig, taken: int) -> str | None:
        if taken >= self.config.pools.tenants:
            return (
                f"all {self.config.pools.tenants} tenant slots of pools {self.pool!r} are taken "
                f"(pools.tenants); Prefect queues runs on the concurrency limit "
                f"primeflow-pool-{self.pool} when they go through `primeflow rl`"
            )
        problems = misfits(self.config.trainer.model, lora_of(self.config), config)
        return "; ".join(problems) if problems else None

    def _next_turn(self, release: list[tuple[str, str]]) -> str | None:
        """The tenant whose next step is committed and who trained least recently."""
        leaving = {name for name, _ in release}
        ready = [
            tenant
            for name, tenant in self.tenants.items()
            if name not in leaving
            and is_committed(tenant.trainer.store, RunLayout.rollouts_dir(tenant.next_step))
        ]
        return min(ready, key=lambda t: t.last_trained).name if ready else None

    # -- every rank: the moves ----------------------------------------------------------------

    def run(self) -> None:
        """Serve tenants until the pool is stopped (SIGTERM from its supervisor)."""
        log.info("shared trainer %s up: %d tenant slots", self.pool, self.config.pools.tenants)
        while True:
            plan = self.plan()
            for name, why in plan.release:
                self._let_go(self.tenants.pop(name), "released", why)
            for name, attempt, config_json in plan.admit:
                self._guarded(name, attempt, partial(self._admit, name, attempt, config_json))
            if plan.train is not None:
                tenant = self.tenants[plan.train]
                self._guarded(tenant.name, tenant.attempt, partial(self._train, tenant))
            if plan.idle:
                time.sleep(self.config.pools.poll_s)

    def _guarded(self, name: str, attempt: str, move: Callable[[], None]) -> None:
        """Run `move` for tenant `name`; its failure fails that tenant alone."""
        try:
            move()
        except Exception as exc:  # any error of one tenant's data or files
            log.exception("tenant %s failed", name)
            tenant = self.tenants.pop(name, None)
            if tenant is not None:
                self._let_go(tenant, "failed", f"{type(exc).__name__}: {exc}", flush=False)
            elif self.dist.is_main:
                TenantFiles(self.pool, name).answer(
                    attempt, "failed", error=f"{type(exc).__name__}: {exc}"
                )

    def _admit(self, name: str, attempt: str, config_json: str) -> None:
        config = PrimeflowConfig.model_validate_json(config_json)
        self._hold(None)
        trainer = trainer_on(self.ctx, config, "rl", self.assets, rl_plan(config.trainer))
        load_start_adapter(self.ctx.policy, config, rl_start(config, trainer.run_store))
        first, _ = trainer.resume()
        tenant = Tenant(
            name=name,
            attempt=attempt,
            trainer=trainer,
            publisher=start_publishing(trainer, first - 1),
            loss_fn=build_loss(trainer.config.loss),
            next_step=first,
            admitted_at=time.time(),
            last_trained=next(self._order),
        )
        self.tenants[name] = tenant
        self.current = tenant
        self._answer(tenant, "admitted", step=first - 1)
        log.info("admitted tenant %s (attempt %s) at step %d", name, attempt[:8], first)
        if first > trainer.max_steps:
            self._finish(tenant)

    def _train(self, tenant: Tenant) -> None:
        self._hold(tenant)
        step = tenant.next_step
        table = read_rollouts(tenant.trainer.store, step)
        train_rl_step(tenant.trainer, tenant.publisher, tenant.loss_fn, step, table, 0.0)
        tenant.next_step = step + 1
        tenant.last_trained = next(self._order)
        if step == tenant.trainer.max_steps:
            self._finish(tenant)

    def _finish(self, tenant: Tenant) -> None:
        """Its last step is trained: commit what it writes, then tell it it is done."""
        self.tenants.pop(tenant.name, None)
        self._let_go(tenant, "finished", None)

    def _let_go(self, tenant: Tenant, status: Any, why: str | None, *, flush: bool = True) -> None:
        """Close `tenant`'s writers (finishing what they write, unless it failed) and tell it."""
        if self.current is tenant:
            self.current = None
        for writer in (tenant.publisher, tenant.trainer.checkpoints):
            try:
                if flush:
                    writer.flush()
            finally:
                writer.close()
        step = latest_committed_step(tenant.trainer.store, RunLayout.CHECKPOINTS) or 0
        self._answer(tenant, status, step=step, **({"error": why} if why else {}))
        log.info("tenant %s %s%s", tenant.name, status, f": {why}" if why else "")

    def _answer(self, tenant: Tenant, status: Any, **details: Any) -> None:
        if self.dist.is_main:
            files = TenantFiles(self.pool, tenant.name)
            files.answer(tenant.attempt, status, tenant.admitted_at, **details)

    @torch.no_grad()
    def _hold(self, tenant: Tenant | None) -> None:
        """Put `tenant`'s adapter in the slot (None: keep the slot's adapter aside, for a
        tenant about to be loaded into it). The snapshots a publisher or checkpoint is still
        copying from the slot on the device are waited for first."""
        if self.current is tenant:
            return
        if self.dist.device.type == "cuda":
            torch.cuda.synchronize(self.dist.device)
        if self.current is not None:
            if not self.current.adapter:
                self.current.adapter = [p.detach().clone() for p in self.params]
            else:
                for kept, param in zip(self.current.adapter, self.params, strict=True):
                    kept.copy_(param)
        if tenant is not None:
            for param, kept in zip(self.params, tenant.adapter, strict=True):
                param.copy_(kept)
        self.current = tenant


def serve_tenants(config: PrimeflowConfig, dist: DistInfo, assets: dict[str, bytes]) -> None:
    SharedTrainer(config, dist, assets).run()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.tenancy.shared_trainer")
    parser.add_argument("--config", required=True, help="the pools' PrimeflowConfig as JSON")
    args = parser.parse_args(argv)
    in_process_group(rank_config(args.config), serve_tenants)
    return 0


if __name__ == "__main__":
    sys.exit(main())
