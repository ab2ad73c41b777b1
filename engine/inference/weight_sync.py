"""Weight sync for an inference pool: swap committed checkpoints, policy versions and LoRA
adapters into every server of a fleet (`engine.inference.fleet`) without a restart.

A full version is checked against the served model before any server is touched; a delta
version goes to servers that hold its base, else the chain from its full version; a LoRA
adapter is loaded beside the base under a new name (`engine.inference.adapters`). If one server
fails, the servers that had switched are switched back, so the pool never serves a mix.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from engine.config.run import StorageConfig
from engine.inference.adapters import AdapterLineage
from engine.inference.checkpoints import check_compatible
from engine.inference.control import (
    ReloadError,
    ServedWeightsMismatchError,
    ServerDiedError,
    expect_ok,
    named_version,
    pause_generation,
    unloadable,
)
from engine.inference.diagnose import failure_cause
from engine.inference.fleet import ServerFleet, confirm_version
from engine.inference.server import ServerProcess
from engine.inference.weight_folders import commit_meta, is_delta
from engine.local_checkpoints import (
    adapter_copies_dir,
    forget_fetched,
    local_checkpoint,
    version_chain,
)
from storage.checkpoints import base_model_of, is_adapter

_RELOAD_METHOD = "primeflow_reload"
_STAGE_METHOD = "primeflow_stage"
_COMPARE_METHOD = "primeflow_compare"
#: How often a server is asked whether it has unpacked a reload's deltas, and how long at most
#: the pause waits for it (the load then unpacks what is left itself).
_STAGE_POLL_S = 0.005
_STAGE_WAIT_S = 10.0


class WeightSync:
    """What every server of `fleet` serves, and how it changes."""

    def __init__(self, fleet: ServerFleet, storage: StorageConfig | None = None) -> None:
        """`storage` is the run's: policy versions and checkpoints named by URI are read
        with its endpoint and region."""
        self.fleet = fleet
        self.storage = storage
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
        #: Delta folders the servers' workers had unpacked before the pause, all servers
        #: (counted from each server's reload thread, under its own lock).
        self.unpacked_ahead = 0
        self._count_lock = threading.Lock()
        #: Where the last reload's time went, in seconds: `fetch` (the chain into the local
        #: cache, hashes checked), then the slowest server's `stage` (its deltas unpacked
        #: while it still generates) and `paused` (its whole pause), which is `pause_call`
        #: (until generation stopped), `load`, `reset` (the KV cache dropped, the served
        #: version recorded) and `resume_call`. The orchestrator reports them per step; a
        #: slow swap is otherwise one number with no culprit.
        self.last_swap: dict[str, float] = {}
        self._server_swaps: dict[int, dict[str, float]] = {}

    def reset(self) -> None:
        """Forget what the servers held: they were stopped (a start serves the model again)."""
        self._current_chain, self._held_uid, self._adapters = [], None, None
        self._base = None

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
        if not self.fleet.servers:
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
            slowest = max(
                self._server_swaps.values(), key=lambda s: s["stage"] + s["paused"], default={}
            )
            self.last_swap = {"fetch": fetched, **slowest}
            return served

    def _local_chain(self, location: str, held_uid: str | None) -> list[Path]:
        """Local folders of `location`'s chain, full ones checked against the served model."""
        folders = [
            local_checkpoint(entry, self.fleet.cache_dir, self.storage)
            for entry in version_chain(location, held_uid, self.storage)
        ]
        for folder in folders:
            if not is_delta(commit_meta(folder)) and not is_adapter(folder):
                check_compatible(self.fleet.served_folder(), folder)
        return folders

    def _swap_adapter(self, location: str, folder: Path, version: int) -> int:
        """Serve LoRA adapter `folder` as policy `version` beside the base, without a pause
        (`engine.inference.adapters`), once the servers hold the base it was trained on."""
        self._serve_base(location, base_model_of(folder), version)
        if self._adapters is None:
            self._adapters = AdapterLineage(
                self.fleet.model_name,
                lambda: [self.fleet.control(server) for server in self.fleet.servers],
                self.fleet.endpoints,
                copies=adapter_copies_dir(self.fleet.cache_dir),
                verify=self.fleet.config.verify_reloads,
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
        wanted = None if base in (None, self.fleet.config.model, self.fleet.model_path) else base
        if wanted == self._base:
            return
        if wanted is None:
            self._reload_all(str(self.fleet.served_folder()), [self.fleet.served_folder()], version)
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
        previous_version = self.fleet.policy_version
        previous_chain = self._current_chain or [self.fleet.served_folder()]
        self._held_uid = None  # until every server reports the version it holds
        with ThreadPoolExecutor(max_workers=len(self.fleet.servers)) as executor:
            outcomes = list(
                executor.map(
                    lambda server: self._try_reload(server, folders, version), self.fleet.servers
                )
            )
        failed = [
            (s, error) for s, (error, _) in zip(self.fleet.servers, outcomes, strict=True) if error
        ]
        if not failed:
            starts_full = not is_delta(commit_meta(folders[0]))
            chain = folders if starts_full else [*self._current_chain, *folders]
            self._forget_fetched(set(self._current_chain) - set(chain))
            self._current_chain = chain
            held = {holds for _, holds in outcomes}
            self._held_uid = held.pop() if len(held) == 1 else None
            if self.fleet.config.verify_reloads:
                self._verify(location, self._current_chain)
            return version
        for server, (error, _) in zip(self.fleet.servers, outcomes, strict=True):
            if error is None:
                self._reload_server(server, previous_chain, previous_version)
        server, error = failed[0]
        dead = [s for s in self.fleet.servers if s.process.poll() is not None]
        if dead:
            causes = [
                f"inference server {s.spec.index} is not running "
                f"({failure_cause(s.log_text(), s.process.returncode)}; log: {s.log_path})"
                for s in dead
            ]
            if len(dead) < len(self.fleet.servers):
                causes.append(f"the other servers still serve policy version {previous_version}")
            raise ServerDiedError(f"reload of {location} failed: {'; '.join(causes)}")
        raise ReloadError(
            f"reload of {location} failed on server {server.spec.index}: {error}; "
            f"all servers still serve policy version {previous_version}"
        )

    def _forget_fetched(self, folders: set[Path]) -> None:
        forget_fetched(self.fleet.cache_dir, folders)

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
        """Unpack the deltas, pause (in-flight requests freeze), load, drop every cached KV
        block, resume.

        Each worker reports the version it loaded: that is the proof the server took it, on
        every vLLM release. The prefix cache and the KV of paused requests were computed by the
        old weights, so they are reset with the running requests preempted: those recompute
        their context under the new weights when generation resumes, and no sample ever mixes
        KV of two policies (its sampled tokens keep the oldest policy version, as recorded).
        The pause itself clears nothing (`clear_cache=false`): vLLM releases differ there, and
        one explicit reset after the load is the same on all of them. Returns the uid of the
        version the workers can apply the next delta to (None unless they all hold the same).
        """
        endpoint = self.fleet.endpoints[server.spec.index]
        with self.fleet.control(server) as http:
            staging = time.monotonic()
            self._stage(http, folders)
            paused = time.monotonic()
            pause_generation(http)
            try:
                loading = time.monotonic()
                results = self.fleet.rpc(http, _RELOAD_METHOD, str(version), *map(str, folders))
                resetting = time.monotonic()
                confirm_version(results, version)
                _reset_kv_cache(http)
                endpoint.serve(version, commit_meta(folders[-1]))
            finally:
                resuming = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    http.post("/resume")
        ended = time.monotonic()
        swap = {
            "stage": paused - staging,
            "pause_call": loading - paused,
            "load": resetting - loading,
            "reset": resuming - resetting,
            "resume_call": ended - resuming,
            "paused": ended - paused,
        }
        self._server_swaps[server.spec.index] = swap
        with self._count_lock:
            self.unpacked_ahead += sum(int(r.get("unpacked_ahead", 0)) for r in results)
        held = {result.get("holds") for result in results}
        return held.pop() if len(held) == 1 else None

    def _stage(self, http: httpx.Client, folders: list[Path]) -> None:
        """Have the server unpack the chain's deltas before it pauses (`primeflow_stage`):
        generation goes on meanwhile, where the pause would stop it."""
        if not any(is_delta(commit_meta(folder)) for folder in folders):
            return
        deadline = time.monotonic() + _STAGE_WAIT_S
        names = [str(folder) for folder in folders]
        while time.monotonic() < deadline:
            if all(result.get("ready") for result in self.fleet.rpc(http, _STAGE_METHOD, *names)):
                return
            time.sleep(_STAGE_POLL_S)

    def compare_served(self, checkpoint: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """Each server's bit-for-bit comparison of its served weights with `checkpoint`.

        One report per worker (see `reload_ext.compare_served`): `compared`, `mismatched`,
        `max_abs_diff`, `packed_away`, `version`. A check for tests and audits, not the hot path.
        """
        with self._reload_lock:
            return self._compare(self._local_chain(os.fspath(checkpoint), None))

    def _compare(self, folders: list[Path]) -> list[dict[str, Any]]:
        reports: list[dict[str, Any]] = []
        for server in self.fleet.servers:
            with self.fleet.control(server) as http:
                reports += self.fleet.rpc(http, _COMPARE_METHOD, *map(str, folders))
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


def _reset_kv_cache(http: httpx.Client) -> None:
    """Drop the prefix cache and the KV of paused requests (they are preempted, recomputed)."""
    response = http.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
    expect_ok(response, "reset_prefix_cache")
    if response.json().get("success") is not True:
        raise ReloadError(f"reset_prefix_cache did not succeed: {response.text[:200]}")
