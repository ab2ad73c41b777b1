"""ASGI middleware that keeps vLLM's control routes to local callers holding the API key.

The pool needs vLLM's dev-mode routes (`/collective_rpc`, `/pause`, `/resume`,
`/reset_prefix_cache`, ...) to swap weights, but vLLM guards only `/v1/...` with the API key
and serves everything else to anyone who can reach the port. When a server is bound beyond
loopback that would let any host on the network load arbitrary files as weights. This
middleware (loaded into each server with vLLM's `--middleware`) refuses every route outside a
short public list unless the caller is on a loopback address *and* presents the API key.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

#: Routes any client may reach (`/v1/...` still needs the key: vLLM checks it).
PUBLIC_PREFIXES = ("/v1/", "/health", "/ping", "/version", "/metrics", "/load")
#: Under `/v1/` but control: they make the server read an adapter from any path it names.
CONTROL_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
API_KEY_ENV = "VLLM_API_KEY"


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback; False for names and junk."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def bearer_matches(headers: Iterable[tuple[bytes, bytes]], key: str) -> bool:
    """Whether the Authorization header carries `Bearer <key>` (constant-time compare)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                digest = hashlib.sha256(token.encode()).digest()
                return hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest())
    return False


class ControlRouteGuard:
    """Public routes pass; control routes need a loopback caller with the key, else 403."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.api_key = os.environ.get(API_KEY_ENV, "")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        public = path.startswith(PUBLIC_PREFIXES) and not path.startswith(CONTROL_ROUTES)
        if public or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        body = b'{"error":"control routes need a loopback caller and the API key"}'
        await send(
            {
                "type": "http.response.start",
                "status": 403,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _allowed(self, scope: Scope) -> bool:
        client = scope.get("client") or (None, None)
        if not is_loopback(client[0]):
            return False
        return bool(self.api_key) and bearer_matches(scope.get("headers", []), self.api_key)
