"""The local Prefect server every primeflow command starts or reuses.

Ephemeral mode costs seconds of CPU in every process and forgets runs when they end, so runs
never depend on it: a command either uses `PREFECT_API_URL` (a shared server, e.g.
Postgres-backed) or starts one local server (SQLite under its own `PREFECT_HOME`, analytics
off, bound to loopback) that later commands find through `<home>/server.json` and reuse.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from engine.process_groups import process_exists
from engine.run import primeflow_home

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 4200
STATE_FILE = "server.json"
LOG_FILE = "server.log"
#: How long a running server of this home may take to answer before it is taken to be dead.
BUSY_WAIT_S = 30.0


class ServerError(Exception):
    """The Prefect server could not be reached or started; the message says why in one line."""


@dataclass(frozen=True)
class ServerState:
    """What `<home>/server.json` records about the server this home started."""

    pid: int
    host: str
    port: int
    started_at: float

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def prefect_home(home: Path | None = None) -> Path:
    return (home or primeflow_home()) / "prefect"


def server_env(home: Path, api_url: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the server process: its own home and database, no telemetry, and
    its own API as the one its UI talks to (an inherited `PREFECT_API_URL` would point the UI
    at another server's runs)."""
    return {
        **os.environ,
        **(extra or {}),
        "PREFECT_API_URL": api_url,
        "PREFECT_UI_API_URL": api_url,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
    }


def is_healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    try:
        response = httpx.get(f"{api_url.rstrip('/')}/health", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def _answers(api_url: str, within_s: float) -> bool:
    """Whether the server answers its health check within `within_s` (a busy server on a
    loaded machine can miss one short check; it is still this home's server)."""
    deadline = time.monotonic() + within_s
    while True:
        if is_healthy(api_url, timeout_s=min(5.0, within_s)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def read_state(home: Path) -> ServerState | None:
    try:
        return ServerState(**json.loads((home / STATE_FILE).read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


def _alive(pid: int) -> bool:
    if not process_exists(pid):
        return False
    # A server this process started and that has exited stays a zombie until reaped, and
    # signal 0 reaches zombies: without this, `stop` in the starting process waited its whole
    # timeout for a server that was long gone.
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child: whoever started it reaps it
        return True
    return reaped != pid


def status(home: Path) -> dict[str, object]:
    """Whether this home's server runs, and where."""
    state = read_state(home)
    if state is None or not _alive(state.pid):
        return {"running": False, "prefect_home": str(home)}
    return {
        "running": True,
        "healthy": is_healthy(state.api_url),
        "prefect_home": str(home),
        **asdict(state),
        "api_url": state.api_url,
        "ui_url": state.ui_url,
    }


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except FileNotFoundError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:] if line.strip())


def start(
    home: Path,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    timeout_s: float = 90.0,
    env: Mapping[str, str] | None = None,
) -> ServerState:
    """Start a server for `home`, or return the one already running there."""
    state = read_state(home)
    if state is not None and _alive(state.pid) and _answers(state.api_url, BUSY_WAIT_S):
        return state
    home.mkdir(parents=True, exist_ok=True)
    if is_healthy(f"http://{host}:{port}/api"):
        raise ServerError(
            f"another Prefect server already listens on {host}:{port}; use it with "
            f"PREFECT_API_URL=http://{host}:{port}/api or pick another --port"
        )
    log = home / LOG_FILE
    state = ServerState(pid=0, host=host, port=port, started_at=time.time())
    with log.open("ab") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flows.server_process",  # `prefect server start`, its SQLite deadlock fixed
                "--host",
                host,
                "--port",
                str(port),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=server_env(home, state.api_url, env),
            start_new_session=True,
        )
    state = dataclasses.replace(state, pid=process.pid)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(
                f"the Prefect server exited with status {process.returncode}: {_log_tail(log)}"
            )
        if is_healthy(state.api_url):
            (home / STATE_FILE).write_text(json.dumps(asdict(state)))
            return state
        time.sleep(0.3)
    os.killpg(process.pid, signal.SIGKILL)
    raise ServerError(f"the Prefect server was not ready after {timeout_s:.0f}s; see {log}")


def stop(home: Path, *, timeout_s: float = 20.0) -> bool:
    """Stop this home's server (its whole process group). False when none was running."""
    state = read_state(home)
    (home / STATE_FILE).unlink(missing_ok=True)
    if state is None or not _alive(state.pid):
        return False
    os.killpg(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(state.pid):
        time.sleep(0.2)
    if _alive(state.pid):
        os.killpg(state.pid, signal.SIGKILL)
    return True


def ensure_api_url() -> str:
    """The API every Prefect call of this process uses: `PREFECT_API_URL`, else a local server.

    Sets `PREFECT_API_URL` (and the telemetry switches) in this process's environment so that
    Prefect, imported afterwards, never falls back to ephemeral mode.
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    url = os.environ.get("PREFECT_API_URL")
    if url:
        if not is_healthy(url, timeout_s=10.0):
            raise ServerError(f"PREFECT_API_URL={url} does not answer its health check")
        return url
    state = start(prefect_home())
    os.environ["PREFECT_API_URL"] = state.api_url
    return state.api_url
