"""Server processes never outlive the pool: stop on SIGTERM, die with a SIGKILLed parent.

Two child processes start together so their start-ups overlap: one runs `serve_forever` (what
`primeflow inference` runs) and is stopped with SIGTERM; the other owns a pool on an *untied*
model with two API-server processes in front of its engine (`inference.api_servers`), reloads a
second checkpoint (the session pool covers the tied case) and is SIGKILLed. A process group
counts as gone when no live (non-zombie) process is left in it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from engine.config.inference import InferenceConfig
from engine.inference.launch import RPC_DIR_ENV
from engine.inference.pool import POOL_RECORD, InferencePool, InferencePoolError
from engine.inference.procs import group_members
from tests.integration.inference.reference import greedy, token_logprobs
from tests.integration.vllm import Weights

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 240
PROMPT = [1, 91, 89, 75, 88, 5, 78, 79, 2, 5, 1, 71, 89, 89, 79, 89, 90, 71, 84, 90, 5]
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
    stderr: Path
    lines: list[str] = field(default_factory=list)

    def wait_for(self, last: str) -> list[str]:
        """Lines printed up to one starting with `last`; fails with its stderr if it dies first.

        The child is killed after START_TIMEOUT_S, which ends a `readline` that would block.
        """
        assert self.process.stdout is not None
        watchdog = threading.Timer(START_TIMEOUT_S, self.process.kill)
        watchdog.start()
        try:
            while not any(line.startswith(last) for line in self.lines):
                line = self.process.stdout.readline()
                if not line:
                    pytest.fail(f"child exited: {self.stderr.read_text()[-3000:]}")
                self.lines.append(line.strip())
        finally:
            watchdog.cancel()
        return self.lines

    def pgids(self) -> list[int]:
        record = json.loads((self.logs / POOL_RECORD).read_text())
        return [server["pgid"] for server in record["servers"]]


def start_pool_child(weights: Weights, root: Path) -> Child:
    job = {
        "base": str(weights.untied_base),
        "other": str(weights.untied_other),
        "logs": str(root / "logs"),
        "prompt": PROMPT,
        "max_tokens": 16,
    }
    with (root / "stderr.log").open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.inference.pool_child", json.dumps(job)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    return Child(process=process, logs=root / "logs", stderr=root / "stderr.log")


def start_child(weights: Weights, root: Path) -> Child:
    config = {
        "model": {"name": str(weights.base)},
        "storage": {"uri": f"file://{root}"},
        "run": {"name": "serve"},
        "seq_len": 512,
        "inference": {"dtype": "float32", "kv_cache_gb": 0.25, "extra_args": ["-O0"]},
    }
    with (root / "stderr.log").open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(config)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    return Child(process=process, logs=root / "serve" / "logs", stderr=root / "stderr.log")


@pytest.fixture(scope="module")
def children(
    weights: Weights, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Child, Child]]:
    pair = (
        start_child(weights, tmp_path_factory.mktemp("term")),
        start_pool_child(weights, tmp_path_factory.mktemp("kill")),
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


def socket_folders(pgids: list[int]) -> list[Path]:
    """Each server's folder of ZMQ sockets (its group leader's `RPC_DIR_ENV`), checked to be
    in use: it holds the server's sockets."""
    folders = [Path(psutil.Process(pgid).environ()[RPC_DIR_ENV]) for pgid in pgids]
    assert all(any(path.is_socket() for path in folder.iterdir()) for folder in folders)
    return folders


def test_sigterm_stops_every_server(children: tuple[Child, Child]) -> None:
    child = children[0]
    lines = child.wait_for("serving")
    url = next(line.split(": ", 1)[1] for line in lines if line.startswith("server 0"))
    key = next(line.rsplit(": ", 1)[1] for line in lines if line.startswith("api key"))
    models = httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {key}"})
    assert models.status_code == 200
    pgids = child.pgids()
    assert pgids and all(group_members(pgid) for pgid in pgids)
    folders = socket_folders(pgids)

    child.process.send_signal(signal.SIGTERM)
    assert child.process.wait(timeout=60) == 0
    assert wait_gone(pgids, timeout_s=5) == []
    assert not any(folder.exists() for folder in folders)  # no socket left behind in /tmp
    assert json.loads((child.logs / POOL_RECORD).read_text())["status"] == "stopped"
    assert "Application startup complete" in (child.logs / "inference-0.log").read_text()


def test_untied_model_reloads_exactly(children: tuple[Child, Child], weights: Weights) -> None:
    lines = children[1].wait_for("{")
    result = json.loads(next(line for line in lines if line.startswith("{")))
    # After the reload, every client (whichever API process took its connection) gets the new
    # weights' answer, stamped with the new version.
    for samples, folder, version in (
        ([result["before"]], weights.untied_base, 0),
        (result["after"], weights.untied_other, 1),
    ):
        ids = greedy(folder, PROMPT, 16)  # transformers' answer, once per checkpoint
        expected = token_logprobs(folder, PROMPT, ids)
        for sample in samples:
            assert sample["version"] == version
            assert sample["ids"] == ids
            assert max(abs(a - b) for a, b in zip(sample["logprobs"], expected, strict=True)) < 1e-4
    assert result["before"]["ids"] != result["after"][0]["ids"]


def test_servers_die_with_their_parent(children: tuple[Child, Child]) -> None:
    child = children[1]
    child.wait_for("{")
    pgids = child.pgids()
    members = [pid for pgid in pgids for pid in group_members(pgid)]
    assert len(members) >= 3  # the API servers and at least vLLM's engine process
    titles = [" ".join(psutil.Process(pid).cmdline()) for pid in members]
    assert sum(title.startswith("VLLM::APIServer") for title in titles) == 2, titles
    folders = socket_folders(pgids)

    os.kill(child.process.pid, signal.SIGKILL)
    child.process.wait(timeout=10)
    assert wait_gone(pgids, timeout_s=30) == []
    assert not any(folder.exists() for folder in folders)  # removed by `launch`, the pool gone


def test_bad_model_path_fails_fast_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    pool = InferencePool(InferenceConfig(model=str(missing)), log_dir=tmp_path / "logs")
    started = time.monotonic()
    with pytest.raises(InferencePoolError, match=f"model path {missing} does not exist"):
        pool.start()
    assert time.monotonic() - started < 2
    assert not (tmp_path / "logs").exists()  # no server was ever launched
