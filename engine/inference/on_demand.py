"""An inference pool started by the first stage that has something to generate.

A stage whose result is committed already (a resumed or re-run run) never asks for it, so
re-running a finished run starts no server. How the pool starts is passed in: the flows start
it as a Prefect task (`tasks.pools`), a script with `InferencePool.for_run(...).start()`.

A stage that asks for a pool whose servers died (a retry after a server was killed) gets a
new one: the dead pool is stopped and `start` called again. Reusing it could only fail the
retry the same way, and kill a healthy trainer on the way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.inference.pool import InferencePool
from engine.inference.serving import PolicyServing

log = logging.getLogger("primeflow.inference")


class PoolOnDemand:
    """The pool, started by `start` on first use. A reload asked for before the start is kept
    and applied once the servers are up; `policy_version` is what they serve, or will."""

    def __init__(
        self,
        start: Callable[[], PolicyServing],
        pool: PolicyServing | None = None,
        stop: Callable[[InferencePool], None] = InferencePool.stop,
    ):
        """`stop` ends a pool whose servers died before `start` replaces it (the flows' also
        forgets its recorded process groups)."""
        self._start = start
        self._pool = pool
        self._stop = stop
        self._pending: tuple[str, int] | None = None

    @property
    def started(self) -> PolicyServing | None:
        """The pool if it has started, else None."""
        return self._pool

    @property
    def policy_version(self) -> int:
        if self._pending is not None:
            return self._pending[1]
        return self._pool.policy_version if self._pool is not None else 0

    def reload(self, checkpoint: str, version: int) -> None:
        if self._pool is None:
            self._pending = (checkpoint, version)
        else:
            self._pool.reload(checkpoint, version=version)

    def get(self) -> PolicyServing:
        """The running pool, started (and brought to the pending version) on first use, and
        started again when any of its servers is no longer running."""
        if isinstance(self._pool, InferencePool) and (dead := self._pool.exited()):
            log.warning(
                "inference servers not running (%s): starting the pool again",
                ", ".join(f"{name} exited with {code}" for name, code in sorted(dead.items())),
            )
            self._stop(self._pool)
            self._pool = None
        if self._pool is None:
            self._pool = self._start()
        if self._pending is not None:
            checkpoint, version = self._pending
            self._pool.reload(checkpoint, version=version)
            self._pending = None
        return self._pool
