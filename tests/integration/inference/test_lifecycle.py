"""Server processes never outlive the pool: stop on SIGTERM, die with a SIGKILLed parent.

Each test runs `serve_forever` (what `primeflow inference` runs) in a child process; both
children start together so their start-ups overlap. A process group counts as gone when no
live (non-zombie) process is left in it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine.config.inference import InferenceConfig
from engine.inference.pool import POOL_RECORD, InferencePool, InferencePoolError
from engine.inference.procs import group_members
from tests.integration.inference.conftest import Weights

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 240
CHILD = (
    "import json, sys\n"
    "from engine.config import PrimeflowConfig\n"
    "from engine.inference.serve import serve_forever\n"
    "sys.exit(serve_forever(PrimeflowConfig.model_validate(json.loads(sys.argv[1]))))\n"
)


@dataclass
class Child:
    """A `serve_forever` process and where its run lives."""

    process: subprocess.Popen[str]
    logs: Path

    def wait_serving(self) -> list[str]:
        """Lines printed until it says it is serving; fails with its stderr if it dies first."""
        lines: list[str] = []
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.process.stdout is not None
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                pytest.fail(f"serve_forever exited: {self.process.stderr.read()}")  # type: ignore[union-attr]
            lines.append(line.strip())
            if line.startswith("serving"):
                return lines
        pytest.fail("serve_forever did not start in time")

    def pgids(self) -> list[int]:
        record = json.loads((self.logs / POOL_RECORD).read_text())
        return [server["pgid"] for server in record["servers"]]


def start_child(weights: Weights, root: Path) -> Child:
    config = {
        "model": {"name": str(weights.base)},
        "storage": {"uri": f"file://{root}"},
        "run": {"name": "serve"},
        "seq_len": 512,
        "inference": {"dtype": "float32", "kv_cache_gb": 0.25, "extra_args": ["-O0"]},
    }
    process = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return Child(process=process, logs=root / "serve" / "logs")


@pytest.fixture(scope="module")
def children(
    weights: Weights, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Child, Child]]:
    pair = (
        start_child(weights, tmp_path_factory.mktemp("term")),
        start_child(weights, tmp_path_factory.mktemp("kill")),
    )
    yield pair
    for child in pair:
        if child.process.poll() is None:
            child.process.kill()
        child.process.wait()


def wait_gone(pgids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pgid in pgids for pid in group_members(pgid)]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def test_sigterm_stops_every_server(children: tuple[Child, Child]) -> None:
    child = children[0]
    lines = child.wait_serving()
    url = next(line.split(": ", 1)[1] for line in lines if line.startswith("server 0"))
    key = next(line.rsplit(": ", 1)[1] for line in lines if line.startswith("api key"))
    models = httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {key}"})
    assert models.status_code == 200
    pgids = child.pgids()
    assert pgids and all(group_members(pgid) for pgid in pgids)

    child.process.send_signal(signal.SIGTERM)
    assert child.process.wait(timeout=60) == 0
    assert wait_gone(pgids, timeout_s=5) == []
    assert json.loads((child.logs / POOL_RECORD).read_text())["status"] == "stopped"
    assert "Application startup complete" in (child.logs / "inference-0.log").read_text()


def test_servers_die_with_their_parent(children: tuple[Child, Child]) -> None:
    child = children[1]
    child.wait_serving()
    pgids = child.pgids()
    members = [pid for pgid in pgids for pid in group_members(pgid)]
    assert len(members) >= 2  # the API server and at least vLLM's engine process

    os.kill(child.process.pid, signal.SIGKILL)
    child.process.wait(timeout=10)
    assert wait_gone(pgids, timeout_s=30) == []


def test_bad_model_path_fails_fast_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    pool = InferencePool(InferenceConfig(model=str(missing)), log_dir=tmp_path / "logs")
    started = time.monotonic()
    with pytest.raises(InferencePoolError, match=f"model path {missing} does not exist"):
        pool.start()
    assert time.monotonic() - started < 2
    assert not (tmp_path / "logs").exists()  # no server was ever launched
