"""Local TCP ports for the servers."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it).

    Another process may take it before the server binds; the pool retries a start that fails
    with "address in use" on a fresh port, so that race costs one retry, never a failed run.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
