"""A dry run never asks the model hub; a real run's preflight does.

On a machine that cannot reach the hub, the tokenizer lookup's retries took 46 s of every dry
run of a hub model's config. Here the hub is a loopback server that answers 404 and counts the
requests; `huggingface_hub` reads `HF_ENDPOINT` at import, so the calls run in a child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest

pytestmark = pytest.mark.integration

CHILD = """
import sys
from engine.config import PrimeflowConfig, with_overrides
from engine.preflight import preflight
config = with_overrides(PrimeflowConfig(), {"model.name": "org/no-such-model"})
assert preflight(config, ("rl",), dry_run=sys.argv[1] == "dry") == []
"""


@pytest.fixture
def hub() -> Iterator[tuple[str, list[str]]]:
    """(endpoint, the paths it was asked for)."""
    asked: list[str] = []

    class Hub(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_error(404)

        do_HEAD = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", asked
    server.shutdown()


def preflight_in_child(mode: str, endpoint: str, home: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(home))  # nothing cached
    child = subprocess.run(
        [sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]


def test_a_dry_run_asks_the_hub_nothing_and_a_real_run_does(
    hub: tuple[str, list[str]], tmp_path: Path
) -> None:
    endpoint, asked = hub

    def model_lookups() -> list[str]:  # huggingface_hub also fetches a registry of its own
        return [path for path in asked if "no-such-model" in path]

    preflight_in_child("dry", endpoint, tmp_path)
    assert model_lookups() == []
    preflight_in_child("real", endpoint, tmp_path)
    assert model_lookups()
