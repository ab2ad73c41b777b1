"""A tenant's RL stage on shared pools: the `StageTrainer` that `engine.stages.run_rl` drives
when the run names `pools.name`, in place of a trainer pool of its own.

It trains nothing itself: it asks the shared trainer (`engine.tenancy.shared_trainer`) to
train this run through the tenant files (`engine.tenancy.files`), keeps its lease alive, and
reads the trainer's answers; the orchestrator beside it samples from the tenant's view of the
shared servers (`engine.tenancy.attached`).
"""

from __future__ import annotations

import threading
from typing import Any

from engine.config import PrimeflowConfig
from engine.inference.control import ReloadError
from engine.inference.serving import PolicyServing
from engine.run import Run
from engine.stage_trainer import Logger, StageFailedError, StageHungError, StageWatch
from engine.tenancy.files import ENDED, PoolRecord, TenantFiles, pool_dir, refusal
from storage.commit import latest_committed_step
from storage.layout import RunLayout


class TenantStage:
    """A tenant's side of the shared trainer (`engine.tenancy.shared_trainer`): its request, the
    lease it renews while it lives, the trainer's answers; the tenant withdraws however the
    stage ends, and the pools go on. It is the `StageTrainer` of a tenant's RL stage.

    A restarted trainer admits the tenant again from its last checkpoint and deletes the
    policy versions published past it. At each admission the tenant's servers catch up with
    the newest version there is (`pool`), whose swap unloads the rolled-back ones
    (`engine.inference.adapters.superseded`): the orchestrator would do it at its next
    reload, but none comes once it has committed its last rollouts. A trainer that finishes
    the tenant between two polls overwrites the `admitted` answer, so every answer names the
    latest admission, and the stage ends only once it caught up: serving the final version.
    """

    def __init__(
        self,
        config: PrimeflowConfig,
        run: Run,
        logger: Logger,
        pool: PolicyServing,
        cancel: threading.Event | None = None,
    ) -> None:
        assert config.pools.name is not None
        self.config, self.logger = config, logger
        self.store = run.store
        self.serving = pool  # the shared inference pool: this tenant has no trainer pool
        self.watch = StageWatch(run.store, "rl", config.watchdog, cancel)
        self.pools = config.pools.name
        self.files = TenantFiles(self.pools, config.run.name)
        self.attempt = ""
        self._beating = threading.Event()
        self._heart: threading.Thread | None = None
        self._said: dict[str, Any] | None = None
        #: When the trainer last admitted this attempt, as acted on, and whether the servers
        #: are still to catch up with it.
        self._admitted_at: float | None = None
        self._catch_up = False

    def __enter__(self) -> TenantStage:
        record = PoolRecord.read(self.pools)
        refused = refusal(record, self.config)
        if refused:
            raise ValueError(refused)
        self.attempt = self.files.request(self.config)
        self._heart = threading.Thread(target=self._renew, name="tenant-lease", daemon=True)
        self._heart.start()
        self.logger.info(
            "rl: training on the shared pools %r (tenant %s, attempt %s)",
            self.pools,
            self.config.run.name,
            self.attempt[:8],
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self._beating.set()
        if self._heart is not None:
            self._heart.join()
        self.files.withdraw(self.attempt)

    def _renew(self) -> None:
        while not self._beating.wait(self.config.pools.heartbeat_s):
            self.files.renew(self.attempt)

    def poll(self) -> int | None:
        """0 once the shared trainer committed the last step and the servers caught up with
        its latest admission; a failure raises (`check`)."""
        self._said = self.files.state(self.attempt)
        status = self._said["status"] if self._said else None
        if status in ENDED and status != "finished":
            raise self.failure(1)
        admitted_at = self._said.get("admitted_at") if self._said else None
        if admitted_at is not None and admitted_at != self._admitted_at:
            self._admitted_at, self._catch_up = admitted_at, True
        if self._catch_up:
            self._catch_up = not self._serve_newest()
        return 0 if status == "finished" and not self._catch_up else None

    def _serve_newest(self) -> bool:
        """Serve the newest committed policy version, as the orchestrator's next reload would;
        whether it is served (one that cannot be yet is tried at the next poll)."""
        step = latest_committed_step(self.store, RunLayout.POLICIES)
        if step is None:
            return False  # the trainer is still writing the version it starts from
        try:
            self.serving.reload(self.store.url(RunLayout.policy_dir(step)), step)
        except ReloadError as exc:
            self.logger.info("rl: policy version %d is not served yet: %s", step, exc)
            return False
        return True

    def check(self) -> None:
        """Fail the stage when the pools are gone or the stage went silent too long; stop it
        once `cancel` is set (leaving it withdraws the tenant: the trainer lets it go)."""
        self.watch.stop_if_cancelled()
        PoolRecord.read(self.pools)
        stall = self.watch.stall()
        if stall is not None:
            log_path = pool_dir(self.pools) / "logs" / "trainer-tenants.log"
            raise StageHungError(
                f"the rl stage hung on the shared pools {self.pools!r}: "
                f"{stall.describe(self.config.watchdog)}; the shared trainer's log is {log_path}",
                log_path,
            )

    def failure(self, code: int) -> StageFailedError:
        """The shared trainer's last answer (failed, refused, released) and its error: the
        pools go on, so that answer, not an exit status, says why this run ended."""
        said = self._said or {}
        return StageFailedError(
            f"the shared trainer of pools {self.pools!r} {said.get('status', 'stopped')} this "
            f"run: {said.get('error', f'status {code}')}"
        )
