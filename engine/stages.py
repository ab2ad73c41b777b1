"""The training stages as plain functions: what the Prefect tasks wrap, and what runs without
Prefect (a notebook, a script, a Slurm job) just the same.

`run_sft` and `run_rl` start the stage's trainer pool (and, for RL, the orchestrator on a
thread of this process), supervise it until it ends, and return a `StageResult`. Supervising
means: a trainer that dies fails the stage with one line naming its error and log; an
orchestrator that fails fails it too, and is always stopped and joined before the function
returns, so a retry never runs beside it; a stage that commits no new step for longer than the
watchdog allows fails as hung (`engine.watchdog`), its stacks saved. A stage whose final
checkpoint is committed already starts nothing (`finished`). `run_eval` evaluates a policy and
is the one place that decides which checkpoint an evaluation takes (`eval_step`).

The loop drives its trainer side through `engine.stage_trainer.StageTrainer`: a trainer pool
of the stage's own (`_Trainer`) or, for a tenant of shared pools, `TenantStage`.

Every function takes the `Run` the caller opened (`engine.run.open_run`: its root store and
logs folder) rather than rebuilding it from the config.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Literal

from engine.config import PrimeflowConfig
from engine.inference.on_demand import PoolOnDemand
from engine.inference.serving import PolicyServing
from engine.orchestrator.main import evaluate_policy, run_orchestrator
from engine.process_groups import forget_group, record_group
from engine.results import EvalResult, StageResult
from engine.run import Run
from engine.stage_trainer import (
    POLL_S,
    Logger,
    StageFailedError,
    StageHungError,
    StageTrainer,
    StageWatch,
    wait_for,
)
from engine.tenancy.stage import TenantStage
from engine.trainer.pool import TrainerPool
from engine.watchdog import capture_stacks
from storage.checkpoints import require_committed
from storage.commit import latest_committed_step
from storage.evals import committed_summary
from storage.layout import RunLayout, Stage
from storage.metrics import latest_metric_step
from storage.paths import join
from storage.policies import forget_after
from storage.store import ObjectStore

log = logging.getLogger("primeflow.stages")
#: How long a stopping RL stage waits for its orchestrator thread (a commit in progress ends).
ORCHESTRATOR_STOP_S = 60.0
#: How long a hung trainer gets to end on SIGTERM before its group is killed.
HUNG_STOP_S = 5.0


def total_steps(config: PrimeflowConfig, stage: Stage) -> int:
    return config.sft.max_steps if stage == "sft" else config.trainer.max_steps


def outcome(store: ObjectStore, stage: Stage, last_step: int, seconds: float) -> StageResult:
    parent = RunLayout.stage_checkpoints(stage)
    step = latest_committed_step(store, parent)
    uri = store.url(join(parent, RunLayout.step_name(step))) if step is not None else None
    return StageResult(stage, last_step, step, uri, seconds)


def finished(config: PrimeflowConfig, run: Run, stage: Stage) -> StageResult | None:
    """The stage's result when its final checkpoint is committed (a re-run of a finished run,
    or a retry after a later stage failed): then no trainer, orchestrator or server starts."""
    total = total_steps(config, stage)
    if latest_committed_step(run.store, RunLayout.stage_checkpoints(stage)) != total:
        return None
    return outcome(run.store, stage, total, 0.0)


class _Trainer:
    """The stage's trainer pool: started, its process group recorded, and stopped however the
    stage ends; `check` fails the stage if it hung, and stops it once `cancel` is set. It is
    a `StageTrainer`, as a tenant's side of shared pools is (`TenantStage`)."""

    def __init__(
        self,
        config: PrimeflowConfig,
        run: Run,
        stage: Stage,
        logger: Logger,
        cancel: threading.Event | None = None,
    ) -> None:
        self.config, self.stage, self.logger = config, stage, logger
        self.logs = run.logs
        self.watch = StageWatch(run.store, stage, config.watchdog, cancel)
        self.pool = TrainerPool(config, stage, log_path=self.logs / f"trainer-{stage}.log")

    def __enter__(self) -> _Trainer:
        self.pool.start()
        record_group(self.logs, f"trainer-{self.stage}", self.pool.pgid)
        self.logger.info("%s: trainer pool started (log: %s)", self.stage, self.pool.log_path)
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.stop()
        forget_group(self.logs, f"trainer-{self.stage}")

    def poll(self) -> int | None:
        """The trainer's exit status, None while it trains."""
        return self.pool.poll()

    def check(self) -> None:
        """Raise `StageHungError` once the stage has been silent too long, its stacks saved
        and the trainer stopped (a stopped rank ignores SIGTERM: only SIGKILL ends it)."""
        self.watch.stop_if_cancelled()
        stall = self.watch.stall()
        if stall is None:
            return
        report = self.logs / f"hang-{self.stage}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        stuck = capture_stacks([self.pool.pgid], self.pool.stacks_dir, report)
        self.pool.stop(grace_s=HUNG_STOP_S)
        who = f"; not answering: {', '.join(stuck)}" if stuck else ""
        raise StageHungError(
            f"the {self.stage} stage hung: {stall.describe(self.config.watchdog)}{who}; the "
            f"stacks of every process are in {report}",
            report,
        )

    def failure(self, code: int) -> StageFailedError:
        """One line: the exit status, the error the rank died of and where the log is."""
        cause = self.pool.last_error()
        because = f": {cause}" if cause else ""
        return StageFailedError(
            f"the {self.stage.upper()} trainer exited with status {code}{because}; see "
            f"{self.pool.log_path}"
        )


