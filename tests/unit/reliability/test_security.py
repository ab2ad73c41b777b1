"""Security defaults: loopback binds, API keys, loopback-only control routes, no pickles, no leaks.

Each is a default someone could break in one line (a `host="0.0.0.0"`, a convenient
`torch.load`, a config dumped with its key), and none of them shows up in a functional test: the
run still works. So each is pinned here against the real code that builds the servers' command
lines, guards the routes, reads storage and writes a run's records.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from pathlib import Path

import pytest
import torch
from starlette.types import Message, Receive, Scope, Send

from engine.config import PrimeflowConfig
from engine.config.inference import InferenceConfig
from engine.inference.guard import API_KEY_ENV, ControlRouteGuard, is_loopback
from engine.inference.pool import InferencePool
from engine.run import open_run
from flows import server as prefect_server
from flows.cli import main
from storage.checkpoints import write_checkpoint
from storage.metrics import compact_metrics, write_metrics
from storage.shards import write_rollouts
from tests.fake_credentials import API_KEY, FAKE_ENV, leaks_in_files, leaks_in_text
from tests.unit.storage.samples import rows

REPO = Path(__file__).resolve().parents[3]
LOOPBACK = "127.0.0.1"

# ----------------------------------------------------------------------- (a) loopback binds


def test_inference_servers_bind_loopback_by_default(tmp_path: Path) -> None:
    config = InferenceConfig(model="/models/m", base_port=8100, device="cpu")
    assert config.host == LOOPBACK
    spec = InferencePool(config, log_dir=tmp_path).fleet.spec(0, "/models/m")
    argv = spec.argv()
    assert argv[argv.index("--host") + 1] == LOOPBACK
    assert spec.env({})["VLLM_HOST_IP"] == LOOPBACK
    assert spec.base_url == f"http://{LOOPBACK}:8100"


def test_the_whole_config_defaults_to_loopback() -> None:
    assert PrimeflowConfig().inference.host == LOOPBACK


def test_prefect_server_binds_loopback_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert prefect_server.DEFAULT_HOST == LOOPBACK
    assert inspect.signature(prefect_server.start).parameters["host"].default == LOOPBACK
    assert main(["server", "start", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["host"] == LOOPBACK


# ------------------------------------------------------------------------- (b) API keys


def test_a_key_is_generated_per_pool_when_none_is_configured(tmp_path: Path) -> None:
    config = InferenceConfig(model="/models/m", base_port=8100, device="cpu")
    first, second = InferencePool(config, log_dir=tmp_path), InferencePool(config, log_dir=tmp_path)
    assert len(first.api_key) >= 32
    assert first.api_key != second.api_key
    spec = first.fleet.spec(0, "/models/m")
    assert spec.env({})[API_KEY_ENV] == first.api_key  # vLLM requires it on /v1/...
    assert first.api_key not in spec.argv()  # not visible in `ps`


def test_a_configured_key_is_the_one_the_servers_require(tmp_path: Path) -> None:
    config = InferenceConfig(model="/m", base_port=8100, device="cpu", api_key="configured-key-1")
    pool = InferencePool(config, log_dir=tmp_path)
    spec = pool.fleet.spec(0, "/m")
    assert spec.env({})[API_KEY_ENV] == "configured-key-1"
    assert "--middleware" in spec.argv()  # the guard below is loaded into every server
    assert "configured-key-1" not in repr(config)


# ---------------------------------------------------------- (c) control routes: loopback only


async def _inner_app(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _status(path: str, client: str, key: str | None) -> int:
    """What the guard answers a real ASGI request from `client` for `path`."""
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope: Scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "root_path": "",
        "headers": headers,
        "client": (client, 40000),
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(ControlRouteGuard(_inner_app)(scope, receive, send))
    return int(sent[0]["status"])


CONTROL_ROUTES = ["/collective_rpc", "/pause", "/resume", "/update_weight_version", "/sleep"]
REMOTE_CLIENTS = ["10.0.0.5", "192.168.1.20", "8.8.8.8", "::ffff:10.0.0.5", "fe80::1", "0.0.0.0"]


@pytest.mark.parametrize("client", REMOTE_CLIENTS)
@pytest.mark.parametrize("route", CONTROL_ROUTES)
def test_control_routes_refuse_non_loopback_callers_even_with_the_key(
    route: str, client: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_KEY_ENV, "the-key-123")
    assert not is_loopback(client)
    assert _status(route, client, "the-key-123") == 403


@pytest.mark.parametrize("client", ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"])
def test_control_routes_serve_loopback_callers_with_the_key_only(
    client: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_KEY_ENV, "the-key-123")
    assert _status("/collective_rpc", client, "the-key-123") == 200
    assert _status("/collective_rpc", client, "wrong-key") == 403
    assert _status("/collective_rpc", client, None) == 403


def test_without_a_configured_key_control_routes_are_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert _status("/collective_rpc", "127.0.0.1", "") == 403


# ------------------------------------------------------------------------ (d) no unpickling

SHIPPED = ["engine", "storage", "tasks", "flows"]
FORBIDDEN = [
    (re.compile(r"\bpickle\.loads?\("), "pickle.load"),
    (re.compile(r"\bcloudpickle\b"), "cloudpickle"),
    (re.compile(r"\bdill\b"), "dill"),
    (re.compile(r"\bjoblib\.load\("), "joblib.load"),
    (re.compile(r"\bnp\.load\([^)]*allow_pickle\s*=\s*True"), "np.load(allow_pickle=True)"),
]
_TORCH_LOAD = re.compile(r"\btorch\.load\(")


def _torch_load_calls(text: str) -> list[str]:
    """Each `torch.load(...)` call's argument text, balanced across lines."""
    calls = []
    for match in _TORCH_LOAD.finditer(text):
        depth, end = 1, match.end()
        while depth and end < len(text):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        calls.append(text[match.end() : end - 1])
    return calls


