"""The inference pool: N vLLM servers for one model, started, supervised, reloaded, stopped.

One pool lives for a whole pipeline run. It is two objects with one job each: the servers'
processes and health (`engine.inference.fleet.ServerFleet`) and what they serve, swapped in
without a restart (`engine.inference.weight_sync.WeightSync`).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any

from engine.config import PrimeflowConfig
from engine.config.inference import InferenceConfig
from engine.config.run import StorageConfig
from engine.inference.endpoint import Endpoint
from engine.inference.fleet import POOL_RECORD, InferencePoolError, ServerFleet
from engine.inference.weight_sync import WeightSync

__all__ = ["POOL_RECORD", "InferencePool", "InferencePoolError"]


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
        self.fleet = ServerFleet(config, log_dir=log_dir, cache_dir=cache_dir, revision=revision)
        self.weights = WeightSync(self.fleet, storage)

    @classmethod
    def for_run(cls, config: PrimeflowConfig, log_dir: Path) -> InferencePool:
        """The pool of a run: its inference settings, model revision and storage."""
        return cls(
            config.inference,
            log_dir=log_dir,
            revision=config.model.revision,
            storage=config.storage,
        )

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

    def start(self) -> None:
        """Start every server and wait until all are ready; on any failure stop them all."""
        self.fleet.start()

    def stop(self) -> None:
        """End every server; safe to call more than once."""
        self.fleet.stop()
        self.weights.reset()

    def reload(self, checkpoint: str | os.PathLike[str], version: int | None = None) -> int:
        """Swap `checkpoint` into every server; the policy version now served
        (`WeightSync.reload`)."""
        return self.weights.reload(checkpoint, version)

    def compare_served(self, checkpoint: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """Each server's bit-for-bit comparison of its weights with `checkpoint`."""
        return self.weights.compare_served(checkpoint)

    # What callers read of the pool: its servers (the fleet) and its swaps (the weights).

    @property
    def config(self) -> InferenceConfig:
        return self.fleet.config

    @property
    def log_dir(self) -> Path:
        return self.fleet.log_dir

    @property
    def cache_dir(self) -> Path:
        return self.fleet.cache_dir

    @property
    def api_key(self) -> str:
        return self.fleet.api_key

    @property
    def device(self) -> str:
        return self.fleet.device

    @property
    def endpoints(self) -> list[Endpoint]:
        return self.fleet.endpoints

    @property
    def model_name(self) -> str:
        return self.fleet.model_name

    @property
    def process_groups(self) -> dict[str, int]:
        return self.fleet.process_groups

    @property
    def policy_version(self) -> int:
        return self.fleet.policy_version

    @property
    def verified_tensors(self) -> int:
        return self.weights.verified_tensors

    @property
    def last_swap(self) -> dict[str, float]:
        return self.weights.last_swap

    def exited(self) -> dict[str, int]:
        """`inference-<i>` → exit status of each server that is no longer running."""
        return self.fleet.exited()
