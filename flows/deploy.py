"""`primeflow deploy`: the process work pool and the deployments of `deployments/prefect.yaml`.

`prefect deploy` does the work; this wraps it so that one command also starts (or finds) the
Prefect server and creates the work pool first, and never stops to ask a question.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = REPO_ROOT / "deployments" / "prefect.yaml"


class DeployError(Exception):
    """A deployment could not be created; the message says why in one line."""


def read_deployments(prefect_file: Path = PREFECT_FILE) -> list[dict[str, Any]]:
    """The deployments a prefect.yaml declares, anchors resolved."""
    return yaml.safe_load(prefect_file.read_text())["deployments"]


def work_pools(deployments: list[dict[str, Any]]) -> set[str]:
    return {d["work_pool"]["name"] for d in deployments if d.get("work_pool")}


def deployment_names(prefect_file: Path = PREFECT_FILE) -> list[str]:
    """`flow-name/deployment-name` of each deployment, as `prefect deployment run` takes them."""
    names = []
    for deployment in read_deployments(prefect_file):
        module_path, function = deployment["entrypoint"].split(":")
        source = (prefect_file.parent.parent / module_path).read_text()
        flow_name = _flow_name(source, function)
        names.append(f"{flow_name}/{deployment['name']}")
    return names


def _flow_name(source: str, function: str) -> str:
    """The `name=` given in the `@flow(...)` decorating `function` (prefect's own default else)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call):
                    for keyword in decorator.keywords:
                        if keyword.arg == "name" and isinstance(keyword.value, ast.Constant):
                            return str(keyword.value.value)
    return function.replace("_", "-")


async def ensure_work_pool(name: str) -> bool:
    """Create a process work pool called `name` unless it exists; True when created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    async with get_client() as client:
        try:
            await client.create_work_pool(WorkPoolCreate(name=name, type="process"))
        except ObjectAlreadyExists:
            return False
    return True


def deploy(prefect_file: Path = PREFECT_FILE) -> list[str]:
    """Create the work pools and every deployment; return the deployments' names."""
    deployments = read_deployments(prefect_file)
    for pool in sorted(work_pools(deployments)):
        if asyncio.run(ensure_work_pool(pool)):
            print(f"created process work pool {pool!r}")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect",
            "--no-prompt",
            "deploy",
            "--all",
            "--prefect-file",
            str(prefect_file),
        ],
        cwd=prefect_file.parent.parent,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        tail = " | ".join(line.strip() for line in result.stdout.splitlines()[-5:] if line.strip())
        raise DeployError(f"prefect deploy failed ({result.returncode}): {tail} {result.stderr}")
    return deployment_names(prefect_file)


def main(argv: list[str], dry_run: bool) -> int:
    parser = argparse.ArgumentParser(prog="primeflow deploy", description=__doc__)
    parser.add_argument("--prefect-file", type=Path, default=PREFECT_FILE)
    args = parser.parse_args(argv)
    if dry_run:
        deployments = read_deployments(args.prefect_file)
        plan = {
            "work_pools": sorted(work_pools(deployments)),
            "deployments": deployment_names(args.prefect_file),
        }
        print(json.dumps(plan, indent=2))
        return 0
    from flows.server import ensure_api_url

    api_url = ensure_api_url()
    names = deploy(args.prefect_file)
    print("deployments:", ", ".join(names))
    pools = " ".join(sorted(work_pools(read_deployments(args.prefect_file))))
    root = args.prefect_file.parent.parent
    # Without it the Prefect CLI starts an ephemeral server that knows none of these.
    print(f"point the Prefect CLI at this server: export PREFECT_API_URL={api_url}")
    print(f"start a worker from {root}: prefect worker start --pool {pools}")
    return 0
