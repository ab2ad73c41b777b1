"""One more node of a multi-node trainer pool: joins every trainer stage its flow run starts.

In a multi-node run (a Kubernetes Indexed Job, a Slurm allocation; see
`deployments/work-pools/`) the flow runs on the first node and starts torchrun there for each
stage. torchrun on every other node has to join the same c10d rendezvous with the same config
and the same stage, once per stage and again on each retry of a stage task. The flow run is the
only place that knows all of that, so this process asks it: it reads the flow run's parameters
from the Prefect API and resolves them exactly as the flow does, starts this node's torchrun
when a stage task starts running, and exits when the flow run ends.

The first node hosts the rendezvous (its config names `localhost:<port>` or its own address);
the job template tells the other nodes where that node is through `PRIMEFLOW_RDZV_HOST`, and
the port stays the config's.

    python -m flows.trainer_node            # flow run id from PREFECT__FLOW_RUN_ID
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import StateType

from engine.config import PrimeflowConfig, with_overrides
from engine.trainer.pool import TrainerPool
from storage.layout import Stage
from tasks.hooks import config_of_run

RDZV_HOST_ENV = "PRIMEFLOW_RDZV_HOST"
NNODES_ENV = "PRIMEFLOW_NNODES"
FLOW_RUN_ENV = "PREFECT__FLOW_RUN_ID"
DEFAULT_RDZV_PORT = 29400
#: The stage tasks of `tasks.stages` (by task name) and the trainer stage each one runs.
STAGE_TASKS: dict[str, Stage] = {"sft-warmup": "sft", "rl-loop": "rl"}
log = logging.getLogger("primeflow.trainer_node")


class NodeConfigError(RuntimeError):
    """The job template and the flow run's config disagree; the message says how."""


def follower_config(config: PrimeflowConfig, rdzv_host: str, nnodes: int | None) -> PrimeflowConfig:
    """The flow run's config as seen from this node: the rendezvous at the first node's host.

    `nnodes` is what the job template allocated; a config that asks for a different number
    would wait for nodes that never come, so that is an error here rather than a hang there.
    """
    parallel = config.trainer.parallel
    if nnodes is not None and parallel.nnodes != nnodes:
        raise NodeConfigError(
            f"the job has {nnodes} nodes but the run's trainer.parallel.nnodes is "
            f"{parallel.nnodes}; set both to the same number"
        )
    if parallel.nnodes < 2:
        raise NodeConfigError("trainer.parallel.nnodes is 1: this run has no other trainer nodes")
    _, colon, port = (parallel.rdzv_endpoint or "").rpartition(":")
    endpoint = f"{rdzv_host}:{port if colon and port else DEFAULT_RDZV_PORT}"
    return with_overrides(config, {"trainer.parallel.rdzv_endpoint": endpoint})


def stage_of_task(task_name: str) -> Stage | None:
    """The trainer stage a task run belongs to; task run names are `<task name>-<suffix>`."""
    for name, stage in STAGE_TASKS.items():
        if task_name == name or task_name.startswith(f"{name}-"):
            return stage
    return None


def running_stage(client: SyncPrefectClient, flow_run_id: UUID) -> tuple[Stage, str] | None:
    """The stage task of the flow run that runs now, keyed by task run and attempt."""
    task_runs = client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    )
    for task_run in task_runs:
        stage = stage_of_task(task_run.name)
        if stage is not None and task_run.state_type == StateType.RUNNING:
            return stage, f"{task_run.id}/{task_run.run_count}"
    return None


def flow_run_config(client: SyncPrefectClient, flow_run_id: UUID) -> PrimeflowConfig:
    """The config the flow run resolved: its parameters, overrides and derived run name."""
    flow_run = client.read_flow_run(flow_run_id)
    flow = client.read_flow(flow_run.flow_id)
    return config_of_run(flow.name, flow_run.name, flow_run.parameters)


def run_stage(config: PrimeflowConfig, stage: Stage, flow_ended: Callable[[], bool]) -> int:
    """This node's torchrun for one stage; stopped early when the flow run ends."""
    pool = TrainerPool(config, stage)
    pool.start()
    log.info("joined %s at %s", stage, config.trainer.parallel.rdzv_endpoint)
    try:
        while (code := pool.poll()) is None:
            if flow_ended():
                log.warning("the flow run ended while %s ran here; stopping", stage)
                return 1
            time.sleep(2.0)
        return code
    finally:
        pool.stop()


def follow(
    client: SyncPrefectClient,
    flow_run_id: UUID,
    rdzv_host: str,
    nnodes: int | None,
    poll_s: float = 2.0,
) -> int:
    """Join each stage the flow run starts; 0 when the flow run completed, 1 otherwise."""
    config = follower_config(flow_run_config(client, flow_run_id), rdzv_host, nnodes)
    log.info("following flow run %s (run %s)", flow_run_id, config.run.name)
    joined: set[str] = set()

    def flow_state() -> StateType | None:
        return client.read_flow_run(flow_run_id).state_type

    def flow_ended() -> bool:
        state = flow_state()
        return state is not None and state not in (
            StateType.SCHEDULED,
            StateType.PENDING,
            StateType.RUNNING,
            StateType.PAUSED,
            StateType.CANCELLING,
        )

    while not flow_ended():
        found = running_stage(client, flow_run_id)
        if found is not None and found[1] not in joined:
            joined.add(found[1])
            code = run_stage(config, found[0], flow_ended)
            log.info("%s ended here with status %d", found[0], code)
        time.sleep(poll_s)
    return 0 if flow_state() == StateType.COMPLETED else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.trainer_node", description=__doc__)
    parser.add_argument("--flow-run-id", type=UUID, default=os.environ.get(FLOW_RUN_ENV))
    parser.add_argument("--rdzv-host", default=os.environ.get(RDZV_HOST_ENV))
    parser.add_argument("--nnodes", type=int, default=os.environ.get(NNODES_ENV))
    args = parser.parse_args(argv)
    if args.flow_run_id is None or not args.rdzv_host:
        parser.error(f"needs --flow-run-id ({FLOW_RUN_ENV}) and --rdzv-host ({RDZV_HOST_ENV})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # Kubernetes and Slurm stop a job with SIGTERM: unwind so `finally` stops torchrun.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        with get_client(sync_client=True) as client:
            return follow(client, args.flow_run_id, args.rdzv_host, args.nnodes)
    except NodeConfigError as exc:
        print(f"trainer node: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
