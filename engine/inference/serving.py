"""What the stages, the orchestrator and the client use of an inference pool, whoever owns its
servers.

`InferencePool` starts and stops servers of its own; `AttachedPool` is a tenant's view of shared
ones. Both serve one lineage of policy versions, swapped in by `reload`, and take requests at
their `endpoints` with `api_key`: whatever consumes a pool takes this protocol, never one of the
two classes, so a third kind of pool changes no consumer.
"""

from __future__ import annotations

import os
from typing import Protocol

from engine.config.inference import InferenceConfig
from engine.inference.endpoint import Endpoint


class PolicyServing(Protocol):
    """A running inference pool as its consumers see it."""

    @property
    def config(self) -> InferenceConfig:
        """The pool's settings (request timeouts and retries for its clients)."""
        ...

    @property
    def endpoints(self) -> list[Endpoint]:
        """One per server: where requests go, and the policy version it serves."""
        ...

    @property
    def api_key(self) -> str: ...

    @property
    def policy_version(self) -> int:
        """The version every server serves (0: the model they started with)."""
        ...

    @property
    def verified_tensors(self) -> int:
        """Parameters verified bit-identical to their checkpoint so far (0 unless verifying)."""
        ...

    @property
    def last_swap(self) -> dict[str, float]:
        """Seconds per phase of the last reload (fetch, load, paused); empty: not measured."""
        ...

    def reload(self, checkpoint: str | os.PathLike[str], version: int | None = None) -> int:
        """Serve `checkpoint` as policy `version` on every server; the version now served."""
        ...
