"""Flow state hooks: whatever ends a flow run, the pools it started end with it.

Pools run in their own sessions, so a cancelled or crashed flow process does not take them
along. `kill_pools_on_exit` re-derives the run's local folder from the flow run's parameters
(the live objects may be gone) and kills every process group recorded there.

A flow run started in this process (`primeflow rl`, rather than a worker's deployment run)
has no runner to kill it when it is cancelled: Prefect marks it cancelled and nothing more,
and a tenant went on training for minutes, holding its slot. `cancellation` watches the flow
run's state for the stage tasks, which stop their stage when it is cancelled.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from prefect import get_client
from prefect.client.schemas.objects import FlowRun, State
from prefect.exceptions import PrefectHTTPStatusError
from prefect.runtime import flow_run as current_flow_run
from prefect.states import Cancelled

from engine.config import ConfigError, PrimeflowConfig, with_overrides
from engine.process_groups import kill_recorded_groups
from engine.run import logs_dir

log = logging.getLogger(__name__)


def config_of_run(flow_name: str, run_name: str, parameters: dict[str, Any]) -> PrimeflowConfig:
    """The config a flow run resolved: its parameters, overrides, and its derived run name."""
    raw = parameters.get("config") or {}
    config = raw if isinstance(raw, PrimeflowConfig) else PrimeflowConfig.model_validate(raw)
    config = with_overrides(config, parameters.get("overrides") or {})
    if "name" not in config.run.model_fields_set:
        config = with_overrides(config, {"run.name": f"{flow_name}-{run_name}"})
    return config


def kill_pools_on_exit(flow: Any, flow_run: FlowRun, state: State) -> None:
    try:
        config = config_of_run(flow.name, flow_run.name, flow_run.parameters)
    except (ConfigError, ValueError) as exc:
        log.error("cannot find the pools of flow run %s: %s", flow_run.name, exc)
        return
    killed = kill_recorded_groups(logs_dir(config))
    if killed:
        log.warning("flow run %s ended %s: killed %s", flow_run.name, state.type, killed)


def end_cancellation(flow: Any, flow_run: FlowRun, state: State) -> None:
    """Move a cancelled flow run that no runner manages (no deployment: `primeflow` ran it in
    this process) from Cancelling to Cancelled once it has stopped; a worker or `serve` does
    that for theirs, and nothing would for these (they stayed Cancelling)."""
    if flow_run.deployment_id is not None:
        return
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run.id, Cancelled(message="Flow run was cancelled."))


#: What every primeflow flow runs when it is cancelled.
ON_CANCELLATION = [kill_pools_on_exit, end_cancellation]


#: How often a stage task reads its flow run's state: a cancel stops the stage within this
#: and the stage's own poll.
CANCEL_POLL_S = 2.0


@contextmanager
def cancellation(poll_s: float = CANCEL_POLL_S) -> Iterator[threading.Event]:
    """An event set once the current flow run is cancelled (Cancelling or Cancelled), read
    from the server every `poll_s` on a thread of its own; a server that does not answer
    for a while (restarted) is asked again at the next poll."""
    flow_run_id = current_flow_run.id
    cancelled, done = threading.Event(), threading.Event()
    if flow_run_id is None:  # a task called outside any flow run: nothing to cancel
        yield cancelled
        return

    def watch() -> None:
        with get_client(sync_client=True) as client:
            while not done.wait(poll_s):
                try:
                    state = client.read_flow_run(flow_run_id).state
                except (httpx.HTTPError, PrefectHTTPStatusError):
                    continue
                if state is not None and (state.is_cancelling() or state.is_cancelled()):
                    cancelled.set()
                    return

    # In this task's context: the Prefect settings (the API URL) live in context variables,
    # and a thread without them would start an ephemeral server of its own.
    context = contextvars.copy_context()
    watcher = threading.Thread(
        target=context.run, args=(watch,), name="cancellation-watch", daemon=True
    )
    watcher.start()
    try:
        yield cancelled
    finally:
        done.set()
        watcher.join()
