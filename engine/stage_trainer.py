"""What a stage's loop (`engine.stages.run_sft`, `run_rl`) needs of the trainer it supervises:
the `StageTrainer` protocol, the errors that end a stage, and the `StageWatch` that every
trainer side shares for cancellation and the hang watch.

Two kinds of trainer side satisfy the protocol: a trainer pool of the stage's own
(`engine.stages`) and a tenant's side of shared pools (`engine.tenancy.stage`). They share
these pieces by composition, and this module sits below both so that `engine.stages`, which
picks the tenant stage, and the tenant stage never import each other.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Protocol, Self

from engine.config.watchdog import WatchdogConfig
from engine.watchdog import ProgressClock, Stall
from storage.layout import Stage
from storage.metrics import latest_metric_step
from storage.store import ObjectStore

#: Where a stage reports its milestones (a Prefect task passes its run logger).
Logger = logging.Logger | logging.LoggerAdapter[Any]
#: How often a running stage is checked (trainer alive, orchestrator alive, hang).
POLL_S = 1.0
#: Longest time between two listings of the stage's metric lines by the hang watch.
PROGRESS_POLL_S = 5.0


class StageFailedError(RuntimeError):
    """A stage's process exited with an error; the message names its log."""


class StageCancelledError(RuntimeError):
    """The stage was asked to stop (its flow run was cancelled): its trainer and orchestrator
    were stopped, and a tenant withdrew from its shared pools."""


class StageHungError(StageFailedError):
    """A stage made no progress for longer than the watchdog allows; the message names the
    processes that did not answer and `report`, which holds every process's stacks."""

    def __init__(self, message: str, report: Path) -> None:
        super().__init__(message)
        self.report = report

    def __reduce__(self) -> tuple[type[StageHungError], tuple[str, Path]]:
        return type(self), (str(self), self.report)  # Prefect pickles task exceptions


class StageTrainer(Protocol):
    """The trainer side of a stage as its loop drives it: entered for the stage's life (leaving
    stops or withdraws whatever it started), polled and checked every `POLL_S`, and asked to
    explain an exit status other than 0."""

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...

    def poll(self) -> int | None:
        """The trainer's exit status, None while it trains."""
        ...

    def check(self) -> None:
        """Raise once the stage must end: cancelled, hung, or its trainer gone."""
        ...

    def failure(self, code: int) -> StageFailedError:
        """The error that ends the stage when the trainer exited with `code`."""
        ...


def wait_for(trainer: StageTrainer) -> int:
    """Wait for the trainer to end (failing the stage if it hangs); its exit status."""
    while (code := trainer.poll()) is None:
        time.sleep(POLL_S)
        trainer.check()
    return code


class StageWatch:
    """What every trainer side watches beside its own processes: `cancel`, set when the stage
    is asked to stop, and the stage's progress as its committed metric lines show it (the
    orchestrator's too, in RL), for the hang watch.

    Storage is listed at most every `interval_s` (a quarter of the shortest silence the
    watchdog allows, at most `PROGRESS_POLL_S`), not on every check of the trainer.
    """

    def __init__(
        self,
        store: ObjectStore,
        stage: Stage,
        config: WatchdogConfig,
        cancel: threading.Event | None = None,
    ) -> None:
        self.store, self.stage, self.cancel = store, stage, cancel
        self.stages: tuple[str, ...] = (stage, "orchestrator") if stage == "rl" else (stage,)
        self.clock = ProgressClock(config)
        self.interval_s = min(PROGRESS_POLL_S, config.min_s / 4)
        self.steps = self._read()  # lines of earlier attempts are not progress
        self.read_at = time.monotonic()

    def _read(self) -> tuple[int, ...]:
        return tuple(latest_metric_step(self.store, stage) or 0 for stage in self.stages)

    def stop_if_cancelled(self) -> None:
        """Raise `StageCancelledError` once `cancel` is set; leaving the stage's `with` blocks
        stops what it started."""
        if self.cancel is not None and self.cancel.is_set():
            raise StageCancelledError(f"the {self.stage} stage was cancelled")

    def stall(self) -> Stall | None:
        """How long the stage has been silent, once that is longer than the watchdog allows
        (new metric lines, listed when due, are progress)."""
        if time.monotonic() - self.read_at >= self.interval_s:
            self.read_at = time.monotonic()
            steps = self._read()
            if steps != self.steps:
                self.steps = steps
                self.clock.beat()
        return self.clock.stall()
