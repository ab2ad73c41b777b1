"""One tenant's view of a shared inference pool: the servers someone else started
(`primeflow pools up`), serving this tenant's adapters under names of its own.

It is what the orchestrator and the evaluation take in place of an `InferencePool`: the
same `endpoints`, `api_key`, `policy_version` and `reload`, but it starts and stops no
server, and its reloads load and unload only this tenant's adapters (`<run>@v<version>-...`),
never another tenant's, with no pause and no cache reset (`engine.inference.adapters`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx

from engine.config import PrimeflowConfig
from engine.config.inference import InferenceConfig
from engine.config.run import StorageConfig
from engine.inference.adapters import AdapterLineage
from engine.inference.control import ReloadError, control_client, named_version, unloadable
from engine.inference.endpoint import Endpoint
from engine.local_checkpoints import (
    adapter_copies_dir,
    forget_fetched,
    local_checkpoint,
    version_chain,
)
from engine.models.tiny import default_cache_dir
from engine.tenancy.files import PoolRecord
from storage.checkpoints import is_adapter


class AttachedPool:
    """Tenant `tenant`'s adapters on servers `urls` (which serve base model `model`)."""

    #: Parameters verified bit-identical so far: adapters are checked by name and folder only.
    verified_tensors = 0

    def __init__(
        self,
        tenant: str,
        *,
        model: str,
        urls: list[str],
        api_key: str,
        config: InferenceConfig,
        storage: StorageConfig | None = None,
        cache_dir: Path | None = None,
    ) -> None:
        self.config = config
        self.api_key = api_key
        self.storage = storage
        self.cache_dir = cache_dir or default_cache_dir()
        self.endpoints = [
            Endpoint(index=index, base_url=url, model=model) for index, url in enumerate(urls)
        ]
        self._urls = urls
        #: An adapter swap is not broken into phases (`PolicyServing.last_swap`).
        self.last_swap: dict[str, float] = {}
        self._lock = threading.Lock()
        self._adapters = AdapterLineage(
            tenant,
            self._clients,
            self.endpoints,
            copies=adapter_copies_dir(self.cache_dir),
            verify=config.verify_reloads,
            retire=self._forget_fetched,
        )

    @classmethod
    def from_record(cls, record: PoolRecord, config: PrimeflowConfig) -> AttachedPool:
        """Run `config`'s view of the running shared pools `record` describes."""
        return cls(
            config.run.name,
            model=record.model,
            urls=record.servers,
            api_key=record.api_key,
            config=config.inference,
            storage=config.storage,
        )

    @property
    def policy_version(self) -> int:
        return min((e.policy_version for e in self.endpoints), default=0)

    def _clients(self) -> list[httpx.Client]:
        return [
            control_client(url, self.api_key, self.config.reload_timeout_s) for url in self._urls
        ]

    def reload(self, checkpoint: str | os.PathLike[str], version: int | None = None) -> int:
        """Serve adapter `checkpoint` (a policy version or a checkpoint of this tenant's run)
        as policy `version`; `ReloadError` leaves the previous one served."""
        location = os.fspath(checkpoint)
        version = named_version(location, version)
        with self._lock:
            try:
                entries = version_chain(location, self._adapters.held_uid, self.storage)
                if not entries:
                    return version
                folder = local_checkpoint(entries[-1], self.cache_dir, self.storage)
            except (OSError, ValueError) as exc:
                raise unloadable(location, exc) from exc
            if not is_adapter(folder):
                raise ReloadError(
                    f"{location} holds whole weights: a shared pool serves its base model and "
                    "its tenants' adapters only"
                )
            return self._adapters.swap(location, folder, version)

    def close(self) -> None:
        """Unload this tenant's adapters from every server (the pool keeps running)."""
        with self._lock:
            self._adapters.unload_all()

    def _forget_fetched(self, folders: set[Path]) -> None:
        forget_fetched(self.cache_dir, folders)
