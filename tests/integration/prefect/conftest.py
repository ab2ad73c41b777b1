"""One real Prefect server per test session, on 127.0.0.1, in its own PREFECT_HOME."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows import server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The API URL of a Prefect server that lives for the whole session."""
    home = Path(tmp_path_factory.mktemp("prefect-home"))
    # The scheduler runs every second (default: a minute) so schedule tests see runs quickly.
    fast = {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1"}
    state = server.start(home, port=_free_port(), env=fast)
    try:
        with temporary_settings(updates={PREFECT_API_URL: state.api_url}):
            yield state.api_url
            # Send what is still queued while the server is up, not into a closed port.
            APILogWorker.drain_all(timeout=30)
            EventsWorker.drain_all(timeout=30)
    finally:
        server.stop(home)
