"""Serving one lineage of LoRA adapters on vLLM servers, a name of its own per version.

vLLM keys its prefix cache by adapter name, so a new name can never be served KV computed
under older weights, and no cache reset (which would preempt every request) is needed;
`load_inplace` would re-read the adapter on every step (vllm#33791). Requests already running
finish on the adapter they named. The pool's own lineage and each tenant of a shared pool
(`engine.tenancy.attached`) each have an `AdapterLineage`, so a tenant's swap never touches
another tenant's adapters.

A name is `<lineage>@v<version>-<uid>`: the uid is drawn anew for every publication, so a
version number that a resumed trainer publishes again gets a new name. Two rules keep such a
restart from reaching the servers (issue 34: a loaded adapter whose folder the resumed trainer
deleted and rewrote killed the server, and the rollback's reload was refused as loaded twice):

- **Servers read private copies.** vLLM reads an adapter's folder again whenever it brings it
  back into its cache, long after the load; a run's `policies/step_N` is deleted and written
  again by a trainer that resumed before N. So each version is loaded from a copy of its own,
  verified as it is copied, which only this lineage deletes, one swap after unloading it
  (requests sent before that swap may still bring it back).
- **A rollback unloads what it rolled back.** Versions only grow while one trainer publishes
  them; serving version N again (or one before it) means the versions served past N were
  abandoned, and they are unloaded from every server (`superseded`), as are, once a version of
  a resumed trainer is served, the versions another trainer published past the checkpoint it
  resumed from (each version's commit names the trainer start that published it). A version
  this lineage still holds (the checkpoint's own, loaded before the restart) is served again
  without a second load, and a server that holds a name already (a previous attempt of the
  tenant left it) takes the load as done (`load_once`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import shutil
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.config.inference import SLOTS_PER_LINEAGE
from engine.inference.control import ReloadError, ServedWeightsMismatchError, expect_ok
from engine.inference.endpoint import Endpoint
from engine.inference.weight_folders import commit_meta
from storage.checkpoints import copy_local_checkpoint
from storage.commit import MARKER
from storage.errors import CorruptObjectError, NotCommittedError

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


def load_once(http: httpx.Client, name: str, folder: str) -> None:
    """Load adapter `name` from `folder` on one server, idempotently.

    vLLM refuses a name it holds already (400). Held from `folder`, the load is done; held
    from another folder (a dead attempt's copy: the same uid, so the same weights), it is
    loaded again from `folder`, the copy this lineage keeps readable. Raises `ReloadError`.
    """
    body = {"lora_name": name, "lora_path": folder}
    response = http.post("/v1/load_lora_adapter", json=body)
    if response.status_code == 200:
        return
    held = served_adapters(http)
    if name not in held:
        expect_ok(response, "load_lora_adapter")
    if held[name] == folder:
        return
    unload(http, name)
    expect_ok(http.post("/v1/load_lora_adapter", json=body), "load_lora_adapter")


def unload_lineage(prefix: str, control: Callable[[], Sequence[httpx.Client]]) -> None:
    """Unload every adapter of lineage `prefix` that any server lists (its previous owners'
    too: a tenant that died left its adapters loaded); `control` opens a client a server."""
    clients = control()
    try:
        for http in clients:
            with contextlib.suppress(httpx.HTTPError, ReloadError):
                for name in served_adapters(http):
                    if name.startswith(f"{prefix}{SEPARATOR}"):
                        unload(http, name)
    finally:
        for http in clients:
            http.close()


#: The trainer start that published a version: its `lineage_id` and the step it resumed from
#: (`lineage`), as its commit meta names them (`engine.trainer.publish`).
Publisher = tuple[str, int]


def publisher_of(meta: dict[str, object]) -> Publisher | None:
    """The trainer start that published a version with commit meta `meta`; None for a folder
    that names none (a resume checkpoint, a bare adapter)."""
    lineage_id, start = meta.get("lineage_id"), meta.get("lineage")
    return (str(lineage_id), start) if lineage_id and isinstance(start, int) else None


@dataclass(frozen=True)
class Served:
    """One version a lineage has loaded: its name, its version, the folder servers read and
    the trainer start that published it."""

    name: str
    version: int
    folder: Path
    publisher: Publisher | None = None


def superseded(
    loaded: Sequence[Served], name: str, version: int, publisher: Publisher | None = None
) -> list[Served]:
    """What serving `name` as policy `version`, published by `publisher`, rolls back: every
    other loaded version numbered `version` or later (a lineage moves forward unless its
    trainer resumed from an older checkpoint, which abandons what it had published past it),
    and every one that another trainer start published past the step `publisher` resumed
    from (what a dead trainer published past its checkpoint, even once the resumed one has
    published past those numbers again)."""
    return [
        served
        for served in loaded
        if served.name != name
        and (
            served.version >= version
            or (
                publisher is not None
                and served.publisher != publisher
                and served.version > publisher[1]
            )
        )
    ]


class AdapterLineage:
    """The adapters of one lineage (`prefix`) on every server, newest last."""

    def __init__(
        self,
        prefix: str,
        control: Callable[[], Sequence[httpx.Client]],
        endpoints: Sequence[Endpoint],
        *,
        copies: Path,
        verify: bool = False,
        retire: Callable[[set[Path]], None] = lambda _: None,
    ) -> None:
        """`control` opens one control client a server (`endpoints`' order); the servers read
        this lineage's copies in a folder of its own below `copies`; `retire` is told of
        local folders that were copied (fetched copies to delete)."""
        self.prefix = prefix
        self._control = control
        self.endpoints = endpoints
        self.verify = verify
        self._retire = retire
        self._copies = copies / uuid.uuid4().hex
        #: Numbers the copies: a version unloaded and loaded again gets a new one (the old
        #: copy is deleted a swap after its unload).
        self._copy_count = itertools.count()
        #: The versions loaded, newest last.
        self.loaded: list[Served] = []
        self.held_uid: str | None = None
        #: Copies of the versions unloaded at the last swap, deleted at the next.
        self._unloaded: list[Path] = []

    def name(self, version: int, uid: str) -> str:
        return f"{self.prefix}{SEPARATOR}{version}-{uid[:8]}"

    def swap(self, location: str, folder: Path, version: int) -> int:
        """Serve adapter `folder` as policy `version` on every server, without a pause.

        Each endpoint names the new adapter before it reports the new version, so no sample
        is stamped with a version newer than its weights. A failed load unloads the new name
        where it was loaded and raises `ReloadError`, the servers on their previous one.
        Versions that this one rolls back (`superseded`) and the oldest beyond `KEEP` are
        unloaded from every server once it is served.
        """
        meta = commit_meta(folder)
        published = meta.get("uid")
        uid = str(published or hashlib.sha256(bytes(folder.resolve())).hexdigest())
        name = self.name(version, uid)
        publisher = publisher_of(meta)
        current = next((served for served in self.loaded if served.name == name), None)
        clients = self._control()
        try:
            if current is None:
                current = Served(name, version, self._copy(folder, uid, published), publisher)
                try:
                    self._load(clients, location, name, current.folder)
                except BaseException:
                    self._delete([current.folder])
                    raise
            for endpoint in self.endpoints:
                endpoint.model = name
                endpoint.serve(version, meta)
            dropped = superseded(self.loaded, name, version, publisher)
            kept = [s for s in self.loaded if s is not current and s not in dropped]
            self.loaded = [*kept, current]
            self.held_uid = uid
            if self.verify:
                self._verify(clients, name, current.folder)
            retired, self.loaded = self.loaded[:-KEEP], self.loaded[-KEEP:]
            for old in (*dropped, *retired):
                for http in clients:
                    unload(http, old.name)
        finally:
            for http in clients:
                http.close()
        self._delete(self._unloaded)
        self._unloaded = [old.folder for old in (*dropped, *retired)]
        return version

    def _copy(self, folder: Path, uid: str, published: object) -> Path:
        """The folder the servers load version `uid` from: a verified copy of `folder`'s
        committed files, whose marker must still carry the uid it `published` when it was
        named (a bare folder, outside any run, is nobody's to rewrite: as it is)."""
        if not (folder / MARKER).is_file():
            return folder.resolve()
        target = self._copies / f"{next(self._copy_count)}-{uid}"
        try:
            record = copy_local_checkpoint(folder, target)
        except (OSError, CorruptObjectError, NotCommittedError) as exc:
            raise ReloadError(f"cannot copy adapter {folder} to serve it: {exc}") from exc
        if record.meta.get("uid") != published:
            shutil.rmtree(target, ignore_errors=True)
            raise ReloadError(f"adapter {folder} was published again while it was copied")
        self._retire({folder})
        return target.resolve()

    def _delete(self, folders: Sequence[Path]) -> None:
        """Delete this lineage's copies among `folders` (never a bare folder served in place)."""
        for folder in folders:
            if folder.parent == self._copies.resolve():
                shutil.rmtree(folder, ignore_errors=True)

    def _load(
        self, clients: Sequence[httpx.Client], location: str, name: str, folder: Path
    ) -> None:
        """Load `folder` as `name` on every server at once (each stops generating while it
        adds the adapter, so one after another would stop the pool for the sum)."""

        def load(http: httpx.Client) -> str | None:
            try:
                load_once(http, name, str(folder))
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
            if roots.get(name) != str(folder):
                raise ServedWeightsMismatchError(
                    f"server {index} does not serve adapter {name} from {folder}: it lists {roots}"
                )

    def unload_all(self) -> None:
        """Unload every adapter of this lineage from every server (`unload_lineage`) and
        delete its copies: its owner is done with the servers."""
        unload_lineage(self.prefix, self._control)
        shutil.rmtree(self._copies, ignore_errors=True)
        self.loaded, self._unloaded = [], []
