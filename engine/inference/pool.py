"""The inference pool: N vLLM servers for one model, started, supervised, reloaded, stopped.

One pool lives for a whole pipeline run. It owns its servers' process groups (recorded in
`<log_dir>/inference-pool.json` so a supervisor can kill them even if this object is lost),
streams each server's log to `<log_dir>/inference-<i>.log`, and swaps committed checkpoints
into every server without a restart. The servers also die on their own when the process that
started the pool dies (see `engine.inference.launch`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from engine.config import PrimeflowConfig
from engine.config.inference import InferenceConfig
from engine.config.model import looks_like_path
from engine.config.run import StorageConfig
from engine.inference.adapters import AdapterLineage
from engine.inference.checkpoints import check_compatible
from engine.inference.control import (
    ReloadError,
    ServedWeightsMismatchError,
    ServerDiedError,
    control_client,
    expect_ok,
    named_version,
    unloadable,
)
from engine.inference.diagnose import failure_cause
from engine.inference.endpoint import Endpoint
from engine.inference.ports import free_port
from engine.inference.reload_ext import commit_meta, is_delta, served_model_folder
from engine.inference.server import ServerProcess, ServerSpec, ServerStartError
from engine.local_checkpoints import (
    adapter_copies_dir,
    forget_fetched,
    local_checkpoint,
    version_chain,
)
from engine.models.resolve import ModelPathError, resolve_model
from engine.models.tiny import default_cache_dir
from storage.checkpoints import base_model_of, is_adapter

POOL_RECORD = "inference-pool.json"
_PORT_IN_USE = "port already in use"
_RELOAD_METHOD = "primeflow_reload"
_VERSION_METHOD = "primeflow_version"
_COMPARE_METHOD = "primeflow_compare"


class InferencePoolError(RuntimeError):
    """The pool could not start, or a server failed; the message says which and why."""


def _detect_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class InferencePool:
    """vLLM OpenAI-compatible servers for one model. Use as a context manager, or start/stop."""

    def __init__(
        self,
        config: InferenceConfig,
        *,
        log_dir: Path,
        cache_dir: Path | None = None,
        revision: str | None = None,
        storage: StorageConfig | None = None,
    ) -> None:
        """`storage` is the run's: policy versions and checkpoints named by URI are read
        with its endpoint and region."""
        if config.model is None:
            raise ValueError("inference.model is not set (it is filled from model.name)")
        self.config = config
        self.log_dir = Path(log_dir)
        self.cache_dir = cache_dir or default_cache_dir()
        self.revision = revision
        self.storage = storage
        key = config.api_key.get_secret_value() if config.api_key else None
        self.api_key = key or secrets.token_urlsafe(32)
        self.device = _detect_device() if config.device == "auto" else config.device
        self.endpoints: list[Endpoint] = []
        self._servers: list[ServerProcess] = []
        self._model_path: str | None = None
        self._served_folder: Path | None = None
        #: The folders the servers' weights were loaded from: a full version and the deltas
        #: after it (empty: the model they started with), and the uid of the version their
        #: workers hold a host copy of, to apply the next delta to (None: send a full one).
        self._current_chain: list[Path] = []
        self._held_uid: str | None = None
        #: The LoRA adapters the servers hold, once an adapter version is loaded.
        self._adapters: AdapterLineage | None = None
        #: Where the servers' whole weights were last reloaded from (None: the model they
        #: started with); an adapter trained on another base has that base brought in first.
        self._base: str | None = None
        # One reload at a time (fetch included): interleaved ones could mix versions across
        # servers or race for the same cache folder.
        self._reload_lock = threading.Lock()
        #: Parameters found bit-identical to their checkpoint by verified reloads, all servers.
        self.verified_tensors = 0
        #: Where the last reload's time went, in seconds: `fetch` (the chain into the local
        #: cache, hashes checked), `load` and `paused` (the slowest server's weight load, and
        #: its whole pause: load, KV reset and the pause and resume calls). The orchestrator
        #: reports them per step; a slow swap is otherwise one number with no culprit.
        self.last_swap: dict[str, float] = {}
        self._server_swaps: dict[int, dict[str, float]] = {}
        self._pipe_write: int | None = None
        self._pipe_read: int | None = None

    @classmethod
    def for_run(cls, config: PrimeflowConfig, log_dir: Path) -> InferencePool:
        """The pool of a run: its inference settings, model revision and storage."""
        return cls(
            config.inference,
            log_dir=log_dir,
            revision=config.model.revision,
            storage=config.storage,
        )

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> InferencePool:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def model_name(self) -> str:
        """The name clients send as `model` (the configured name, not the resolved path)."""
        assert self.config.model is not None
        return self.config.model

    @property
    def process_groups(self) -> dict[str, int]:
        """`inference-<i>` → process group id of each running server, for supervisors."""
        return {f"inference-{s.spec.index}": s.pgid for s in self._servers}

    @property
    def policy_version(self) -> int:
        """The oldest policy any server serves (all equal between reloads)."""
        return min((e.policy_version for e in self.endpoints), default=0)

    def exited(self) -> dict[str, int]:
        """`inference-<i>` → exit status of each server that is no longer running."""
        return {
            f"inference-{s.spec.index}": code
            for s in self._servers
            if (code := s.process.poll()) is not None
        }

    def start(self) -> None:
        """Start every server and wait until all are ready; on any failure stop them all.

        Servers on GPUs of their own start at once. A server that shares a GPU with an
        earlier one starts after that one is ready: vLLM sizes its KV cache from the whole
        device's free memory, so a neighbour loading at the same time is charged to it
        (vllm-project/vllm#55827: "No available memory for the cache blocks")."""
        if self._servers:
            raise InferencePoolError("the pool is already running")
        model = self._resolve_model()
        self._pipe_read, self._pipe_write = os.pipe()
        try:
            started = time.monotonic()
            for index in range(self.config.num_servers):
                spec = self._spec(index, model)
                for earlier in self._servers:  # a ready server answers its first poll
                    if earlier.spec.shares_gpu_with(spec):
                        self._wait_ready(earlier.spec.index, started)
                self._servers.append(self._launch(spec))
            for index in range(self.config.num_servers):
                self._wait_ready(index, started)
            self.endpoints = [
                Endpoint(index=s.spec.index, base_url=s.spec.base_url, model=self.model_name)
                for s in self._servers
            ]
            for server in self._servers:
                with self._control(server) as http:
                    _confirm_version(self._rpc(http, _VERSION_METHOD), 0)
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
        servers, self._servers = self._servers, []
        with ThreadPoolExecutor(max_workers=max(1, len(servers))) as executor:
            list(executor.map(ServerProcess.stop, servers))
        if self._pipe_write is not None:
            os.close(self._pipe_write)
            self._pipe_write = None
        if servers:
            self._write_record("stopped", servers)
        self.endpoints = []
        self._current_chain, self._held_uid, self._adapters = [], None, None
        self._base = None

    # -- start-up --------------------------------------------------------------------------

    def _resolve_model(self) -> str:
        assert self.config.model is not None
        try:
            model = resolve_model(self.config.model, cache_dir=self.cache_dir)
        except ModelPathError as exc:
            raise InferencePoolError(str(exc)) from None
        if looks_like_path(model):
            model = str(Path(model).expanduser().resolve())
        self._model_path = model
        return model

    def _spec(self, index: int, model: str, port: int | None = None) -> ServerSpec:
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
        server = self._servers[index]
        try:
            server.wait_ready(max(remaining, 1.0))
        except ServerStartError as exc:
            if _PORT_IN_USE not in str(exc) or self.config.base_port:
                raise InferencePoolError(str(exc)) from None
            server.stop()
            assert self._pipe_read is not None
            self._servers[index] = self._launch(self._spec(index, server.spec.model, port=None))
            try:
                self._servers[index].wait_ready(max(remaining, 1.0))
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
                for s in (servers if servers is not None else self._servers)
            ],
        }
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / POOL_RECORD
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)

    # -- weight reload ---------------------------------------------------------------------

    def _served(self) -> Path:
        """The local folder the servers started from: the reference for every checkpoint."""
        if self._served_folder is None:
            assert self._model_path is not None
            self._served_folder = served_model_folder(self._model_path, self.revision)
        return self._served_folder

    def reload(self, checkpoint: str | os.PathLike[str], version: int | None = None) -> int:
        """Swap `checkpoint` into every server and return the policy version now served.

        `checkpoint` is a resume checkpoint, a model folder or a policy version (full, or a
        delta: the servers are sent the deltas after the version they hold, or the chain from
        its full version). `version` defaults to the step in the `step_NNNNNN` name. Full
        folders are checked against the served model before any server is touched; if a
        server still fails, the servers that had switched are switched back, so the pool never
        serves a mix. Raises `ReloadError` with the servers on their previous weights
        (`BrokenVersionError` when the version's files or chain do not verify).
        """
        if not self._servers:
            raise ReloadError("the pool is not running")
        location = os.fspath(checkpoint)
        version = named_version(location, version)
        with self._reload_lock:
            started = time.monotonic()
            self.last_swap, self._server_swaps = {}, {}
            try:
                folders = self._local_chain(location, self._held_uid)
            except (OSError, ValueError) as exc:
                raise unloadable(location, exc) from exc
            if not folders:  # the servers hold this very version already
                return version
            fetched = time.monotonic() - started
            if is_adapter(folders[0]):
                return self._swap_adapter(location, folders[0], version)
            served = self._reload_all(location, folders, version)
            self._base = location
            slowest = max(self._server_swaps.values(), key=lambda s: s["paused"], default={})
            self.last_swap = {"fetch": fetched, **slowest}
            return served

    def _local_chain(self, location: str, held_uid: str | None) -> list[Path]:
        """Local folders of `location`'s chain, full ones checked against the served model."""
        folders = [
            local_checkpoint(entry, self.cache_dir, self.storage)
            for entry in version_chain(location, held_uid, self.storage)
        ]
        for folder in folders:
            if not is_delta(commit_meta(folder)) and not is_adapter(folder):
                check_compatible(self._served(), folder)
        return folders

    def _swap_adapter(self, location: str, folder: Path, version: int) -> int:
        """Serve LoRA adapter `folder` as policy `version` beside the base, without a pause
        (`engine.inference.adapters`), once the servers hold the base it was trained on."""
        self._serve_base(location, base_model_of(folder), version)
        if self._adapters is None:
            self._adapters = AdapterLineage(
                self.model_name,
                lambda: [self._control(server) for server in self._servers],
                self.endpoints,
                copies=adapter_copies_dir(self.cache_dir),
                verify=self.config.verify_reloads,
                retire=self._forget_fetched,
            )
        served = self._adapters.swap(location, folder, version)
        self._held_uid = self._adapters.held_uid
        return served

    def _serve_base(self, location: str, base: str | None, version: int) -> None:
        """Bring in `base`, what adapter `location` was trained on, unless the servers hold it:
        the model they started with (named as configured or by its folder) or the whole
        checkpoint last reloaded. A LoRA RL run on a full-weight SFT's result names that
        checkpoint: an evaluation of one of its adapters by a fresh pool loads it first."""
        wanted = None if base in (None, self.config.model, self._model_path) else base
        if wanted == self._base:
            return
        if wanted is None:
            self._reload_all(str(self._served()), [self._served()], version)
        else:
            try:
                folders = self._local_chain(wanted, None)
            except (OSError, ValueError) as exc:
                raise ReloadError(
                    f"adapter {location} was trained on {wanted}, which the servers cannot "
                    f"load: {exc}"
                ) from exc
            self._reload_all(wanted, folders, version)
        self._base = wanted

    def _reload_all(self, location: str, folders: list[Path], version: int) -> int:
        """Load `folders` into every server; on any failure put the switched ones back."""
        previous_version = self.policy_version
        previous_chain = self._current_chain or [self._served()]
        self._held_uid = None  # until every server reports the version it holds
        with ThreadPoolExecutor(max_workers=len(self._servers)) as executor:
            outcomes = list(
                executor.map(
                    lambda server: self._try_reload(server, folders, version), self._servers
                )
            )
        failed = [
            (s, error) for s, (error, _) in zip(self._servers, outcomes, strict=True) if error
        ]
        if not failed:
            starts_full = not is_delta(commit_meta(folders[0]))
            chain = folders if starts_full else [*self._current_chain, *folders]
            self._forget_fetched(set(self._current_chain) - set(chain))
            self._current_chain = chain
            held = {holds for _, holds in outcomes}
            self._held_uid = held.pop() if len(held) == 1 else None
            if self.config.verify_reloads:
                self._verify(location, self._current_chain)
            return version
        for server, (error, _) in zip(self._servers, outcomes, strict=True):
            if error is None:
                self._reload_server(server, previous_chain, previous_version)
        server, error = failed[0]
        dead = [s for s in self._servers if s.process.poll() is not None]
        if dead:
            causes = [
                f"inference server {s.spec.index} is not running "
                f"({failure_cause(s.log_text(), s.process.returncode)}; log: {s.log_path})"
                for s in dead
            ]
            if len(dead) < len(self._servers):
                causes.append(f"the other servers still serve policy version {previous_version}")
            raise ServerDiedError(f"reload of {location} failed: {'; '.join(causes)}")
        raise ReloadError(
            f"reload of {location} failed on server {server.spec.index}: {error}; "
            f"all servers still serve policy version {previous_version}"
        )

    def _forget_fetched(self, folders: set[Path]) -> None:
        forget_fetched(self.cache_dir, folders)

    def _try_reload(
        self, server: ServerProcess, folders: list[Path], version: int
    ) -> tuple[str | None, str | None]:
        """(error, None), or (None, the uid of the version its workers hold for deltas)."""
        try:
            return None, self._reload_server(server, folders, version)
        except (httpx.HTTPError, ReloadError) as exc:
            return str(exc), None

    def _reload_server(
        self, server: ServerProcess, folders: list[Path], version: int
    ) -> str | None:
        """Pause (in-flight requests freeze), load, drop every cached KV block, resume.

        Each worker reports the version it loaded: that is the proof the server took it, on
        every vLLM release. The prefix cache and the KV of paused requests were computed by the
        old weights, so they are reset with the running requests preempted: those recompute
        their context under the new weights when generation resumes, and no sample ever mixes
        KV of two policies (its sampled tokens keep the oldest policy version, as recorded).
        The pause itself clears nothing (`clear_cache=false`): vLLM releases differ there, and
        one explicit reset after the load is the same on all of them. Returns the uid of the
        version the workers can apply the next delta to (None unless they all hold the same).
        """
        endpoint = self.endpoints[server.spec.index]
        with self._control(server) as http:
            paused = time.monotonic()
            pause = http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
            expect_ok(pause, "pause")
            try:
                loading = time.monotonic()
                results = self._rpc(http, _RELOAD_METHOD, str(version), *map(str, folders))
                loaded = time.monotonic() - loading
                _confirm_version(results, version)
                _reset_kv_cache(http)
                endpoint.serve(version, commit_meta(folders[-1]))
            finally:
                with contextlib.suppress(httpx.HTTPError):
                    http.post("/resume")
        swap = {"load": loaded, "paused": time.monotonic() - paused}
        self._server_swaps[server.spec.index] = swap
        held = {result.get("holds") for result in results}
        return held.pop() if len(held) == 1 else None

    def _rpc(self, http: httpx.Client, method: str, *args: str) -> list[dict[str, Any]]:
        """Call the reload extension's `method` on every worker of one server; their answers."""
        body = {"method": method, "args": list(args), "timeout": self.config.reload_timeout_s}
        response = http.post("/collective_rpc", json=body)
        expect_ok(response, method)
        results = response.json().get("results")
        if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
            raise ReloadError(f"{method} answered {response.text[:200]!r}, not one dict a worker")
        return results

    def compare_served(self, checkpoint: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """Each server's bit-for-bit comparison of its served weights with `checkpoint`.

        One report per worker (see `reload_ext.compare_served`): `compared`, `mismatched`,
        `max_abs_diff`, `packed_away`, `version`. A check for tests and audits, not the hot path.
        """
        with self._reload_lock:
            return self._compare(self._local_chain(os.fspath(checkpoint), None))

    def _compare(self, folders: list[Path]) -> list[dict[str, Any]]:
        reports: list[dict[str, Any]] = []
        for server in self._servers:
            with self._control(server) as http:
                reports += self._rpc(http, _COMPARE_METHOD, *map(str, folders))
        return reports

    def _verify(self, location: str, folders: list[Path]) -> None:
        """Raise `ServedWeightsMismatchError` unless every server serves `folders`' weights."""
        reports = self._compare(folders)
        bad = [r for r in reports if r["mismatched"] or not r["compared"]]
        if bad:
            raise ServedWeightsMismatchError(
                f"after the reload of {location} a server serves other weights: {bad[0]}"
            )
        self.verified_tensors += sum(int(r["compared"]) for r in reports)

    def _control(self, server: ServerProcess) -> httpx.Client:
        """An HTTP client for a server's control routes (loopback + key, see `guard`)."""
        return control_client(server.spec.base_url, self.api_key, self.config.reload_timeout_s)


def _confirm_version(results: list[dict[str, Any]], version: int) -> None:
    """Every worker of a server must report `version`: otherwise it does not serve it."""
    reported = [result.get("version") for result in results]
    if not reported or any(found != version for found in reported):
        raise ReloadError(f"workers report versions {reported}, expected {version}")


def _reset_kv_cache(http: httpx.Client) -> None:
    """Drop the prefix cache and the KV of paused requests (they are preempted, recomputed)."""
    response = http.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
    expect_ok(response, "reset_prefix_cache")
    if response.json().get("success") is not True:
        raise ReloadError(f"reset_prefix_cache did not succeed: {response.text[:200]}")
