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
from engine.process_groups import forget_group, record_group
from engine.run import logs_dir


@task(name="start-inference-pool", cache_policy=NO_CACHE, persist_result=False)
def start_inference_pool(config: PrimeflowConfig) -> InferencePool:
    """Start every vLLM server of the pool and record their process groups."""
    directory = logs_dir(config)
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
        forget_group(logs_dir(config), name)


class PoolOnDemand:
    """A flow's inference pool, started by the first stage that has something to generate.

    A stage whose result is committed already (a resumed or re-run flow) never asks for it, so
    re-running a finished run starts no server. A reload asked for before the start is kept and
    applied once the servers are up; `policy_version` is what they serve, or will.
    """

    def __init__(self, config: PrimeflowConfig, pool: InferencePool | None = None) -> None:
        self.config = config
        self._pool = pool
        self._pending: tuple[str, int] | None = None

    @property
    def started(self) -> InferencePool | None:
        """The pool if it has started, else None."""
        return self._pool

    @property
    def policy_version(self) -> int:
        if self._pending is not None:
            return self._pending[1]
        return self._pool.policy_version if self._pool is not None else 0

    def reload(self, checkpoint: str, version: int) -> None:
        if self._pool is None:
            self._pending = (checkpoint, version)
        else:
            self._pool.reload(checkpoint, version=version)

    def get(self) -> InferencePool:
        """The running pool, started (and brought to the pending version) on first use."""
        if self._pool is None:
            self._pool = start_inference_pool(self.config)
        if self._pending is not None:
            checkpoint, version = self._pending
            self._pool.reload(checkpoint, version=version)
            self._pending = None
        return self._pool


@contextmanager
def inference_pool(config: PrimeflowConfig) -> Iterator[PoolOnDemand]:
    """The pool for the length of a `with` block, started on demand; stopped however the block
    ends, if it started."""
    pools = PoolOnDemand(config)
    try:
        yield pools
    finally:
        if (pool := pools.started) is not None:
            stop_inference_pool(config, pool)
