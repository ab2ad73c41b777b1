"""Pool lifecycle tasks: the inference pool starts once per flow run, when a stage first needs
it (`engine.inference.on_demand`), and stops on every exit.

Pool objects hold live processes, so these tasks keep their results in memory (never persisted,
never cached); what Prefect records is the endpoint count and the policy version.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engine.config import PrimeflowConfig
from engine.inference.on_demand import PoolOnDemand
from engine.inference.pool import InferencePool
from engine.process_groups import forget_group, record_group
from engine.run import Run


@task(name="start-inference-pool", cache_policy=NO_CACHE, persist_result=False)
def start_inference_pool(config: PrimeflowConfig, logs: Path) -> InferencePool:
    """Start every vLLM server of the pool (logs and process groups recorded in `logs`)."""
    pool = InferencePool.for_run(config, logs)
    pool.start()
    for name, pgid in pool.process_groups.items():
        record_group(logs, name, pgid)
    get_run_logger().info("inference pool up: %s", ", ".join(e.base_url for e in pool.endpoints))
    return pool


@task(name="stop-inference-pool", cache_policy=NO_CACHE, persist_result=False)
def stop_inference_pool(pool: InferencePool, logs: Path) -> None:
    groups = pool.process_groups
    pool.stop()
    for name in groups:
        forget_group(logs, name)


@contextmanager
def inference_pool(config: PrimeflowConfig, run: Run) -> Iterator[PoolOnDemand]:
    """The run's pool for the length of a `with` block, started on demand; stopped however the
    block ends, if it started."""
    pools = PoolOnDemand(lambda: start_inference_pool(config, run.logs))
    try:
        yield pools
    finally:
        if (pool := pools.started) is not None:
            stop_inference_pool(pool, run.logs)