def run_sft(
    config: PrimeflowConfig,
    run: Run,
    logger: Logger = log,
    cancel: threading.Event | None = None,
) -> StageResult:
    """SFT on the trainer pool, in the foreground; resumes from its last committed step.
    Setting `cancel` stops it (`StageCancelledError`)."""
    started = time.perf_counter()
    with _Trainer(config, run, "sft", logger, cancel) as trainer:
        code = wait_for(trainer)
    if code != 0:
        raise trainer.failure(code)
    return _done(run, "sft", started, logger)


def run_rl(
    config: PrimeflowConfig,
    run: Run,
    pool: PolicyServing,
    logger: Logger = log,
    cancel: threading.Event | None = None,
) -> StageResult:
    """The trainer pool consumes shards in the background while the orchestrator makes them.

    The orchestrator runs on a thread so that a trainer that died is noticed: the
    orchestrator would otherwise wait forever for the policy the async bound needs. A tenant
    of shared pools (`pools.name`) trains on the shared trainer instead of a pool of its own
    (`TenantStage`), and `pool` is its view of the shared inference pool. Setting `cancel`
    stops the stage within a poll (`StageCancelledError`): the orchestrator and the trainer
    pool are stopped, or the tenant withdraws from the shared trainer.

    Policy versions past the newest resume checkpoint are deleted before either starts: a
    dead trainer published them, the resumed one trains those steps again, and an
    orchestrator that loaded one (or failed on one it cannot rebuild) in the half minute a
    trainer takes to start would serve another lineage, or fail the retry the same way.
    """
    started = time.perf_counter()
    resumes_at = latest_committed_step(run.store, RunLayout.CHECKPOINTS) or 0
    if cleared := forget_after(run.store, resumes_at):
        logger.info(
            "rl: deleted policy versions %s, published past checkpoint %d by a trainer that "
            "did not checkpoint them",
            cleared,
            resumes_at,
        )
    failure: list[BaseException] = []
    stop = threading.Event()

    def orchestrate() -> None:
        try:
            run_orchestrator(config, pool, stop, store=run.store)
        except BaseException as exc:
            failure.append(exc)

    side: StageTrainer = (
        _Trainer(config, run, "rl", logger, cancel)
        if config.pools.name is None
        else TenantStage(config, run, logger, pool, cancel)
    )
    with side as trainer:
        orchestrator = threading.Thread(target=orchestrate, name="orchestrator", daemon=True)
        orchestrator.start()
        try:
            while orchestrator.is_alive() and trainer.poll() is None:
                orchestrator.join(timeout=POLL_S)
                trainer.check()
            if failure:
                raise failure[0]
            code = wait_for(trainer)
        finally:
            _stop_orchestrator(orchestrator, stop, logger)
    if code != 0:
        raise trainer.failure(code)
    return _done(run, "rl", started, logger)


def _stop_orchestrator(
    orchestrator: threading.Thread, stop: threading.Event, logger: Logger
) -> None:
    """Ask the orchestrator thread to end and wait for it (it polls every `poll_interval_s`)."""
    stop.set()
    orchestrator.join(timeout=ORCHESTRATOR_STOP_S)
    if orchestrator.is_alive():
        logger.warning("rl: the orchestrator did not stop within %.0f s", ORCHESTRATOR_STOP_S)


def _done(run: Run, stage: Stage, started: float, logger: Logger) -> StageResult:
    last = latest_metric_step(run.store, stage) or 0
    result = outcome(run.store, stage, last, time.perf_counter() - started)
    logger.info("%s: done at step %d; checkpoint %s", stage, last, result.checkpoint)
    return result


#: Which policy an evaluation takes: a committed checkpoint step of its stage (0: the model
#: itself), the newest committed one, or None: whatever the pool serves now.
EvalStep = int | Literal["latest"] | None


def eval_step(store: ObjectStore, stage: Stage, step: EvalStep, *, served: int) -> int:
    """The checkpoint step of `stage` an evaluation takes, `served` being the policy version
    the pool serves (or will). A named step must be committed (a step that retention deleted
    says so); `"latest"` is the newest committed checkpoint, or the model itself (0) when the
    stage has none yet."""
    parent = RunLayout.stage_checkpoints(stage)
    if step is None:
        return served
    if step == "latest":
        return latest_committed_step(store, parent) or 0
    if step > 0:
        require_committed(store, step, parent)
    return step


def run_eval(
    config: PrimeflowConfig,
    run: Run,
    pools: PoolOnDemand,
    *,
    name: str,
    stage: Stage = "rl",
    step: EvalStep = None,
    logger: Logger = log,
) -> EvalResult:
    """Evaluate a policy of `stage` (`eval_step` says which) on the config's eval split; an
    evaluation committed already is read back, and only then does the pool stay unstarted."""
    started = time.perf_counter()
    version = eval_step(run.store, stage, step, served=pools.policy_version)
    done = committed_summary(run.store, name, version)
    if done is not None:
        logger.info("eval %s step %d is committed already: %s", name, version, done[0])
        uri, summary = done
    else:
        evaluated = evaluate_policy(
            config, run.store, pools.get(), name=name, stage=stage, step=version
        )
        uri, summary = evaluated.uri, evaluated.summary
    result = EvalResult.from_summary(name, uri, summary, time.perf_counter() - started)
    logger.info("eval %s: %s", name, result.metrics)
    return result
