"""Flow state hooks: whatever ends a flow run, the pools it started end with it.

Pools run in their own sessions, so a cancelled or crashed flow process does not take them
along. `kill_pools_on_exit` re-derives the run's local folder from the flow run's parameters
(the live objects may be gone) and kills every process group recorded there.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect.client.schemas.objects import FlowRun, State

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
