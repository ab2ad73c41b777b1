"""The inference pool's servers: N vLLM processes for one model, started, supervised, stopped.

The fleet owns its servers' process groups (recorded in `<log_dir>/inference-pool.json` so a
supervisor can kill them even if this object is lost) and streams each server's log to
`<log_dir>/inference-<i>.log`. The servers also die on their own when the process that started
the fleet dies (see `engine.inference.launch`). What they serve is `engine.inference.weight_sync`'s
business; `engine.inference.pool` puts the two together.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from engine.config.inference import InferenceConfig
from engine.config.model import looks_like_path
from engine.inference.control import (
    ReloadError,
    control_client,
    expect_ok,
)
from engine.inference.endpoint import Endpoint
from engine.inference.ports import free_port
from engine.inference.server import ServerProcess, ServerSpec, ServerStartError
from engine.inference.weight_folders import served_model_folder
from engine.models.resolve import ModelPathError, resolve_model
from engine.models.tiny import default_cache_dir

POOL_RECORD = "inference-pool.json"
_PORT_IN_USE = "port already in use"
VERSION_METHOD = "primeflow_version"


class InferencePoolError(RuntimeError):
    """The pool could not start, or a server failed; the message says which and why."""


def serving_device(config: InferenceConfig) -> str:
    """Where the servers run: `config.device`, with auto resolved (CUDA when a GPU is visible)."""
    if config.device != "auto":
        return config.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class ServerFleet:
    """vLLM OpenAI-compatible servers for one model: their processes, endpoints and health."""

    def __init__(
        self,
        config: InferenceConfig,
        *,
        log_dir: Path,
        cache_dir: Path | None = None,
        revision: str | None = None,
    ) -> None:
        self.config = config
        self.log_dir = Path(log_dir)
        self.cache_dir = cache_dir or default_cache_dir()
        self.revision = revision
        key = config.api_key.get_secret_value() if config.api_key else None
        self.api_key = key or secrets.token_urlsafe(32)
        self.device = serving_device(config)
        self.endpoints: list[Endpoint] = []
        self.servers: list[ServerProcess] = []
        self._model_path: str | None = None
        self._served_folder: Path | None = None
        self._pipe_write: int | None = None
        self._pipe_read: int | None = None

    @property
    def model_name(self) -> str:
        """The name clients send as `model` (the configured name, not the resolved path)."""
        return self.config.model

    @property
    def model_path(self) -> str | None:
        """The model the servers started from, resolved (None until started)."""
        return self._model_path

    @property
    def process_groups(self) -> dict[str, int]:
        """`inference-<i>` → process group id of each running server, for supervisors."""
        return {f"inference-{s.spec.index}": s.pgid for s in self.servers}

    @property
    def policy_version(self) -> int:
        """The oldest policy any server serves (all equal between reloads)."""
        return min((e.policy_version for e in self.endpoints), default=0)

    def exited(self) -> dict[str, int]:
        """`inference-<i>` → exit status of each server that is no longer running."""
        return {
            f"inference-{s.spec.index}": code
            for s in self.servers
            if (code := s.process.poll()) is not None
        }

    def start(self) -> None:
        """Start every server and wait until all are ready; on any failure stop them all.

        Servers on GPUs of their own start at once. A server that shares a GPU with an
        earlier one starts after that one is ready: vLLM sizes its KV cache from the whole
        device's free memory, so a neighbour loading at the same time is charged to it
        (vllm-project/vllm#55827: "No available memory for the cache blocks")."""
        if self.servers:
            raise InferencePoolError("the pool is already running")
        model = self._resolve_model()
        self._pipe_read, self._pipe_write = os.pipe()
        try:
            started = time.monotonic()
            for index in range(self.config.num_servers):
                spec = self.spec(index, model)
                for earlier in self.servers:  # a ready server answers its first poll
                    if earlier.spec.shares_gpu_with(spec):
                        self._wait_ready(earlier.spec.index, started)
                self.servers.append(self._launch(spec))
            for index in range(self.config.num_servers):
                self._wait_ready(index, started)
            self.endpoints = [
                Endpoint(index=s.spec.index, base_url=s.spec.base_url, model=self.model_name)
                for s in self.servers
            ]
            for server in self.servers:
                with self.control(server) as http:
                    confirm_version(self.rpc(http, VERSION_METHOD), 0)
        except (ReloadError, httpx.HTTPError) as exc:
            self.stop()
            raise InferencePoolError(f"a server started but did not take commands: {exc}") from exc
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(self._pipe_read)
            self._pipe_read = None
        self._write_record("running")

    def stop(self) -> None:
        """End every process group this pool started; safe to call more than once."""
        servers, self.servers = self.servers, []
        with ThreadPoolExecutor(max_workers=max(1, len(servers))) as executor:
            list(executor.map(ServerProcess.stop, servers))
        if self._pipe_write is not None:
            os.close(self._pipe_write)
            self._pipe_write = None
        if servers:
            self._write_record("stopped", servers)
        self.endpoints = []

    # -- start-up --------------------------------------------------------------------------

    def _resolve_model(self) -> str:
        try:
            model = resolve_model(self.config.model, cache_dir=self.cache_dir)
        except ModelPathError as exc:
            raise InferencePoolError(str(exc)) from None
        if looks_like_path(model):
            model = str(Path(model).expanduser().resolve())
        self._model_path = model
        return model

    def spec(self, index: int, model: str, port: int | None = None) -> ServerSpec:
        config = self.config
        tp = config.tensor_parallel_size
        gpus = config.gpu_ids or list(range(config.num_servers * tp))
        if port is None:
            port = config.base_port + index if config.base_port else free_port(config.host)
        extra = list(config.extra_args)
        if self.revision and "--revision" not in extra:
            extra += ["--revision", self.revision]
        return ServerSpec(
            index=index,
            model=model,
            served_name=self.model_name,
            host=config.host,
            port=port,
            api_key=self.api_key,
            max_model_len=config.max_model_len,
            dtype=config.dtype,
            seed=config.seed,
            logprobs_mode=config.logprobs_mode,
            device=self.device,
            kv_cache_gb=config.kv_cache_gb,
            gpu_memory_utilization=config.gpu_memory_utilization,
            tensor_parallel_size=tp,
            gpu_ids=tuple(gpus[index * tp : (index + 1) * tp]) if self.device == "cuda" else (),
            cpu_cores=config.cpu_cores[index] if config.cpu_cores else None,
            api_servers=config.api_servers,
            extra_args=tuple(extra),
            lora=config.lora,
        )

    def _launch(self, spec: ServerSpec) -> ServerProcess:
        assert self._pipe_read is not None
        log_path = self.log_dir / f"inference-{spec.index}.log"
        return ServerProcess.start(spec, log_path, self._pipe_read)

    def _wait_ready(self, index: int, started: float) -> None:
        """Wait for server `index`; a port taken by someone else gets one retry on a new port."""
        remaining = self.config.startup_timeout_s - (time.monotonic() - started)
        server = self.servers[index]
        try:
            server.wait_ready(max(remaining, 1.0))
        except ServerStartError as exc:
            if _PORT_IN_USE not in str(exc) or self.config.base_port:
                raise InferencePoolError(str(exc)) from None
            server.stop()
            assert self._pipe_read is not None
            self.servers[index] = self._launch(self.spec(index, server.spec.model, port=None))
            try:
                self.servers[index].wait_ready(max(remaining, 1.0))
            except ServerStartError as retry_exc:
                raise InferencePoolError(str(retry_exc)) from None

    def _write_record(self, status: str, servers: list[ServerProcess] | None = None) -> None:
        """`inference-pool.json`: who to kill if this process cannot (supervisors read it)."""
        record = {
            "status": status,
            "supervisor_pid": os.getpid(),
            "model": self.model_name,
            "servers": [
                {
                    "index": s.spec.index,
                    "pid": s.process.pid,
                    "pgid": s.pgid,
                    "url": s.spec.base_url,
                    "log": str(s.log_path),
                }
                for s in (servers if servers is not None else self.servers)
            ],
        }
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / POOL_RECORD
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)

    def served_folder(self) -> Path:
        """The local folder the servers started from: the reference for every checkpoint."""
        if self._served_folder is None:
            assert self._model_path is not None
            self._served_folder = served_model_folder(self._model_path, self.revision)
        return self._served_folder

    def rpc(self, http: httpx.Client, method: str, *args: str) -> list[dict[str, Any]]:
        """Call the reload extension's `method` on every worker of one server; their answers."""
        body = {"method": method, "args": list(args), "timeout": self.config.reload_timeout_s}
        response = http.post("/collective_rpc", json=body)
        expect_ok(response, method)
        results = response.json().get("results")
        if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
            raise ReloadError(f"{method} answered {response.text[:200]!r}, not one dict a worker")
        return results

    def control(self, server: ServerProcess) -> httpx.Client:
        """An HTTP client for a server's control routes (loopback + key, see `guard`)."""
        return control_client(server.spec.base_url, self.api_key, self.config.reload_timeout_s)


def confirm_version(results: list[dict[str, Any]], version: int) -> None:
    """Every worker of a server must report `version`: otherwise it does not serve it."""
    reported = [result.get("version") for result in results]
    if not reported or any(found != version for found in reported):
        raise ReloadError(f"workers report versions {reported}, expected {version}")
