"""The stage tasks: each runs one stage to completion (or resumes it) and returns a summary.

A stage task is idempotent: the engine resumes from the last committed step, so Prefect's
retry of a task that failed half-way continues where it stopped instead of starting over.
Results are small dicts (steps, URIs, headline numbers); nothing large or secret goes into
Prefect.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engine.config import PrimeflowConfig
from engine.orchestrator.main import EvalOutcome, evaluate_policy, run_orchestrator
from engine.run import logs_dir, run_store
from engine.trainer.pool import TrainerPool
from engine.wandb_sink import WandbSink
from engine.watchdog import ProgressClock, capture_stacks
from storage.commit import latest_committed_step
from storage.evals import committed_summary
from storage.layout import RunLayout, Stage
from storage.paths import join
from tasks.pools import PoolOnDemand
from tasks.reporting import StageMonitor, publish_hang_report
from tasks.supervision import forget_group, record_group

#: How long a stopping RL stage waits for its orchestrator thread (a commit in progress ends).
ORCHESTRATOR_STOP_S = 60.0
#: How long a hung trainer gets to end on SIGTERM before its group is killed.
HUNG_STOP_S = 5.0


class StageFailedError(RuntimeError):
    """A stage's process exited with an error; the message names its log."""


class StageHungError(StageFailedError):
    """A stage made no progress for longer than the watchdog allows; the message names the
    processes that did not answer and the report holding every process's stacks."""


def _fail_if_hung(
    config: PrimeflowConfig, stage: Stage, monitor: StageMonitor, trainer: TrainerPool
) -> None:
    """Raise `StageHungError` once the stage has been silent too long, its stacks saved and
    its trainer stopped (a stopped rank ignores SIGTERM: only the group's SIGKILL ends it)."""
    assert monitor.clock is not None and trainer.log_path is not None
    stall = monitor.clock.stall()
    if stall is None:
        return
    report = trainer.log_path.parent / f"hang-{stage}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
    stuck = capture_stacks([trainer.pgid], trainer.stacks_dir, report)
    trainer.stop(grace_s=HUNG_STOP_S)
    publish_hang_report(config.run.name, stage, report)
    who = f"; not answering: {', '.join(stuck)}" if stuck else ""
    raise StageHungError(
        f"the {stage} stage hung: {stall.describe(config.watchdog)}{who}; the stacks of "
        f"every process are in {report}"
    )


def _trainer_failure(stage: str, code: int, pool: TrainerPool) -> StageFailedError:
    """One line: the exit status, the error the rank died of and where the log is."""
    cause = pool.last_error()
    because = f": {cause}" if cause else ""
    return StageFailedError(
        f"the {stage} trainer exited with status {code}{because}; see {pool.log_path}"
    )


def _start_trainer(config: PrimeflowConfig, stage: Stage) -> TrainerPool:
    log_dir = logs_dir(config)
    pool = TrainerPool(config, stage, log_path=log_dir / f"trainer-{stage}.log")
    pool.start()
    record_group(log_dir, f"trainer-{stage}", pool.pgid)
    get_run_logger().info("%s: trainer pool started (log: %s)", stage, pool.log_path)
    return pool


def _finish_trainer(config: PrimeflowConfig, stage: Stage, pool: TrainerPool) -> None:
    pool.stop()
    forget_group(logs_dir(config), f"trainer-{stage}")


def _outcome(
    config: PrimeflowConfig, stage: Stage, last_step: int, seconds: float
) -> dict[str, Any]:
    store = run_store(config)
    parent = RunLayout.stage_checkpoints(stage)
    step = latest_committed_step(store, parent)
    uri = store.url(join(parent, RunLayout.step_name(step))) if step is not None else None
    get_run_logger().info("%s: done at step %d; checkpoint %s", stage, last_step, uri)
    return {
        "stage": stage,
        "last_step": last_step,
        "checkpoint_step": step,
        "checkpoint": uri,
        "seconds": seconds,
    }


def _monitor(
    config: PrimeflowConfig, stage: Stage, total_steps: int, sink: WandbSink | None
) -> StageMonitor:
    return StageMonitor(
        run_store(config),
        config.run.name,
        stage,
        total_steps=total_steps,
        checkpoint_parent=RunLayout.stage_checkpoints(stage),
        also=("orchestrator",) if stage == "rl" else (),
        on_step=sink.log if sink is not None else None,
        clock=ProgressClock(config.watchdog),
    )


def _total_steps(config: PrimeflowConfig, stage: Stage) -> int:
    total = config.sft.max_steps if stage == "sft" else config.trainer.max_steps
    assert total is not None
    return total


