"""Prefect result storage in the run's own object store, with no credential in Prefect.

Task and flow results are small (URIs, summaries), and keeping them beside the runs they
describe (`<storage.uri>/_prefect-results`) means a shared server never needs a disk of its own
for them. The store is a `RemoteFileSystem` block (a `LocalFileSystem` one for a local run
root) whose settings say only where to write: basepath, S3 endpoint and region. fsspec's
backends read credentials from the environment (`AWS_*`, `GOOGLE_APPLICATION_CREDENTIALS`,
instance roles) on whichever machine runs the flow, so the block document, readable by anyone
with API access, holds no secret.

    @flow(result_storage=result_storage(config.storage))
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from prefect.filesystems import LocalFileSystem, RemoteFileSystem, WritableFileSystem

from engine.config.run import StorageConfig
from storage.store import ObjectStore

RESULTS_DIR = "_prefect-results"
BLOCK_PREFIX = "primeflow-results"


def results_basepath(storage: StorageConfig) -> str:
    """`<storage.uri>/_prefect-results`, local paths made absolute (a worker's cwd differs)."""
    return ObjectStore(storage.uri).url(RESULTS_DIR)


def results_settings(storage: StorageConfig) -> dict[str, Any]:
    """fsspec options for the results filesystem: addressing, never credentials."""
    protocol = results_basepath(storage).split("://", 1)[0]
    settings: dict[str, Any] = {}
    if protocol == "s3":
        # Path-style addressing and the region, as the run's own store uses them.
        config_kwargs: dict[str, Any] = {"s3": {"addressing_style": "path"}}
        if storage.region:
            config_kwargs["region_name"] = storage.region
        settings["config_kwargs"] = config_kwargs
    if protocol in ("s3", "gs", "gcs") and storage.endpoint_url:
        settings["endpoint_url"] = storage.endpoint_url
    return settings


def block_name(storage: StorageConfig) -> str:
    """One block per results location: the same storage settings always name the same block."""
    key = json.dumps([results_basepath(storage), results_settings(storage)], sort_keys=True)
    return f"{BLOCK_PREFIX}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def results_block(storage: StorageConfig) -> WritableFileSystem:
    """The (unsaved) block: local disk for `file://` roots, fsspec's remote filesystems else."""
    basepath = results_basepath(storage)
    if basepath.startswith("file://"):
        return LocalFileSystem(basepath=basepath.removeprefix("file://"))
    return RemoteFileSystem(basepath=basepath, settings=results_settings(storage))


def result_storage(storage: StorageConfig) -> WritableFileSystem:
    """The saved block for these storage settings, created on first use (needs the API)."""
    name = block_name(storage)
    block = results_block(storage)
    try:
        return type(block).load(name)
    except ValueError:  # no block of that name yet
        block.save(name, overwrite=True)
        return block
