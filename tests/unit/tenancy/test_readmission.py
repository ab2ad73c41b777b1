"""A tenant's stage and a restarted shared trainer (issue 34): at each admission the stage
serves the newest policy version, which unloads the versions the dead trainer published past
its checkpoint, even when the trainer finished the tenant before the stage read `admitted`.

The tenant's pool, its adapter lineage, its policy versions and the trainer's answers are the
real ones; only vLLM is a stand-in: its three adapter routes, on loopback.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import PrimeflowConfig
from engine.inference.attached import AttachedPool
from engine.run import Run, run_store
from engine.stages import _SharedTrainer
from engine.tenancy import TenantFiles
from storage.checkpoints import write_checkpoint
from storage.layout import RunLayout
from storage.policies import forget_after
from storage.store import ObjectStore


class AdapterRoutes(BaseHTTPRequestHandler):
    """vLLM's adapter routes and nothing else: list, load (a name once), unload."""

    server: Server

    def do_GET(self) -> None:
        cards = [{"id": name, "root": root} for name, root in self.server.adapters.items()]
        self._reply(200, {"data": cards})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        name = body["lora_name"]
        if self.path == "/v1/unload_lora_adapter":
            self.server.adapters.pop(name, None)
        elif self.server.busy:
            return self._reply(503, {"error": "busy"})
        elif name in self.server.adapters:
            return self._reply(400, {"error": f"{name} has already been loaded"})
        else:
            self.server.adapters[name] = body["lora_path"]
        self._reply(200, {})

    def _reply(self, code: int, document: dict[str, Any]) -> None:
        data = json.dumps(document).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


class Server(ThreadingHTTPServer):
    adapters: dict[str, str]
    #: Refuse loads (a server that cannot take one now).
    busy = False


@pytest.fixture
def server() -> Iterator[Server]:
    server = Server(("127.0.0.1", 0), AdapterRoutes)
    server.adapters = {}
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    thread.join()


def publish(store: ObjectStore, step: int, trainer: tuple[str, int]) -> None:
    """Policy version `step` of the tenant, a full adapter with a uid of its own, as the
    trainer start `trainer` (its lineage_id, the step it resumed from) publishes it."""
    write_checkpoint(
        store,
        step,
        weights={"lora_A.weight": torch.full((2, 2), float(step))},
        config={"peft_type": "LORA", "r": 2},
        adapter=True,
        parent=RunLayout.POLICIES,
        meta={
            "kind": "full",
            "uid": f"{step}-{time.time_ns()}",
            "lineage_id": trainer[0],
            "lineage": trainer[1],
        },
    )


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRIMEFLOW_HOME", str(tmp_path / "home"))


@pytest.fixture
def stage(tmp_path: Path, server: Server) -> Iterator[_SharedTrainer]:
    """The tenant's side of the shared trainer, its attempt requested, on `server`."""
    config = PrimeflowConfig.model_validate(
        {
            "run": {"name": "r"},
            "storage": {"uri": f"file://{tmp_path}/runs"},
            "pools": {"name": "p"},
            "trainer": {"lora": {"rank": 2}},
        }
    )
    url = f"http://127.0.0.1:{server.server_address[1]}"
    pool = AttachedPool(
        "r", model="base", urls=[url], api_key="k", config=config.inference, cache_dir=tmp_path
    )
    run = Run(run_store(config), tmp_path / "local")
    stage = _SharedTrainer(config, run, logging.getLogger("test"), pool)
    stage.attempt = stage.files.request(config)
    yield stage
    pool.close()


def served(server: Server) -> list[int]:
    return sorted(int(name.split("@v")[1].split("-")[0]) for name in server.adapters)


FIRST, RESTARTED = ("first", 0), ("restarted", 6)


def test_a_tenant_finished_before_it_saw_its_readmission_catches_up_first(
    stage: _SharedTrainer, server: Server
) -> None:
    store, files, attempt = stage.store, stage.files, stage.attempt
    # The first trainer admits the tenant and publishes up to 7; its checkpoint is step 6,
    # and the orchestrator serves version 7, then commits its last rollouts.
    publish(store, 0, FIRST)
    files.answer(attempt, "admitted", 1.0, step=0)
    assert stage.poll() is None and served(server) == [0]
    for step in range(1, 8):
        publish(store, step, FIRST)
    stage.serving.reload(store.url(RunLayout.policy_dir(6)), 6)
    stage.serving.reload(store.url(RunLayout.policy_dir(7)), 7)
    rolled_back = next(name for name in server.adapters if "@v7-" in name)
    assert served(server) == [6, 7] and stage.poll() is None

    # A trainer restarted after the kill admits it again from checkpoint 6, deletes version
    # 7, trains 7 and 8 from the rollouts committed already and finishes it, all between
    # two polls: the stage never reads `admitted`.
    forget_after(store, 6)
    files.answer(attempt, "admitted", 2.0, step=6)
    publish(store, 7, RESTARTED)
    publish(store, 8, RESTARTED)
    files.answer(attempt, "finished", 2.0, step=8)
    # Until the servers can take the final version, the stage keeps polling.
    server.busy = True
    assert stage.poll() is None and rolled_back in server.adapters
    server.busy = False

    assert stage.poll() == 0
    assert rolled_back not in server.adapters
    assert served(server) == [6, 8]  # the checkpoint's own version 6, then the final one
    assert stage.poll() == 0  # caught up with that admission: nothing reloads again


def test_a_finished_tenant_whose_admission_was_acted_on_ends_at_once(
    stage: _SharedTrainer, server: Server
) -> None:
    store, files = stage.store, stage.files
    publish(store, 0, FIRST)
    files.answer(stage.attempt, "admitted", 1.0, step=0)
    assert stage.poll() is None and served(server) == [0]
    publish(store, 1, FIRST)
    stage.serving.reload(store.url(RunLayout.policy_dir(1)), 1)
    files.answer(stage.attempt, "finished", 1.0, step=1)
    assert stage.poll() == 0
    assert served(server) == [0, 1]  # no reload: nothing was rolled back


def test_every_answer_names_the_latest_admission() -> None:
    files = TenantFiles("p", "r")
    files.answer("a", "admitted", 1.0, step=0)
    files.answer("a", "admitted", 2.0, step=6)
    files.answer("a", "finished", 2.0, step=8)
    state = files.state("a")
    assert state is not None and state["status"] == "finished" and state["step"] == 8
    assert state["admitted_at"] == 2.0
    files.answer("b", "refused", error="no slot")
    assert "admitted_at" not in files.state("b")  # type: ignore[operator]
