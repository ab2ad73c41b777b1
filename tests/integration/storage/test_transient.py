"""Faults that heal: a server that is not there is retried with backoff, within bounded time,
and a server that comes back inside the retry window lets the call succeed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from storage.errors import TransientStorageError
from storage.store import ObjectStore
from tests.integration.servers import REGION, RestartableMotoServer, S3Endpoint, free_ports

pytestmark = pytest.mark.integration

RETRIES = 3
BACKOFF_S = 0.05
# Backoff doubles per retry and is jittered by 0.5-1.5x: the least total wait RETRIES retries take.
MIN_WAIT_S = 0.5 * sum(BACKOFF_S * 2**attempt for attempt in range(RETRIES))


def _endpoint(url: str) -> S3Endpoint:
    return S3Endpoint(
        url=url, access_key="test-key", secret_key="test-secret", region=REGION, bucket="outage"
    )


@pytest.fixture
def restartable(
    s3_env: Callable[[S3Endpoint], S3Endpoint],
) -> Iterator[tuple[RestartableMotoServer, S3Endpoint]]:
    server = RestartableMotoServer()
    server.start()
    endpoint = s3_env(_endpoint(server.url))
    yield server, endpoint
    server.stop()


@pytest.mark.parametrize("operation", ["write", "read", "list"])
def test_nothing_listening_is_retried_then_reported_transient(
    s3_env: Callable[[S3Endpoint], S3Endpoint], operation: str
) -> None:
    (port,) = free_ports(1)
    endpoint = s3_env(_endpoint(f"http://127.0.0.1:{port}"))
    store = ObjectStore(endpoint.uri("run"), retries=RETRIES, backoff_s=BACKOFF_S)
    call = {
        "write": lambda: store.write_bytes("a/x.bin", b"x"),
        "read": lambda: store.read_bytes("a/x.bin"),
        "list": lambda: store.list("a"),
    }[operation]
    path = "a" if operation == "list" else "a/x.bin"

    began = time.monotonic()
    with pytest.raises(TransientStorageError) as error:
        call()
    elapsed = time.monotonic() - began

    assert MIN_WAIT_S <= elapsed < 5.0, f"{elapsed:.2f}s: backoff missing or unbounded"
    message = str(error.value)
    assert message.startswith(f"{store.url(path)}: "), message
    assert f"gave up after {RETRIES + 1} attempts" in message
    assert str(port) in message


def test_a_server_back_within_the_retry_window_lets_the_call_succeed(
    restartable: tuple[RestartableMotoServer, S3Endpoint],
) -> None:
    server, endpoint = restartable
    endpoint.boto3_client().create_bucket(Bucket=endpoint.bucket)
    ObjectStore(endpoint.uri("run")).write_bytes("before.bin", b"written before the outage")

    server.stop()
    outage_s = 1.0
    restart = threading.Timer(outage_s, server.start)
    # retries=6 at 0.2 s doubling waits at least 6.3 s in all: far more than the outage.
    store = ObjectStore(endpoint.uri("run"), retries=6, backoff_s=0.2)
    began = time.monotonic()
    restart.start()
    try:
        assert store.read_bytes("before.bin") == b"written before the outage"
        store.write_bytes("after.bin", b"written after it")
    finally:
        restart.join()
    assert time.monotonic() - began >= outage_s
    assert store.read_bytes("after.bin") == b"written after it"
