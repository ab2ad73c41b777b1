"""The `evaluate` flow: one committed checkpoint (the latest by default) on the eval splits.

Deployments run it on a schedule and on every `primeflow.checkpoint.committed` event, whose
payload names the run, its root, the stage and the step. Given the root, the flow evaluates the
run as the run recorded itself (its manifest's config: its store, model and environments, not
the deployment's) and writes the results under their own eval name, `<stage>-step-<N>`, beside
the run's own evaluations rather than over them.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from engine.config import PrimeflowConfig
from engine.config.run import StorageConfig
from engine.results import EvalResult
from engine.run import open_run, run_of, run_store, store_at
from engine.stages import eval_step
from flows.pipeline import flow_run_name, metrics_sink, resolve
from flows.reproduce import recorded_config
from storage.errors import ObjectNotFoundError
from storage.layout import RunLayout, Stage
from storage.manifest import read_manifest
from tasks.hooks import ON_CANCELLATION, kill_pools_on_exit
from tasks.pools import inference_pool
from tasks.stages import evaluate_checkpoint


def run_config_at(root: str, storage: StorageConfig) -> PrimeflowConfig:
    """The config the run at `root` recorded (read with `storage`'s endpoint and region)."""
    store = store_at(root, storage.model_copy(update={"uri": root}))
    try:
        manifest = read_manifest(store)
    except ObjectNotFoundError:
        raise ValueError(f"no run at {root}: {store.url(RunLayout.MANIFEST)} is missing") from None
    config = recorded_config(manifest)
    if run_store(config).url() != store.url():
        raise ValueError(f"the manifest at {root} is run {config.run.name!r} of another root")
    return config


def default_eval_name(stage: Stage, step: int, *, triggered: bool) -> str:
    """`base` for the model itself (step 0); a triggered evaluation's own `<stage>-step-<N>`;
    else the stage (what the pipeline's own evaluation writes)."""
    if step == 0:
        return "base"
    return f"{stage}-step-{step}" if triggered else stage


@flow(
    name="evaluate",
    flow_run_name=flow_run_name,
    on_cancellation=ON_CANCELLATION,
    on_crashed=[kill_pools_on_exit],
)
def evaluate(
    config: PrimeflowConfig,
    overrides: dict[str, Any] | None = None,
    run: str | None = None,
    stage: Stage | None = None,
    step: int | None = None,
    root: str | None = None,
) -> EvalResult:
    """Evaluate checkpoint `step` of `stage` (default: `eval.checkpoint_step`, else the newest
    committed; `eval.stage`) of run `run`, or of the run at `root` (a checkpoint event's)."""
    if root is None:
        config = resolve(config, {**(overrides or {}), **({"run.name": run} if run else {})})
        opened = open_run(config, command=["prefect", "evaluate"])
    else:
        config = resolve(run_config_at(root, config.storage), overrides or {})
        opened = run_of(config)
    stage = stage or config.eval.stage
    wanted = step if step is not None else config.eval.checkpoint_step
    # Named before the pool starts (a triggered evaluation's name holds its step), by the same
    # rule the evaluation then follows.
    step = eval_step(opened.store, stage, "latest" if wanted is None else wanted, served=0)
    name = config.eval.name or default_eval_name(stage, step, triggered=root is not None)
    with metrics_sink(config, opened) as sink, inference_pool(config, opened) as pool:
        return evaluate_checkpoint(
            config, opened, pool, name=name, stage=stage, step=step, sink=sink
        )
