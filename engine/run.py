"""A run's root in object storage, opened from the config every command resolves."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.config import PrimeflowConfig
from engine.config.run import StorageConfig
from storage.backends import split_uri
from storage.commit import latest_committed_step
from storage.layout import RunLayout, Stage, run_uri
from storage.manifest import write_manifest
from storage.store import ObjectStore


@dataclass(frozen=True)
class Run:
    """One run as `open_run` opened it: its root store (paths inside it: `RunLayout`) and its
    local folder (`local_run_dir`: process logs, W&B files). The flow opens it once and
    passes it down to every task and stage."""

    store: ObjectStore
    local: Path

    @property
    def logs(self) -> Path:
        """Every process's log, the pool records, hang reports."""
        return self.local / RunLayout.LOGS

    def stage_store(self, stage: Stage) -> ObjectStore:
        return stage_store(self.store, stage)


def stage_store(run_root: ObjectStore, stage: Stage) -> ObjectStore:
    """Where `stage`'s checkpoints live: the run root itself for RL, `sft/` below it for SFT."""
    folder = RunLayout.stage_dir(stage)
    return run_root.child(folder) if folder else run_root


def store_at(uri: str, storage: StorageConfig) -> ObjectStore:
    """A store rooted at `uri` with the run's storage settings; credentials stay in the
    environment.

    Every store a run opens (its root, a checkpoint or policy version named by URI, a
    recorded run to reproduce) goes through here, so none falls back to a default endpoint:
    an S3-compatible server named by `storage.endpoint_url` is the one every process talks
    to. The endpoint and region apply where `uri` is the same kind of store as
    `storage.uri`; retries everywhere.
    """
    protocol = split_uri(uri)[0]
    applies = protocol in ("s3", "gs") and protocol == split_uri(storage.uri)[0]
    return ObjectStore(
        uri,
        endpoint_url=storage.endpoint_url if applies else None,
        region=storage.region if applies else None,
        retries=storage.retries,
        backoff_s=storage.backoff_s,
    )


def run_store(config: PrimeflowConfig) -> ObjectStore:
    """The store rooted at `<storage.uri>/<run.name>`."""
    return store_at(run_uri(config.storage.uri, config.run.name), config.storage)


def rl_start(config: PrimeflowConfig, root: ObjectStore) -> str | None:
    """The checkpoint RL starts from: this run's SFT result (its newest committed checkpoint)
    when the run has an SFT stage, else `trainer.init_checkpoint`, else None (the model).

    Stated once and read from the run's root, so that every process of the stage agrees
    without being told: the leader's and each follower node's trainer ranks, a tenant's shared
    trainer, and the flow that loads the same weights into the inference pool."""
    if config.sft.enabled:
        sft = stage_store(root, "sft")
        step = latest_committed_step(sft, RunLayout.CHECKPOINTS)
        if step is not None:
            return sft.url(RunLayout.checkpoint_dir(step))
    return config.trainer.init_checkpoint


def primeflow_home() -> Path:
    """`$PRIMEFLOW_HOME`, or `.primeflow/` in the working directory: local state (the Prefect
    server's home, process logs of runs whose root is remote, model caches)."""
    return Path(os.environ.get("PRIMEFLOW_HOME", ".primeflow")).resolve()


def local_run_dir(config: PrimeflowConfig) -> Path:
    """A local folder for what only makes sense on this host: process logs and process groups.

    On `file://` it is the run root itself, so `<run>/logs/` holds the logs as docs/storage.md says;
    for a remote root it is `<PRIMEFLOW_HOME>/runs/<run>`.
    """
    uri = run_uri(config.storage.uri, config.run.name)
    if uri.startswith("file://"):
        return Path(uri.removeprefix("file://")).resolve()
    if "://" not in uri:
        return Path(uri).resolve()
    return primeflow_home() / "runs" / config.run.name


def logs_dir(config: PrimeflowConfig) -> Path:
    """`<local run dir>/logs`: every process's log, the pool records, hang reports."""
    return local_run_dir(config) / RunLayout.LOGS


def run_of(config: PrimeflowConfig) -> Run:
    """The run `config` names, as it stands: nothing is written (a run another process opened,
    or one an event names)."""
    return Run(store=run_store(config), local=local_run_dir(config))


def open_run(config: PrimeflowConfig, *, command: Sequence[str] | None = None) -> Run:
    """Open (or reopen, to resume) the run and record its manifest: config, versions, seeds."""
    run = run_of(config)
    if run.store.exists(RunLayout.MANIFEST):  # a resumed run keeps the manifest it started with
        return run
    write_manifest(
        run.store,
        config=config.model_dump(mode="json"),
        seeds={"run": config.run.seed, "inference": config.inference.seed},
        parent_run=config.run.parent,
        command=list(command) if command is not None else None,
    )
    return run