def test_no_shipped_code_unpickles_data() -> None:
    problems = []
    files = [p for folder in SHIPPED for p in (REPO / folder).rglob("*.py")]
    assert len(files) > 50  # the scan really saw the code
    for path in files:
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(REPO)
        problems += [f"{where}: {name}" for pattern, name in FORBIDDEN if pattern.search(text)]
        for args in _torch_load_calls(text):
            if not re.search(r"weights_only\s*=\s*True", args):
                problems.append(f"{where}: torch.load({args.strip()}) without weights_only=True")
    assert problems == []


def test_the_scan_catches_what_it_forbids() -> None:
    assert _torch_load_calls("x = torch.load(\n  path,\n  map_location='cpu')\n") == [
        "\n  path,\n  map_location='cpu'"
    ]
    assert any(p.search("obj = pickle.loads(data)") for p, _ in FORBIDDEN)
    assert any(p.search("import dill") for p, _ in FORBIDDEN)


# ------------------------------------------------------------- (e) no credentials in outputs


def test_no_credential_reaches_any_file_a_run_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in FAKE_ENV.items():
        monkeypatch.setenv(name, value)
    config = PrimeflowConfig.model_validate(
        {
            "run": {"name": "leak-check"},
            "storage": {"uri": f"file://{tmp_path}/runs"},
            "inference": {"api_key": API_KEY},
            "seq_len": 64,
        }
    )
    command = ["primeflow", "rl", "--inference.api-key", API_KEY, f"--wandb.key={API_KEY}"]
    run = open_run(config, command=command)
    write_metrics(run.store, "rl", 1, {"reward/mean": 0.5, "loss": 1.25})
    write_metrics(run.store, "sft", 1, {"loss": 2.0})
    compact_metrics(run.store)
    write_rollouts(run.store, 1, rows(4, step=1))
    weights = {"model.embed_tokens.weight": torch.zeros(4, 2)}
    write_checkpoint(
        run.store, 1, weights=weights, config={"model_type": "qwen3"}, progress={"step": 1}
    )
    # What Prefect records as the flow's parameters is the config's JSON form.
    parameters = json.dumps(config.model_dump(mode="json"))

    written = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert {p.name for p in written} >= {"manifest.json", "metrics.jsonl", "_COMMITTED"}
    leaks = leaks_in_files(written, tmp_path) + leaks_in_text(parameters, "parameters")
    assert leaks == []
    manifest = json.loads((tmp_path / "runs" / "leak-check" / "manifest.json").read_text())
    assert manifest["config"]["inference"]["api_key"] != API_KEY