def _finished(config: PrimeflowConfig, stage: Stage) -> dict[str, Any] | None:
    """The stage's outcome when its final checkpoint is committed (a re-run of a finished run,
    or a retry after a later stage failed): then no trainer, orchestrator or server starts."""
    total = _total_steps(config, stage)
    if latest_committed_step(run_store(config), RunLayout.stage_checkpoints(stage)) != total:
        return None
    get_run_logger().info("%s: all %d steps are committed already; nothing to train", stage, total)
    return _outcome(config, stage, total, 0.0)


@task(name="sft-warmup", retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def sft_warmup(config: PrimeflowConfig, sink: WandbSink | None = None) -> dict[str, Any]:
    """SFT on the trainer pool, in the foreground; resumes from its last committed step."""
    if (done := _finished(config, "sft")) is not None:
        return done
    started = time.perf_counter()
    with _monitor(config, "sft", config.sft.max_steps, sink) as monitor:
        pool = _start_trainer(config, "sft")
        try:
            while (code := pool.poll()) is None:
                time.sleep(1.0)
                _fail_if_hung(config, "sft", monitor, pool)
        finally:
            _finish_trainer(config, "sft", pool)
    if code != 0:
        raise _trainer_failure("SFT", code, pool)
    return _outcome(config, "sft", monitor.last_step, time.perf_counter() - started)


@task(name="rl-loop", retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def rl_loop(
    config: PrimeflowConfig, pools: PoolOnDemand, sink: WandbSink | None = None
) -> dict[str, Any]:
    """The trainer pool consumes shards in the background while the orchestrator makes them.

    The orchestrator runs on a thread so this task can notice a trainer that died: the
    orchestrator would otherwise wait forever for the checkpoint the async bound needs. Whatever
    ends the task, the orchestrator is stopped and joined first, so a retry of the task never
    runs beside the previous attempt's orchestrator (two writers of the same rollout steps).
    """
    if (done := _finished(config, "rl")) is not None:
        return done
    pool = pools.get()
    started = time.perf_counter()
    failure: list[BaseException] = []
    stop = threading.Event()

    def orchestrate() -> None:
        try:
            run_orchestrator(config, pool, stop)
        except BaseException as exc:
            failure.append(exc)

    with _monitor(config, "rl", _total_steps(config, "rl"), sink) as monitor:
        trainer = _start_trainer(config, "rl")
        orchestrator = threading.Thread(target=orchestrate, name="orchestrator", daemon=True)
        orchestrator.start()
        try:
            while orchestrator.is_alive() and trainer.poll() is None:
                orchestrator.join(timeout=1.0)
                _fail_if_hung(config, "rl", monitor, trainer)
            if failure:
                raise failure[0]
            code = trainer.wait()
        finally:
            _stop_orchestrator(orchestrator, stop)
            _finish_trainer(config, "rl", trainer)
    if code != 0:
        raise _trainer_failure("RL", code, trainer)
    return _outcome(config, "rl", monitor.last_step, time.perf_counter() - started)


def _stop_orchestrator(orchestrator: threading.Thread, stop: threading.Event) -> None:
    """Ask the orchestrator thread to end and wait for it (it polls every `poll_interval_s`)."""
    stop.set()
    orchestrator.join(timeout=ORCHESTRATOR_STOP_S)
    if orchestrator.is_alive():
        get_run_logger().warning(
            "rl: the orchestrator did not stop within %.0f s", ORCHESTRATOR_STOP_S
        )


@task(name="evaluate", retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def evaluate_checkpoint(
    config: PrimeflowConfig,
    pools: PoolOnDemand,
    *,
    name: str,
    stage: Stage = "rl",
    step: int | None = None,
    sink: WandbSink | None = None,
) -> dict[str, Any]:
    """Evaluate what `pools` serves (step None) or a committed checkpoint of `stage`; an
    evaluation committed already is read back without starting the pool."""
    eval_config = config.eval.model_copy(
        update={"name": name, "stage": stage, "checkpoint_step": step}
    )
    started = time.perf_counter()
    done = committed_summary(
        run_store(config), name, pools.policy_version if step is None else step
    )
    if done is not None:
        outcome = EvalOutcome(uri=done[0], summary=done[1])
    else:
        outcome = evaluate_policy(config.model_copy(update={"eval": eval_config}), pools.get())
    headline = {k: v for k, v in outcome.summary.items() if isinstance(v, int | float)}
    samples = sum(env.get("samples", 0) for env in outcome.summary.get("envs", {}).values())
    if sink is not None:
        sink.log({"stage": f"eval-{name}", "step": outcome.summary["step"], **headline})
    get_run_logger().info("eval %s: %s", name, headline)
    return {
        "name": name,
        "uri": outcome.uri,
        "samples": samples,
        "seconds": time.perf_counter() - started,
        **headline,
    }
