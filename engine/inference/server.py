"""One vLLM server: its command line and environment, its process group, its readiness.

The pool decides what each server runs (model, port, devices); this module turns that into a
process that can be waited on, diagnosed from its log, and ended as a whole group.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine.config.inference import LoraServingConfig
from engine.inference.diagnose import failure_cause
from engine.inference.launch import API_SERVER_COUNT, RPC_DIR_ENV
from engine.inference.procs import group_members

EXTENSION = "engine.inference.reload_ext.WeightReloadExtension"
GUARD = "engine.inference.guard.ControlRouteGuard"
#: vLLM's CPU backend otherwise reserves `gpu_memory_utilization` × all RAM.
DEFAULT_CPU_KV_CACHE_GB = 1.0
_POLL_S = 0.5
_STOP_GRACE_S = 10.0


class ServerStartError(RuntimeError):
    """A server exited or timed out before it was ready; the message is the cause in one line."""


@dataclass(frozen=True)
class ServerSpec:
    """Everything one server needs; `argv()` and `env()` are its command line and environment."""

    index: int
    model: str
    served_name: str
    host: str
    port: int
    api_key: str
    max_model_len: int | None
    dtype: str
    seed: int
    logprobs_mode: str
    device: str
    kv_cache_gb: float | None
    gpu_memory_utilization: float
    tensor_parallel_size: int
    gpu_ids: tuple[int, ...] = ()
    cpu_cores: str | None = None
    #: API-server processes in front of the engine (`inference.api_servers`).
    api_servers: int = 1
    extra_args: tuple[str, ...] = ()
    #: Serve LoRA adapters loaded at run time (`engine.inference.adapters`).
    lora: LoraServingConfig | None = None

    @property
    def base_url(self) -> str:
        """Where clients reach this server (loopback when bound to every interface)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = "[::1]" if host == "::" else (f"[{host}]" if ":" in host else host)
        return f"http://{host}:{self.port}"

    def argv(self) -> list[str]:
        """vLLM api_server arguments (the API key is passed in the environment, not here)."""
        args = [
            "--model", self.model,
            "--served-model-name", self.served_name,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--seed", str(self.seed),
            "--logprobs-mode", self.logprobs_mode,
            "--worker-extension-cls", EXTENSION,
            "--middleware", GUARD,
        ]  # fmt: skip
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        kv_cache_gb = self.kv_cache_gb
        if self.device == "cpu" and kv_cache_gb is None:
            kv_cache_gb = DEFAULT_CPU_KV_CACHE_GB
        if kv_cache_gb is not None:
            args += ["--kv-cache-memory-bytes", str(int(kv_cache_gb * 2**30))]
        if self.device == "cuda":
            args += [
                "--gpu-memory-utilization", str(self.gpu_memory_utilization),
                "--tensor-parallel-size", str(self.tensor_parallel_size),
            ]  # fmt: skip
        if self.api_servers > 1:
            args += [API_SERVER_COUNT, str(self.api_servers)]
        if self.lora is not None:
            # Named layers only: left alone, vLLM also wraps the embeddings and the LM head.
            args += [
                "--enable-lora",
                "--max-lora-rank", str(self.lora.max_rank),
                "--max-loras", str(self.lora.max_loras),
                "--max-cpu-loras", str(self.lora.max_cpu_loras),
                "--lora-target-modules", *self.lora.target_modules,
            ]  # fmt: skip
        return [*args, *self.extra_args]

    def shares_gpu_with(self, other: ServerSpec) -> bool:
        """Whether the two servers are placed on a common GPU (never on CPU)."""
        return bool(set(self.gpu_ids) & set(other.gpu_ids))

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """The server's environment: dev routes on (behind the guard), key, device placement."""
        env = {
            **base,
            "VLLM_API_KEY": self.api_key,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "PYTHONUNBUFFERED": "1",
        }
        if self.device == "cuda" and self.gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in self.gpu_ids)
        if self.device == "cpu":
            # vLLM's CPU platform otherwise runs its one worker in a process of its own beside
            # the engine core: one more spawn and import of vLLM, ~10 s of every start on the
            # 2-core machine (29-30 s → 19-21 s), at the same sampling rate. On a GPU one worker
            # already runs inside the engine core.
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            if self.cpu_cores:
                env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_cores
        if self.lora is not None:  # the load/unload routes exist only with this set
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        return env


@dataclass
class ServerProcess:
    """A started server: the leader of its own process group, logging to `log_path`."""

    spec: ServerSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    #: The folder of the server's ZMQ sockets (`VLLM_RPC_BASE_PATH`), removed when it stops.
    rpc_dir: Path
    started_at: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, spec: ServerSpec, log_path: Path, parent_fd: int) -> ServerProcess:
        """Launch through `engine.inference.launch`, which ends the group when we die.

        vLLM puts its ZMQ sockets in the temp folder and never unlinks them: ~100 of them were
        left in /tmp by every test-suite run. Each server gets a folder of its own instead, short
        enough for a socket path (108 bytes), which `stop` (or `launch`, if we die) removes."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        rpc_dir = Path(tempfile.mkdtemp(prefix="primeflow-vllm-"))
        env = {
            **spec.env(dict(os.environ)),
            RPC_DIR_ENV: str(rpc_dir),
            "VLLM_RPC_BASE_PATH": str(rpc_dir),
        }
        command = [sys.executable, "-m", "engine.inference.launch", str(parent_fd), *spec.argv()]
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                pass_fds=(parent_fd,),
            )
        return cls(spec=spec, process=process, log_path=log_path, rpc_dir=rpc_dir)

    @property
    def pgid(self) -> int:
        """The process group id: the leader's pid, as `start_new_session` makes it."""
        return self.process.pid

    def log_text(self) -> str:
        """The server's log so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_ready(self, timeout_s: float) -> None:
        """Block until `/v1/models` answers with the key; raise `ServerStartError` otherwise."""
        deadline = time.monotonic() + timeout_s
        headers = {"Authorization": f"Bearer {self.spec.api_key}"}
        with httpx.Client(base_url=self.spec.base_url, headers=headers, timeout=5.0) as http:
            while True:
                returncode = self.process.poll()
                if returncode is not None:
                    cause = failure_cause(self.log_text(), returncode)
                    raise ServerStartError(f"inference server {self.spec.index}: {cause}")
                try:
                    if http.get("/v1/models").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"inference server {self.spec.index}: not ready after {timeout_s:.0f} s "
                        f"(log: {self.log_path})"
                    )
                time.sleep(_POLL_S)

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        """SIGTERM the whole group, SIGKILL what is left after `grace_s`, reap the leader."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            self.process.poll()
            if not group_members(self.pgid):
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, sig)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                self.process.poll()
                if not group_members(self.pgid):
                    break
                time.sleep(0.1)
        self.process.poll()
        shutil.rmtree(self.rpc_dir, ignore_errors=True)
