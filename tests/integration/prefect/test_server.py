"""`primeflow server start|status|stop` against a real Prefect server on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def primeflow(home: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("primeflow")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PRIMEFLOW_HOME=str(home), **extra)
    return subprocess.run(
        [str(exe), "server", *args], capture_output=True, text=True, timeout=180, env=env
    )


def test_start_reuse_status_stop(tmp_path: Path) -> None:
    port = str(free_port())
    # A PREFECT_API_URL left over from another server must not become the UI's API.
    started = primeflow(tmp_path, "start", "--port", port, PREFECT_API_URL="http://127.0.0.1:9/api")
    assert started.returncode == 0, started.stderr
    assert f"http://127.0.0.1:{port}" in started.stdout
    try:
        ui = httpx.get(f"http://127.0.0.1:{port}/ui-settings", timeout=10).json()
        assert ui["api_url"] == f"http://127.0.0.1:{port}/api", ui
        first = json.loads(primeflow(tmp_path, "status").stdout)
        assert first["running"] and first["healthy"]
        assert Path(first["prefect_home"]) == tmp_path / "prefect"
        assert (tmp_path / "prefect" / "prefect.db").exists()  # its own SQLite database

        # Every socket the server listens on is on loopback.
        process = psutil.Process(first["pid"])
        listening = [
            c.laddr.ip
            for p in [process, *process.children(recursive=True)]
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening and all(ip == "127.0.0.1" for ip in listening)

        again = primeflow(tmp_path, "start", "--port", port)
        assert again.returncode == 0
        assert json.loads(primeflow(tmp_path, "status").stdout)["pid"] == first["pid"]
    finally:
        stopped = primeflow(tmp_path, "stop")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert not psutil.pid_exists(first["pid"]) or psutil.Process(first["pid"]).status() == "zombie"
    assert json.loads(primeflow(tmp_path, "status").stdout)["running"] is False


def test_port_taken_by_another_server_is_a_clear_error(tmp_path: Path) -> None:
    port = str(free_port())
    assert primeflow(tmp_path / "a", "start", "--port", port).returncode == 0
    try:
        clash = primeflow(tmp_path / "b", "start", "--port", port)
        assert clash.returncode == 1
        assert "already listens" in clash.stderr and "PREFECT_API_URL" in clash.stderr
        assert len(clash.stderr.strip().splitlines()) == 1
    finally:
        primeflow(tmp_path / "a", "stop")
