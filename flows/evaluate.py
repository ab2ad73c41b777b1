"""The `evaluate` flow: one committed checkpoint (the latest by default) on the eval splits.

Deployments run it on a schedule and on every `primeflow.checkpoint.committed` event, whose
payload names the run, stage and step.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from engine.config import PrimeflowConfig
from engine.run import open_run
from engine.trainer.pool import Stage
from flows.pipeline import flow_run_name, metrics_sink, resolve
from storage.commit import latest_committed_step
from tasks.hooks import kill_pools_on_exit
from tasks.pools import inference_pool
from tasks.stages import CHECKPOINT_PARENTS, evaluate_checkpoint


@flow(
    name="evaluate",
    flow_run_name=flow_run_name,
    on_cancellation=[kill_pools_on_exit],
    on_crashed=[kill_pools_on_exit],
)
def evaluate(
    config: PrimeflowConfig,
    overrides: dict[str, Any] | None = None,
    run: str | None = None,
    stage: Stage = "rl",
    step: int | None = None,
) -> dict[str, Any]:
    """Evaluate checkpoint `step` (default: the latest) of `stage` of run `run`."""
    config = resolve(config, {**(overrides or {}), **({"run.name": run} if run else {})})
    store = open_run(config, command=["prefect", "evaluate"]).store
    if step is None:
        step = latest_committed_step(store, CHECKPOINT_PARENTS[stage])
    name = config.eval.name or (stage if step is not None else "base")
    with metrics_sink(config) as sink, inference_pool(config) as pool:
        return evaluate_checkpoint(config, pool, name=name, stage=stage, step=step, sink=sink)
