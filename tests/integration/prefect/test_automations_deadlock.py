"""Prefect's SQLite automations deadlock (PrefectHQ/prefect#23055) cannot hang primeflow's server.

A real Prefect API app on SQLite, served by uvicorn on its own loop in a fresh process: the
automations lock is held on that loop (as the triggers service holds it while it reconciles)
while an automation is created through the API. With Prefect's own `after_commit` refresh the
loop's thread waits for the lock it holds, and neither that request nor `/health` is answered;
with `flows.server_process`'s refresh both are, and the refresh runs once the lock is free.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(
    """
    import asyncio, os, socket, sys, threading, time
    home = sys.argv[1]
    os.environ.update({
        "PREFECT_HOME": home,
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    })
    import httpx, uvicorn
    from prefect.server.api.server import create_app
    from prefect.server.events import triggers
    if sys.argv[2] == "fixed":
        from prefect.server.events.models import automations
        from flows.server_process import notify_on_the_loop
        automations._notify = notify_on_the_loop
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(
        create_app(final=True, webserver_only=True), host="127.0.0.1", port=port,
        log_level="error"))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True).start()
    api = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    async def hold_the_lock():
        async with triggers._automations_lock():
            await asyncio.sleep(3)
    held = asyncio.run_coroutine_threadsafe(hold_the_lock(), loop)
    time.sleep(0.2)
    automation = {
        "name": "deadlock-probe",
        "trigger": {"type": "event", "expect": ["probe.*"], "posture": "Reactive",
                    "threshold": 1, "within": 0},
        "actions": [{"type": "do-nothing"}],
    }
    try:
        created = httpx.post(f"{api}/automations/", json=automation, timeout=10)
        healthy = httpx.get(f"{api}/health", timeout=10).status_code == 200
    except httpx.TimeoutException:
        print("hung", flush=True)
        os._exit(0)
    held.result(timeout=10)
    time.sleep(0.5)  # the refresh's turn at the lock
    loaded = any(a.name == "deadlock-probe" for a in triggers.automations_by_id.values())
    print(f"answered {created.status_code} healthy {healthy} loaded {loaded}", flush=True)
    os._exit(0)
    """
)


def run_probe(tmp_path: Path, variant: str) -> str:
    home = tmp_path / variant
    home.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(home), variant],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_prefects_own_refresh_hangs_the_server(tmp_path: Path) -> None:
    """The reproduction holds: without the fix the request and `/health` time out."""
    assert run_probe(tmp_path, "prefect") == "hung"


def test_the_servers_refresh_answers_and_loads_the_automation_once_the_lock_is_free(
    tmp_path: Path,
) -> None:
    assert run_probe(tmp_path, "fixed") == "answered 201 healthy True loaded True"
