"""The stage tasks: each runs one stage of `engine.stages` to completion (or resumes it) and
returns its typed result (`engine.results`), with the stage's progress mirrored into the UI.

A stage task is idempotent: the engine resumes from the last committed step, so Prefect's
retry of a task that failed half-way continues where it stopped instead of starting over.
Results are small (steps, URIs, headline numbers); nothing large or secret goes into Prefect.
"""

from __future__ import annotations

from typing import Any

from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State, TaskRun

from engine.config import PrimeflowConfig
from engine.inference.on_demand import PoolOnDemand
from engine.orchestrator.filter_watch import FilteredOutError
from engine.orchestrator.online_eval import ONLINE_EVAL_STAGE
from engine.orchestrator.signal_watch import RewardCollapsedError
from engine.results import EvalResult, StageResult
from engine.run import Run
from engine.stage_trainer import StageCancelledError, StageHungError
from engine.stages import (
    EvalStep,
    finished,
    run_eval,
    run_rl,
    run_sft,
    total_steps,
)
from engine.wandb_sink import WandbSink
from storage.layout import RunLayout, Stage
from tasks.hooks import cancellation
from tasks.pools import tenant_slot
from tasks.reporting import StageMonitor, announce_checkpoints, publish_hang_report


def _monitor(
    config: PrimeflowConfig, run: Run, stage: Stage, sink: WandbSink | None
) -> StageMonitor:
    return StageMonitor(
        run.store,
        config.run.name,
        stage,
        total_steps=total_steps(config, stage),
        checkpoint_parent=RunLayout.stage_checkpoints(stage),
        also=("orchestrator", ONLINE_EVAL_STAGE) if stage == "rl" else (),
        on_step=sink.log if sink is not None else None,
    )


def _already_done(config: PrimeflowConfig, run: Run, stage: Stage) -> StageResult | None:
    """The stage's result when every step is committed; its checkpoints that nobody announced
    (a trainer that finished after its flow process was killed) are announced now."""
    done = finished(config, run, stage)
    if done is not None:
        get_run_logger().info(
            "%s: all %d steps are committed already; nothing to train", stage, done.last_step
        )
        parent = RunLayout.stage_checkpoints(stage)
        try:  # reporting never fails the stage it reports on
            announce_checkpoints(run.store, config.run.name, stage, parent)
        except Exception as exc:
            get_run_logger().warning("%s: announcing its checkpoints failed: %s", stage, exc)
    return done


def _reported(config: PrimeflowConfig, stage: Stage, error: StageHungError) -> StageHungError:
    publish_hang_report(config.run.name, stage, error.report)
    return error


def _worth_retrying(task: Task[..., Any], task_run: TaskRun, state: State) -> bool:
    """Retry a stage that failed, not one that was stopped because its flow run was cancelled,
    nor one whose policy collapsed or whose every group the filters drop: its retry would
    resume the same policy and stop the same way."""
    return not isinstance(state.data, StageCancelledError | RewardCollapsedError | FilteredOutError)


@task(
    name="sft-warmup",
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=_worth_retrying,
    cache_policy=NO_CACHE,
)
def sft_warmup(config: PrimeflowConfig, run: Run, sink: WandbSink | None = None) -> StageResult:
    """SFT on the trainer pool, in the foreground; resumes from its last committed step;
    stops when the flow run is cancelled."""
    if (done := _already_done(config, run, "sft")) is not None:
        return done
    with _monitor(config, run, "sft", sink), cancellation() as cancel:
        try:
            return run_sft(config, run, get_run_logger(), cancel)
        except StageHungError as exc:
            raise _reported(config, "sft", exc) from None


@task(
    name="rl-loop",
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=_worth_retrying,
    cache_policy=NO_CACHE,
)
def rl_loop(
    config: PrimeflowConfig, run: Run, pools: PoolOnDemand, sink: WandbSink | None = None
) -> StageResult:
    """The RL stage (`engine.stages.run_rl`: trainer pool, orchestrator thread, their watch)
    on the flow's inference pool; whatever ends it, its orchestrator is joined first, so a
    retry never runs beside the previous attempt's. When the flow run is cancelled the stage
    stops, and a tenant gives its slot back at once."""
    if (done := _already_done(config, run, "rl")) is not None:
        return done
    with tenant_slot(config):
        pool = pools.get()
        with _monitor(config, run, "rl", sink), cancellation() as cancel:
            try:
                return run_rl(config, run, pool, get_run_logger(), cancel)
            except StageHungError as exc:
                raise _reported(config, "rl", exc) from None


@task(name="evaluate", retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def evaluate_checkpoint(
    config: PrimeflowConfig,
    run: Run,
    pools: PoolOnDemand,
    *,
    name: str,
    stage: Stage = "rl",
    step: EvalStep = None,
    sink: WandbSink | None = None,
) -> EvalResult:
    """`engine.stages.run_eval`: what `pools` serves (step None), the newest committed
    checkpoint of `stage` ("latest") or a given one; one committed already is read back
    without starting the pool."""
    result = run_eval(
        config, run, pools, name=name, stage=stage, step=step, logger=get_run_logger()
    )
    if sink is not None:
        sink.log({"stage": f"eval-{name}", "step": result.step, **result.metrics})
    return result
