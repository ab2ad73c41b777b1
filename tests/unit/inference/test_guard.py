"""Control routes answer only loopback callers with the key; public routes pass through."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from engine.inference.guard import ControlRouteGuard, is_loopback

KEY = "secret-key"


def ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


def client_from(host: str, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    paths = [
        "/collective_rpc", "/pause", "/v1/completions", "/health", "/tokenize",
        "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    ]  # fmt: skip
    app = Starlette(routes=[Route(path, ok, methods=["GET", "POST"]) for path in paths])
    app.add_middleware(ControlRouteGuard)
    return TestClient(app, client=(host, 40000))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.1", "::1", "::ffff:127.0.0.1"])
def test_loopback_with_key_reaches_control_routes(
    host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = client_from(host, monkeypatch)
    headers = {"Authorization": f"Bearer {KEY}"}
    assert client.post("/collective_rpc", headers=headers).status_code == 200
    assert client.post("/pause", headers=headers).status_code == 200
    assert client.post("/v1/load_lora_adapter", headers=headers).status_code == 200


def test_loopback_without_the_key_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    client = client_from("127.0.0.1", monkeypatch)
    assert client.post("/collective_rpc").status_code == 403
    wrong = {"Authorization": "Bearer nope"}
    assert client.post("/collective_rpc", headers=wrong).status_code == 403
    assert client.post("/tokenize").status_code == 403


@pytest.mark.parametrize("host", ["10.0.0.5", "192.168.1.20", "2001:db8::1", "testclient"])
def test_other_hosts_never_reach_control_routes(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    client = client_from(host, monkeypatch)
    headers = {"Authorization": f"Bearer {KEY}"}
    assert client.post("/collective_rpc", headers=headers).status_code == 403
    assert client.post("/pause", headers=headers).status_code == 403
    # Under /v1/ but control: loading an adapter reads any path the caller names.
    assert client.post("/v1/load_lora_adapter", headers=headers).status_code == 403
    assert client.post("/v1/unload_lora_adapter", headers=headers).status_code == 403


def test_public_routes_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    client = client_from("10.0.0.5", monkeypatch)
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions").status_code == 200  # vLLM itself checks the key here


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback(None)
