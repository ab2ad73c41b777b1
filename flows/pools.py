"""The `pools` flow: shared pools that outlive any one run and train several LoRA runs
(tenants) at once (docs/tenants.md).

`primeflow pools up` runs it in the foreground: it starts the shared inference and trainer
pools, opens the Prefect concurrency limit `primeflow-pool-<name>` to `pools.tenants` slots,
and supervises them until it is stopped (Ctrl-C, SIGTERM, `primeflow pools down`, or a
cancel in the UI for a deployed run), stopping both pools on the way out. Tenants are plain
`primeflow rl` runs with `pools.name` set: each is a flow run of its own.
"""

from __future__ import annotations

import threading
from typing import Any

from prefect import flow, get_run_logger
from prefect.client.schemas.objects import FlowRun, State

from engine.config import PrimeflowConfig, with_overrides
from engine.preflight import preflight
from engine.process_groups import kill_recorded_groups
from engine.tenancy.files import pool_dir
from tasks.pools import start_shared_pools, stop_shared_pools


def _pools_name() -> str:
    from prefect.runtime import flow_run

    config = flow_run.parameters.get("config") or {}
    name = (config.get("pools") or {}).get("name") if isinstance(config, dict) else None
    if isinstance(config, PrimeflowConfig):
        name = config.pools.name
    return f"pools-{name}"


def kill_shared_pools(flow: Any, flow_run: FlowRun, state: State) -> None:
    """A cancelled or crashed `pools` run leaves no pool behind."""
    raw = flow_run.parameters.get("config") or {}
    config = raw if isinstance(raw, PrimeflowConfig) else PrimeflowConfig.model_validate(raw)
    if config.pools.name is not None:
        kill_recorded_groups(pool_dir(config.pools.name) / "logs")


@flow(
    name="pools",
    flow_run_name=_pools_name,
    on_cancellation=[kill_shared_pools],
    on_crashed=[kill_shared_pools],
)
def shared_pools(
    config: PrimeflowConfig, overrides: dict[str, Any] | None = None, stop_after_s: float = 0
) -> str:
    """Run the shared pools `pools.name` until stopped (`stop_after_s` > 0: that long)."""
    config = with_overrides(config, overrides or {})
    if config.pools.name is None:
        raise ValueError("set pools.name: the name tenants use to find these pools")
    problems = preflight(config, ())  # e.g. a base model folder not made yet
    if problems:
        raise ValueError("; ".join(problems))
    pools = start_shared_pools(config)
    stop = threading.Event()
    if stop_after_s > 0:
        threading.Timer(stop_after_s, stop.set).start()
    try:
        pools.serve(stop)
    finally:
        stop_shared_pools(pools)
    get_run_logger().info("shared pools %r stopped", config.pools.name)
    return config.pools.name
