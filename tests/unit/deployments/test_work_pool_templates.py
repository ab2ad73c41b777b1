"""The Kubernetes and Slurm base job templates render, with Prefect's own machinery, into a
multi-node job: pod/node 0 runs the flow, every other one follows the trainer stages.

Rendering goes through `BaseJobConfiguration.from_template_and_values` and
`prepare_for_flow_run`, the code a worker runs for each flow run; the configuration classes
below declare the fields the Kubernetes worker (prefect-kubernetes) and the community Slurm
worker (prefect-slurm) read. Not run against a cluster.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, TypeVar
from uuid import uuid4

import jinja2
import pytest
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.objects import FlowRun
from prefect.server.schemas.actions import validate_base_job_template
from prefect.utilities.schema_tools import validate
from prefect.workers.base import BaseJobConfiguration

ROOT = Path(__file__).resolve().parents[3]
POOLS = ROOT / "deployments" / "work-pools"
T = TypeVar("T", bound=BaseJobConfiguration)


class KubernetesJob(BaseJobConfiguration):
    """The fields prefect-kubernetes' job configuration reads."""

    namespace: str = "default"
    job_manifest: dict[str, Any]
    job_watch_timeout_seconds: int | None = None
    pod_watch_timeout_seconds: int = 60
    stream_output: bool = True


class SlurmJob(BaseJobConfiguration):
    """The fields prefect-slurm's job configuration reads."""

    working_dir: str | None = None
    num_nodes: int = 1
    num_processes_per_node: int = 1
    max_walltime: str = "24:00:00"
    queue: str = "small"
    script_template: str | list[str] | None = None
    pre_command: str | None = None
    post_command: str | None = None


def load(name: str) -> dict[str, Any]:
    return json.loads((POOLS / name).read_text())


def render(cls: type[T], template: dict[str, Any], values: dict[str, Any]) -> T:
    """What a worker builds for one flow run of a deployment with job variables `values`."""
    assert validate(values, template["variables"], raise_on_error=True) == []

    async def build() -> T:
        # Never contacted: the templates hold no block or variable references to resolve.
        client = PrefectClient(api="http://127.0.0.1:9/api")
        return await cls.from_template_and_values(template, values, client=client)

    configuration = asyncio.run(build())
    configuration.prepare_for_flow_run(FlowRun(flow_id=uuid4(), name="crimson-otter"))
    return configuration


@pytest.mark.parametrize("name", ["kubernetes.json", "slurm.json"])
def test_templates_pass_the_servers_validation(name: str) -> None:
    template = load(name)
    assert validate_base_job_template(template) == template


@pytest.mark.parametrize(
    ("name", "values"),
    [("kubernetes.json", {"nnodes": 0, "image": "x"}), ("slurm.json", {"max_walltime": "1 day"})],
)
def test_bad_job_variables_are_rejected(name: str, values: dict[str, Any]) -> None:
    errors = validate(values, load(name)["variables"])
    assert errors, values


def kubernetes_job(values: dict[str, Any]) -> tuple[KubernetesJob, dict[str, Any]]:
    job = render(KubernetesJob, load("kubernetes.json"), values)
    return job, job.job_manifest


