"""The flows: `post-train` (SFT → RL → eval, the main job), `sft` and `rl`.

Thin on purpose: a flow opens the run, calls the stage tasks in order and reports. The
inference pool starts when a stage first has something to generate and stays up across the
rest; stages committed already return their results, so re-running a finished run starts no
server and no trainer. Every flow takes the whole `PrimeflowConfig` (so the Prefect
UI draws it as a form and the server validates it) plus optional dotted `overrides`, which is
what `prefect deployment run ... --param overrides='{"max_steps": 5}'` changes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from engine.config import PrimeflowConfig
from engine.inference.fleet import serving_device
from engine.inference.on_demand import PoolOnDemand
from engine.preflight import STAGES, preflight
from engine.report import write_run_report
from engine.results import PipelineResult, RunReport, StageResult
from engine.run import Run, open_run, rl_start
from engine.wandb_sink import WandbSink, wandb_sink
from storage.metrics import compact_metrics
from tasks.hooks import ON_CANCELLATION, config_of_run, kill_pools_on_exit
from tasks.pools import inference_pool
from tasks.reporting import publish_summary
from tasks.stages import evaluate_checkpoint, rl_loop, sft_warmup

#: The stages each flow runs (what preflight checks for it).
FLOW_STAGES = {"post-train": STAGES, "sft": ("sft",), "rl": ("rl",), "evaluate": ("eval",)}


def resolve(config: PrimeflowConfig, overrides: dict[str, Any] | None) -> PrimeflowConfig:
    """Apply overrides; a run without a name takes its flow run's, so a retry resumes it.

    What this machine lacks (a model folder, an environment package, a data file) fails the
    flow here, in one line, before any task starts a pool.
    """
    config = config_of_run(
        flow_run.flow_name, flow_run.name, {"config": config, "overrides": overrides}
    )
    problems = preflight(config, FLOW_STAGES.get(flow_run.flow_name, STAGES))
    if problems:
        raise ValueError("; ".join(problems))
    return config


def flow_run_name() -> str:
    """The run name the user gave (through `overrides`, as the docs show, or in the config),
    else Prefect's generated name."""
    overrides = flow_run.parameters.get("overrides")
    if isinstance(overrides, dict) and overrides.get("run.name"):
        return str(overrides["run.name"])
    config = flow_run.parameters.get("config")
    if isinstance(config, dict):
        name = (config.get("run") or {}).get("name")
    elif isinstance(config, PrimeflowConfig) and "name" in config.run.model_fields_set:
        name = config.run.name
    else:
        name = None
    return name or flow_run.name


def metrics_sink(config: PrimeflowConfig, run: Run) -> AbstractContextManager[WandbSink | None]:
    """W&B for this run when `wandb.project` is set (one resumable W&B run per primeflow run)."""
    return wandb_sink(config.wandb, config.run.name, config.model_dump(mode="json"), run.local)


def serve_rl_start(config: PrimeflowConfig, run: Run, pool: PoolOnDemand) -> None:
    """The pool serves what RL's trainer starts from (`engine.run.rl_start`) as policy version
    0, when that is a checkpoint rather than the model the pool started with."""
    if (start := rl_start(config, run.store)) is not None:
        pool.reload(start, version=0)


@flow(
    name="post-train",
    flow_run_name=flow_run_name,
    on_cancellation=ON_CANCELLATION,
    on_crashed=[kill_pools_on_exit],
)
def post_train(config: PrimeflowConfig, overrides: dict[str, Any] | None = None) -> PipelineResult:
    """SFT warm-up → async RL → evaluation of base, SFT and RL policies on one held-out split.

    On CPU servers the pool starts and evaluates the base model while SFT trains (~20 s of
    the demo on 2 cores); on a GPU they take turns, since vLLM sizes its cache by the memory
    free when it starts."""
    config = resolve(config, overrides)
    run = open_run(config, command=["prefect", "post-train"])
    get_run_logger().info("run %s at %s", config.run.name, run.store.url())
    sft_result = eval_sft = None
    with metrics_sink(config, run) as sink, inference_pool(config, run) as pool:
        base = evaluate_checkpoint.submit(config, run, pool, name="base", sink=sink)
        if serving_device(config.inference) != "cpu":
            base.result()  # vLLM sizes its cache by the GPU memory free at its start: SFT waits
        try:
            sft_result = sft_warmup(config, run, sink) if config.sft.enabled else None
        finally:
            base.wait()  # no evaluation outlives the pool, whatever ended SFT
        eval_base = base.result()
        serve_rl_start(config, run, pool)  # the SFT result when SFT ran
        if sft_result is not None:
            eval_sft = evaluate_checkpoint(config, run, pool, name="sft", sink=sink)
        rl_result = rl_loop(config, run, pool, sink)
        eval_rl = evaluate_checkpoint(
            config, run, pool, name="rl", step=rl_result.checkpoint_step, sink=sink
        )
    compact_metrics(run.store)
    report = write_run_report(run.store, title=f"primeflow run {config.run.name}")
    results = PipelineResult(
        run=config.run.name,
        root=run.store.url(),
        eval_base=eval_base,
        sft=sft_result,
        eval_sft=eval_sft,
        rl=rl_result,
        eval_rl=eval_rl,
        report=RunReport.from_report(report),
    )
    publish_summary(config, run, results)
    return results


@flow(
    name="sft",
    flow_run_name=flow_run_name,
    on_cancellation=ON_CANCELLATION,
    on_crashed=[kill_pools_on_exit],
)
def sft(config: PrimeflowConfig, overrides: dict[str, Any] | None = None) -> StageResult:
    """The SFT warm-up stage alone (no inference pool needed)."""
    config = resolve(config, overrides)
    run = open_run(config, command=["prefect", "sft"])
    with metrics_sink(config, run) as sink:
        result = sft_warmup(config, run, sink)
    compact_metrics(run.store)
    return result


@flow(
    name="rl",
    flow_run_name=flow_run_name,
    on_cancellation=ON_CANCELLATION,
    on_crashed=[kill_pools_on_exit],
)
def rl(config: PrimeflowConfig, overrides: dict[str, Any] | None = None) -> StageResult:
    """The async RL stage alone, from where `engine.run.rl_start` says: the run's SFT result,
    `trainer.init_checkpoint` or the model itself."""
    config = resolve(config, overrides)
    run = open_run(config, command=["prefect", "rl"])
    with metrics_sink(config, run) as sink, inference_pool(config, run) as pool:
        serve_rl_start(config, run, pool)
        result = rl_loop(config, run, pool, sink)
    compact_metrics(run.store)
    return result
