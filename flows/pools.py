"""The `pools` flow and `primeflow pools up | down | status`: shared pools that outlive any
one run and train several LoRA runs (tenants) at once (docs/tenants.md).

`pools up` runs the flow in the foreground: it starts the shared inference and trainer
pools, opens the Prefect concurrency limit `primeflow-pool-<name>` to `pools.tenants` slots,
and supervises them until it is stopped (Ctrl-C, SIGTERM, `primeflow pools down`, or a
cancel in the UI for a deployed run), stopping both pools on the way out. Tenants are plain
`primeflow rl` runs with `pools.name` set: each is a flow run of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.client.schemas.objects import FlowRun, State

from engine.config import PrimeflowConfig, load_config, with_overrides
from engine.process_groups import kill_recorded_groups
from engine.tenancy import TenantFiles, pool_dir, read_pool_record, tenant_names
from tasks.pools import start_shared_pools, stop_shared_pools

#: How long `pools down` waits for the supervisor to stop its pools before killing them.
DOWN_GRACE_S = 60.0


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


def _up(argv: list[str], dry_run: bool) -> int:
    from flows import server

    config = load_config(argv, prog="primeflow pools up")
    if dry_run:
        print(json.dumps(config.model_dump(mode="json"), indent=2))
        return 0
    api_url = server.ensure_api_url()
    print(f"Prefect UI: {api_url.removesuffix('/api')}", flush=True)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        shared_pools(config=config)
    except KeyboardInterrupt:
        print(f"shared pools {config.pools.name!r} stopped")
    return 0


def _down(name: str) -> int:
    """SIGTERM the supervisor of pools `name` and wait for it; kill what is left after that."""
    record = read_pool_record(name)
    if record is None or record.status == "stopped":
        print(f"no shared pools named {name!r} are running")
        return 0
    with contextlib.suppress(ProcessLookupError):
        os.kill(record.supervisor_pid, signal.SIGTERM)
    deadline = time.monotonic() + DOWN_GRACE_S
    while time.monotonic() < deadline:
        record = read_pool_record(name)
        if record is None or record.status == "stopped":
            break
        time.sleep(0.5)
    killed = kill_recorded_groups(pool_dir(name) / "logs")
    print(f"shared pools {name!r} stopped" + (f" (killed {killed})" if killed else ""))
    return 0


def _status(name: str) -> int:
    record = read_pool_record(name)
    document: dict[str, Any] = {"name": name, "status": "absent" if record is None else None}
    if record is not None:
        document = {k: v for k, v in record.__dict__.items() if k != "api_key"}
    document["tenants_now"] = {
        tenant: TenantFiles(name, tenant).last_state() for tenant in tenant_names(name)
    }
    print(json.dumps(document, indent=2, default=str))
    return 0


def main(argv: list[str], dry_run: bool) -> int:
    """`primeflow pools up @ config.toml ...`, `pools down --name N`, `pools status --name N`."""
    if argv[:1] == ["up"]:
        return _up(argv[1:], dry_run)
    parser = argparse.ArgumentParser(prog="primeflow pools", description=__doc__)
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--name", required=True, help="the shared pools' pools.name")
    args = parser.parse_args(argv)
    return _down(args.name) if args.action == "down" else _status(args.name)
