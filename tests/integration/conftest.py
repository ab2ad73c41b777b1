"""Session fixtures for the real servers integration tests run against (see `servers.py`).

Each server starts at most once per session, on first use, and is stopped (its whole process
group) when the session ends. A server that cannot start fails the tests that need it with the
tail of its log, rather than an opaque connection error somewhere later.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows import server as prefect_server_cli
from tests.integration.servers import (
    GcsEndpoint,
    S3Endpoint,
    ServerProcess,
    ServerStartError,
    apply_s3_env,
    on_free_ports,
    start_fake_gcs,
    start_moto,
    start_seaweed,
)
from tests.integration.vllm import pool, weights  # noqa: F401  (shared vLLM server fixtures)

# gcsfs >= 2025 swaps in `ExtendedGcsFileSystem` at import time unless this is off; it asks a
# gRPC control plane for each bucket's layout, which an emulator does not serve, and waits 60 s
# per bucket before falling back. It must be set before gcsfs is first imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# google-auth must never probe the cloud metadata address from a test machine.
os.environ.setdefault("NO_GCE_CHECK", "True")

# Startup seconds per server, printed at the end of the session.
STARTUP_S: dict[str, float] = {}


def _start(starter: Callable, tmp_path_factory: pytest.TempPathFactory, name: str):
    try:
        server, endpoint = on_free_ports(lambda: starter(tmp_path_factory.mktemp(name)))
    except ServerStartError as exc:
        pytest.fail(f"could not start {name}: {exc}", pytrace=False)
    STARTUP_S[name] = server.startup_s
    return server, endpoint


@pytest.fixture(scope="session")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, S3Endpoint]]:
    """A moto S3 server (any credentials accepted) with one bucket."""
    server, endpoint = _start(start_moto, tmp_path_factory, "moto")
    yield server, endpoint
    server.stop()


@pytest.fixture(scope="session")
def moto_s3(moto: tuple[ServerProcess, S3Endpoint]) -> S3Endpoint:
    return moto[1]


@pytest.fixture(scope="session")
def seaweed(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, S3Endpoint]]:
    """SeaweedFS (master, volume, filer, S3 gateway) with S3 auth enforced and one bucket."""
    server, endpoint = _start(start_seaweed, tmp_path_factory, "seaweedfs")
    yield server, endpoint
    server.stop()


@pytest.fixture(scope="session")
def seaweed_s3(seaweed: tuple[ServerProcess, S3Endpoint]) -> S3Endpoint:
    return seaweed[1]


@pytest.fixture(scope="session")
def fake_gcs(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, GcsEndpoint]]:
    """fake-gcs-server on loopback with one bucket."""
    server, endpoint = _start(start_fake_gcs, tmp_path_factory, "fake-gcs")
    yield server, endpoint
    server.stop()


@pytest.fixture(scope="session")
def gcs_emulator(fake_gcs: tuple[ServerProcess, GcsEndpoint]) -> GcsEndpoint:
    return fake_gcs[1]


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[S3Endpoint], S3Endpoint]:
    """Point this test's environment (AWS_* variables) at an endpoint: `s3_env(moto_s3)`."""
    return lambda endpoint: apply_s3_env(monkeypatch, endpoint)


@pytest.fixture
def moto_env(moto_s3: S3Endpoint, s3_env: Callable[[S3Endpoint], S3Endpoint]) -> S3Endpoint:
    """The moto endpoint, with this test's environment pointed at it."""
    return s3_env(moto_s3)


@pytest.fixture
def seaweed_env(seaweed_s3: S3Endpoint, s3_env: Callable[[S3Endpoint], S3Endpoint]) -> S3Endpoint:
    """The SeaweedFS endpoint, with this test's environment pointed at it."""
    return s3_env(seaweed_s3)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class PrefectServer:
    """The session's Prefect server: its home and port, so a test can restart it in place."""

    home: Path
    port: int
    env: dict[str, str]

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def pid(self) -> int | None:
        """The server process (the leader of its process group), as `start` recorded it."""
        state = prefect_server_cli.read_state(self.home)
        return state.pid if state is not None else None

    def restart(self) -> None:
        """Stop the server and start it again on the same port and database."""
        if not prefect_server_cli.stop(self.home):
            raise RuntimeError(f"no Prefect server was running for {self.home}")
        prefect_server_cli.start(self.home, port=self.port, env=self.env)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A Prefect server on 127.0.0.1 that lives for the whole session, in its own PREFECT_HOME."""
    home = Path(tmp_path_factory.mktemp("prefect-home"))
    # The scheduler runs every second (default: a minute) so schedule tests see runs quickly.
    fast = {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1"}
    state = on_free_ports(lambda: prefect_server_cli.start(home, port=_free_port(), env=fast))
    try:
        with temporary_settings(updates={PREFECT_API_URL: state.api_url}):
            yield PrefectServer(home=home, port=state.port, env=fast)
            # Send what is still queued while the server is up, not into a closed port.
            APILogWorker.drain_all(timeout=30)
            EventsWorker.drain_all(timeout=30)
    finally:
        prefect_server_cli.stop(home)


@pytest.fixture(scope="session")
def prefect_api(prefect_server: PrefectServer) -> str:
    """The API URL of the session's Prefect server."""
    return prefect_server.api_url


def pytest_terminal_summary(terminalreporter) -> None:
    if STARTUP_S:
        started = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in STARTUP_S.items())
        terminalreporter.write_line(f"storage servers started: {started}")