def test_kubernetes_manifest_is_an_indexed_job_of_nnodes_gpu_pods() -> None:
    job, manifest = kubernetes_job(
        {"image": "registry.example.com/primeflow:cuda", "nnodes": 4, "gpus_per_node": 8}
    )
    assert (manifest["apiVersion"], manifest["kind"]) == ("batch/v1", "Job")
    spec = manifest["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 4
    assert spec["backoffLimit"] == 0  # one failed node fails the job: no half-size reruns
    pod = spec["template"]["spec"]
    # prefect-kubernetes validates these two pod-spec fields (its base manifest has them).
    assert (pod["parallelism"], pod["completions"], pod["restartPolicy"]) == (1, 1, "Never")
    assert pod["subdomain"] == "primeflow-trainer"
    assert spec["template"]["metadata"]["labels"] == {"primeflow.io/trainer": "true"}
    (container,) = pod["containers"]
    assert container["name"] == "prefect-job"  # the worker fills env and args of this one
    assert container["image"] == "registry.example.com/primeflow:cuda"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert job.namespace == "default" and job.pod_watch_timeout_seconds == 600


def test_kubernetes_pods_learn_where_the_rendezvous_is() -> None:
    job, manifest = kubernetes_job({"image": "x", "nnodes": 3, "subdomain": "trainers"})
    (container,) = manifest["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    names = [e["name"] for e in container["env"]]
    # Kubernetes expands $(JOB_NAME) only from variables listed before the one using it.
    assert names.index("JOB_NAME") < names.index("PRIMEFLOW_RDZV_HOST")
    assert env["PRIMEFLOW_RDZV_HOST"]["value"] == "$(JOB_NAME)-0.trainers"
    assert env["PET_LOCAL_ADDR"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # The worker turns these into the first entries of the container's env.
    assert job.env["PRIMEFLOW_NNODES"] == "3"
    assert "PREFECT__FLOW_RUN_ID" in job.env
    assert job.command == "prefect flow-run execute"
    assert container["envFrom"] == [
        {"secretRef": {"name": "primeflow-storage-credentials", "optional": True}}
    ]


def test_kubernetes_user_env_joins_the_templates_env() -> None:
    job, _ = kubernetes_job({"image": "x", "env": {"WANDB_PROJECT": "rl"}})
    assert job.env["WANDB_PROJECT"] == "rl" and job.env["PRIMEFLOW_NNODES"] == "2"


def run_pod_command(
    container: dict[str, Any], index: int, args: list[str]
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT__FLOW_RUN_ID"}
    env |= {
        "JOB_COMPLETION_INDEX": str(index),
        "PATH": f"{Path(sys.executable).parent}:{env['PATH']}",
    }
    return subprocess.run(
        [*container["command"], *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_kubernetes_pod_zero_runs_the_flow_and_the_others_the_trainer_node() -> None:
    job, manifest = kubernetes_job({"image": "x"})
    (container,) = manifest["spec"]["template"]["spec"]["containers"]
    flow = run_pod_command(container, 0, ["echo", "flow run:", *shlex.split(job.command)])
    assert flow.returncode == 0 and flow.stdout.strip() == "flow run: prefect flow-run execute"
    # Pod 1 starts the trainer node, which needs the flow run id the worker puts in env.
    node = run_pod_command(container, 1, ["echo", "flow run"])
    assert node.returncode == 2, node.stderr
    assert "PREFECT__FLOW_RUN_ID" in node.stderr and "flow run" not in node.stdout


def slurm_script(values: dict[str, Any]) -> tuple[SlurmJob, str]:
    job = render(SlurmJob, load("slurm.json"), values)
    assert isinstance(job.script_template, list)
    text = "\n".join(job.script_template)
    # prefect-slurm renders the script with Jinja once more; nothing may change there.
    assert jinja2.Template(text, keep_trailing_newline=True).render() == text
    return job, text


def test_slurm_script_allocates_nodes_and_gpus() -> None:
    job, script = slurm_script(
        {"working_dir": "/shared/primeflow", "num_nodes": 4, "gpus_per_node": 8, "queue": "h100"}
    )
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=primeflow",
        "#SBATCH --partition=h100",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --mem=0",
        "#SBATCH --time=24:00:00",
        "#SBATCH --output=primeflow-%j.out",
    ]
    assert script.startswith("#!/bin/bash\n")
    assert (job.num_nodes, job.num_processes_per_node, job.queue) == (4, 1, "h100")
    assert 'cd "/shared/primeflow"' in script


def test_slurm_script_runs_the_flow_here_and_srun_trainer_nodes_elsewhere() -> None:
    _, script = slurm_script({"working_dir": "/w", "pre_command": "source .venv/bin/activate"})
    lines = [line.strip() for line in script.splitlines()]
    assert "source .venv/bin/activate" in lines
    assert (
        'export PRIMEFLOW_RDZV_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST" '
        '| head -n 1)"' in lines
    )
    (srun,) = [line for line in lines if line.startswith("srun ")]
    assert shlex.split(srun) == [
        "srun",
        "--nodes=$((SLURM_JOB_NUM_NODES - 1))",
        "--ntasks-per-node=1",
        "--exclude=$PRIMEFLOW_RDZV_HOST",
        "--kill-on-bad-exit=1",
        "python",
        "-m",
        "flows.trainer_node",
        "&",
    ]
    assert lines.index(srun) < lines.index("prefect flow-run execute || status=$?")
    assert lines[-1] == 'exit "$status"'
    # Unset optional commands leave no line behind, and bash accepts the script.
    assert "" not in lines[: lines.index("set -euo pipefail")]
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
