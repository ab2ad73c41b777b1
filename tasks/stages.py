"""The stage tasks: each runs one stage of `engine.stages` to completion (or resumes it) and
returns its outcome as a small dict, with the stage's progress mirrored into the UI.

A stage task is idempotent: the engine resumes from the last committed step, so Prefect's
retry of a task that failed half-way continues where it stopped instead of starting over.
Results are small dicts (steps, URIs, headline numbers); nothing large or secret goes into
Prefect.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engine.config import PrimeflowConfig
from engine.orchestrator.main import EvalOutcome, evaluate_policy
from engine.run import run_store
from engine.stages import (
    StageHungError,
    StageOutcome,
    finished,
    run_rl,
    run_sft,
    total_steps,
)
from engine.wandb_sink import WandbSink
from storage.evals import committed_summary
from storage.layout import RunLayout, Stage
from tasks.pools import PoolOnDemand
from tasks.reporting import StageMonitor, publish_hang_report


def _monitor(config: PrimeflowConfig, stage: Stage, sink: WandbSink | None) -> StageMonitor:
    return StageMonitor(
        run_store(config),
        config.run.name,
        stage,
        total_steps=total_steps(config, stage),
        checkpoint_parent=RunLayout.stage_checkpoints(stage),
        also=("orchestrator",) if stage == "rl" else (),
        on_step=sink.log if sink is not None else None,
    )


def _already_done(config: PrimeflowConfig, stage: Stage) -> StageOutcome | None:
    done = finished(config, stage)
    if done is not None:
        get_run_logger().info(
            "%s: all %d steps are committed already; nothing to train", stage, done.last_step
        )
    return done


def _reported(config: PrimeflowConfig, stage: Stage, error: StageHungError) -> StageHungError:
    publish_hang_report(config.run.name, stage, error.report)
    return error


@task(name="sft-warmup", retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def sft_warmup(config: PrimeflowConfig, sink: WandbSink | None = None) -> dict[str, Any]:
    """SFT on the trainer pool, in the foreground; resumes from its last committed step."""
    if (done := _already_done(config, "sft")) is not None:
        return done.as_dict()
    with _monitor(config, "sft", sink):
        try:
            return run_sft(config, get_run_logger()).as_dict()
        except StageHungError as exc:
            raise _reported(config, "sft", exc) from None


@task(name="rl-loop", retries=1, retry_delay_seconds=5, cache_policy=NO_CACHE)
def rl_loop(
    config: PrimeflowConfig, pools: PoolOnDemand, sink: WandbSink | None = None
) -> dict[str, Any]:
    """The RL stage (`engine.stages.run_rl`: trainer pool, orchestrator thread, their watch)
    on the flow's inference pool; whatever ends it, its orchestrator is joined first, so a
    retry never runs beside the previous attempt's."""
    if (done := _already_done(config, "rl")) is not None:
        return done.as_dict()
    pool = pools.get()
    with _monitor(config, "rl", sink):
        try:
            return run_rl(config, pool, get_run_logger()).as_dict()
        except StageHungError as exc:
            raise _reported(config, "rl", exc) from None


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
