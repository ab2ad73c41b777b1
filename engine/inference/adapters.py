"""Serving one lineage of LoRA adapters on vLLM servers, a name of its own per version.

vLLM keys its prefix cache by adapter name, so a new name can never be served KV computed
under older weights, and no cache reset (which would preempt every request) is needed;
`load_inplace` would re-read the adapter on every step (vllm#33791). Requests already running
finish on the adapter they named. The pool's own lineage and each tenant of a shared pool
(`engine.inference.attached`) each have an `AdapterLineage`, so a tenant's swap never touches
another tenant's adapters.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from engine.config.inference import SLOTS_PER_LINEAGE
from engine.inference.control import ReloadError, ServedWeightsMismatchError, expect_ok
from engine.inference.endpoint import Endpoint
from engine.inference.reload_ext import commit_meta

#: Versions a lineage keeps loaded: the one served and the one before, for a request that
#: named it just before the swap (the one being added makes `SLOTS_PER_LINEAGE`).
KEEP = SLOTS_PER_LINEAGE - 1
#: Between a lineage's name and the version in an adapter's name: `<lineage>@v<version>-<uid>`.
SEPARATOR = "@v"


def served_adapters(http: httpx.Client) -> dict[str, str | None]:
    """Adapter (and model) name → the folder it was loaded from, as a server lists them."""
    response = http.get("/v1/models")
    expect_ok(response, "models")
    return {card["id"]: card.get("root") for card in response.json().get("data", [])}


def unload(http: httpx.Client, name: str) -> None:
    """Unload `name` (best effort: a server that lost it has nothing to unload)."""
    with contextlib.suppress(httpx.HTTPError):
        http.post("/v1/unload_lora_adapter", json={"lora_name": name})


class AdapterLineage:
    """The adapters of one lineage (`prefix`) on every server, newest last."""

    def __init__(
        self,
        prefix: str,
        control: Callable[[], Sequence[httpx.Client]],
        endpoints: Sequence[Endpoint],
        *,
        verify: bool = False,
        retire: Callable[[set[Path]], None] = lambda _: None,
    ) -> None:
        """`control` opens one control client a server (`endpoints`' order); `retire` is told
        of local folders no loaded adapter needs any more (fetched copies to delete)."""
        self.prefix = prefix
        self._control = control
        self.endpoints = endpoints
        self.verify = verify
        self._retire = retire
        #: (name, folder) of the versions loaded, newest last.
        self.loaded: list[tuple[str, Path]] = []
        self.held_uid: str | None = None

    def name(self, version: int, uid: str) -> str:
        return f"{self.prefix}{SEPARATOR}{version}-{uid[:8]}"

    def swap(self, location: str, folder: Path, version: int) -> int:
        """Serve adapter `folder` as policy `version` on every server, without a pause.

        Each endpoint names the new adapter before it reports the new version, so no sample
        is stamped with a version newer than its weights. A failed load unloads the new name
        where it was loaded and raises `ReloadError`, the servers on their previous one.
        """
        meta = commit_meta(folder)
        uid = meta.get("uid") or hashlib.sha256(bytes(folder.resolve())).hexdigest()
        name = self.name(version, str(uid))
        clients = self._control()
        try:
            self._load(clients, location, name, folder)
            for endpoint in self.endpoints:
                endpoint.model = name
                endpoint.serve(version, meta)
            self.loaded.append((name, folder))
            self.held_uid = str(uid)
            if self.verify:
                self._verify(clients, name, folder)
            retired, self.loaded = self.loaded[:-KEEP], self.loaded[-KEEP:]
            for old, _ in retired:
                for http in clients:
                    unload(http, old)
        finally:
            for http in clients:
                http.close()
        self._retire({f for _, f in retired} - {f for _, f in self.loaded})
        return version

    def _load(
        self, clients: Sequence[httpx.Client], location: str, name: str, folder: Path
    ) -> None:
        """Load `folder` as `name` on every server at once (each stops generating while it
        adds the adapter, so one after another would stop the pool for the sum)."""
        body = {"lora_name": name, "lora_path": str(folder.resolve())}

        def load(http: httpx.Client) -> str | None:
            try:
                expect_ok(http.post("/v1/load_lora_adapter", json=body), "load_lora_adapter")
            except (httpx.HTTPError, ReloadError) as exc:
                return str(exc) or type(exc).__name__
            return None

        with ThreadPoolExecutor(max_workers=len(clients)) as executor:
            errors = list(executor.map(load, clients))
        failed = [(index, error) for index, error in enumerate(errors) if error is not None]
        if not failed:
            return
        for http, error in zip(clients, errors, strict=True):
            if error is None:
                unload(http, name)
        index, error = failed[0]
        version = self.endpoints[0].policy_version if self.endpoints else 0
        raise ReloadError(
            f"loading adapter {location} failed on server {index}: {error}; all servers "
            f"still serve policy version {version}"
        )

    def _verify(self, clients: Sequence[httpx.Client], name: str, folder: Path) -> None:
        """Every server lists adapter `name` as loaded from `folder` (vLLM's `/v1/models`)."""
        for index, http in enumerate(clients):
            roots = served_adapters(http)
            if roots.get(name) != str(folder.resolve()):
                raise ServedWeightsMismatchError(
                    f"server {index} does not serve adapter {name} from {folder}: it lists {roots}"
                )

    def unload_all(self) -> None:
        """Unload every adapter of this lineage that any server lists (its previous owners'
        too: a tenant that died left its adapters loaded)."""
        clients = self._control()
        try:
            for http in clients:
                with contextlib.suppress(httpx.HTTPError, ReloadError):
                    for name in served_adapters(http):
                        if name.startswith(f"{self.prefix}{SEPARATOR}"):
                            unload(http, name)
        finally:
            for http in clients:
                http.close()
        self._retire({f for _, f in self.loaded})
        self.loaded = []
