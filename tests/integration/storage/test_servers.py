"""The test servers themselves: loopback only, auth enforced, and gone when stopped."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

import psutil
import pytest

from tests.integration.servers import (
    LOOPBACK,
    PORT_ATTEMPTS,
    GcsEndpoint,
    S3Endpoint,
    ServerProcess,
    ServerStartError,
    on_free_ports,
    start_moto,
)

pytestmark = pytest.mark.integration


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def _assert_loopback_only(server: ServerProcess, expected_listeners: int) -> None:
    """Every socket the server's process group holds is on loopback, at both ends."""
    members = _group_members(server.pgid)
    assert members, f"{server.name}: no process in group {server.pgid}"
    listening, outside = [], []
    for proc in members:
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                listening.append(conn.laddr)
                if not _is_loopback(conn.laddr.ip):
                    outside.append(f"listens on {conn.laddr.ip}:{conn.laddr.port}")
            elif conn.raddr and not _is_loopback(conn.raddr.ip):
                outside.append(f"talks to {conn.raddr.ip}:{conn.raddr.port}")
    assert not outside, f"{server.name} reaches beyond loopback: {outside}"
    assert len(listening) >= expected_listeners, f"{server.name} listens on {listening}"


def test_moto_listens_on_loopback_only(moto: tuple[ServerProcess, S3Endpoint]) -> None:
    _assert_loopback_only(moto[0], expected_listeners=1)


def test_seaweed_listens_on_loopback_only(seaweed: tuple[ServerProcess, S3Endpoint]) -> None:
    # master, volume, filer and S3, each with HTTP and gRPC ports.
    _assert_loopback_only(seaweed[0], expected_listeners=8)


def test_fake_gcs_listens_on_loopback_only(fake_gcs: tuple[ServerProcess, GcsEndpoint]) -> None:
    _assert_loopback_only(fake_gcs[0], expected_listeners=1)


def test_seaweed_refuses_unsigned_and_wrongly_signed_requests(seaweed_s3: S3Endpoint) -> None:
    from botocore.exceptions import ClientError

    client = seaweed_s3.boto3_client(secret_key="not-the-secret")
    with pytest.raises(ClientError) as refused:
        client.list_objects_v2(Bucket=seaweed_s3.bucket)
    assert refused.value.response["Error"]["Code"] in {"SignatureDoesNotMatch", "AccessDenied"}


def test_a_server_whose_port_was_taken_starts_again_on_a_new_one(tmp_path: Path) -> None:
    """The race `on_free_ports` covers, forced: the first moto is given a port another
    socket already listens on; it dies on the bind, and the second start, on a port the OS
    gives, serves."""
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        given = iter([taken.getsockname()[1], 0])
        folders = iter(tmp_path / f"moto-{attempt}" for attempt in range(PORT_ATTEMPTS))
        server, endpoint = on_free_ports(lambda: start_moto(next(folders), port=next(given)))
    try:
        first_log = (tmp_path / "moto-0" / "moto.log").read_text().lower()
        assert "address already in use" in first_log
        assert server.workdir == tmp_path / "moto-1"
        assert endpoint.boto3_client().list_buckets()["Buckets"]  # the bucket it made
    finally:
        server.stop()


def test_a_start_that_fails_for_another_cause_is_not_tried_again(tmp_path: Path) -> None:
    folders = iter(tmp_path / f"moto-{attempt}" for attempt in range(PORT_ATTEMPTS))
    with pytest.raises(ServerStartError, match="exited with code"):
        on_free_ports(lambda: start_moto(next(folders), port=-1))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["moto-0"]
