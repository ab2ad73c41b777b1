"""Pool lifecycle tasks: the inference pool starts once per flow run and stops on every exit.

Pool objects hold live processes, so these tasks keep their results in memory (never persisted,
never cached); what Prefect records is the endpoint count and the policy version.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engine.config import PrimeflowConfig
from engine.inference.pool import InferencePool
from engine.run import local_run_dir
from storage.layout import RunLayout
from tasks.supervision import forget_group, record_group


def log_dir(config: PrimeflowConfig):
    return local_run_dir(config) / RunLayout.LOGS


@task(name="start-inference-pool", cache_policy=NO_CACHE, persist_result=False)
def start_inference_pool(config: PrimeflowConfig) -> InferencePool:
    """Start every vLLM server of the pool and record their process groups."""
    directory = log_dir(config)
    pool = InferencePool.for_run(config, directory)
    pool.start()
    for name, pgid in pool.process_groups.items():
        record_group(directory, name, pgid)
    get_run_logger().info("inference pool up: %s", ", ".join(e.base_url for e in pool.endpoints))
    return pool


@task(name="stop-inference-pool", cache_policy=NO_CACHE, persist_result=False)
def stop_inference_pool(config: PrimeflowConfig, pool: InferencePool) -> None:
    groups = pool.process_groups
    pool.stop()
    for name in groups:
        forget_group(log_dir(config), name)


@contextmanager
def inference_pool(config: PrimeflowConfig) -> Iterator[InferencePool]:
    """The pool for the length of a `with` block; stopped however the block ends."""
    pool = start_inference_pool(config)
    try:
        yield pool
    finally:
        stop_inference_pool(config, pool)
