"""Pool lifecycle tasks: the inference pool starts once per flow run, when a stage first needs
it (`engine.inference.on_demand`), and stops on every exit. A tenant of shared pools
(`pools.name`) attaches to their inference pool instead, and detaches (unloading its own
adapters) on every exit; its RL stage waits for a slot in the pools' Prefect concurrency limit.

Pool objects hold live processes, so these tasks keep their results in memory (never persisted,
never cached); what Prefect records is the endpoint count and the policy version.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency

from engine.config import PrimeflowConfig
from engine.inference.on_demand import PoolOnDemand
from engine.inference.pool import InferencePool
from engine.process_groups import forget_group, record_group
from engine.run import Run
from engine.tenancy.attached import AttachedPool
from engine.tenancy.files import PoolRecord
from engine.tenancy.supervisor import SharedPools

#: Seconds a tenant slot's lease lasts unrenewed (Prefect's shortest).
LEASE_S = 60.0


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


@task(name="attach-inference-pool", cache_policy=NO_CACHE, persist_result=False)
def attach_inference_pool(config: PrimeflowConfig) -> AttachedPool:
    """This tenant's view of the shared inference pool `pools.name` (its own adapter names)."""
    assert config.pools.name is not None
    record = PoolRecord.read(config.pools.name)
    get_run_logger().info(
        "attached to the shared inference pool %r: %s", record.name, ", ".join(record.servers)
    )
    return AttachedPool.from_record(record, config)


@contextmanager
def inference_pool(config: PrimeflowConfig, run: Run) -> Iterator[PoolOnDemand]:
    """The run's pool for the length of a `with` block, started (or attached to) on demand;
    stopped (or detached from) however the block ends, if it started."""
    if config.pools.name is not None:
        pools = PoolOnDemand(lambda: attach_inference_pool(config))
    else:
        pools = PoolOnDemand(
            lambda: start_inference_pool(config, run.logs),
            stop=lambda dead: stop_inference_pool(dead, run.logs),
        )
    try:
        yield pools
    finally:
        pool = pools.started
        if isinstance(pool, AttachedPool):
            pool.close()
        elif pool is not None:
            stop_inference_pool(pool, run.logs)


def limit_name(pools: str) -> str:
    """The Prefect global concurrency limit that admits the tenants of shared pools `pools`."""
    return f"primeflow-pool-{pools}"


@contextmanager
def tenant_slot(config: PrimeflowConfig) -> Iterator[None]:
    """Hold one slot of the shared pools' concurrency limit (waiting, visibly, while all are
    taken); nothing for a run with pools of its own. The slot's lease lapses a minute after
    a killed run stops renewing it."""
    if config.pools.name is None:
        yield
        return
    name = limit_name(config.pools.name)
    get_run_logger().info("rl: waiting for a tenant slot of %s", name)
    with concurrency(name, occupy=1, strict=True, lease_duration=LEASE_S):
        yield


@task(name="start-shared-pools", cache_policy=NO_CACHE, persist_result=False)
def start_shared_pools(config: PrimeflowConfig) -> SharedPools:
    """Start the shared pools and open their Prefect concurrency limit to `pools.tenants`."""
    assert config.pools.name is not None
    pools = SharedPools(config, get_run_logger())
    pools.start()
    name = limit_name(config.pools.name)
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, config.pools.tenants)
    get_run_logger().info(
        "shared pools %r up: %d tenant slots (concurrency limit %s), servers %s, logs in %s",
        config.pools.name,
        config.pools.tenants,
        name,
        ", ".join(e.base_url for e in pools.inference.endpoints),
        pools.logs,
    )
    return pools


@task(name="stop-shared-pools", cache_policy=NO_CACHE, persist_result=False)
def stop_shared_pools(pools: SharedPools) -> None:
    pools.stop()
