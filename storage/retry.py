"""The one place that decides whether a failed storage call is tried again.

Object stores fail in two ways that callers must treat differently: a busy or flaky server
(throttling, 5xx, a dropped connection) heals if we wait, while bad credentials or a missing
bucket never do. Keeping that decision in one helper means every store call behaves the same,
and every error that escapes names the URI it concerns.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from storage.errors import (
    ObjectNotFoundError,
    PermanentStorageError,
    StorageError,
    TransientStorageError,
    describe,
    is_missing_object,
    is_permanent,
    is_transient,
)

T = TypeVar("T")

# A single wait never exceeds this, however many retries are configured.
_MAX_DELAY_S = 30.0


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently transient faults are retried."""

    retries: int = 5
    backoff_s: float = 0.2

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {self.backoff_s}")

    def delay_s(self, attempt: int) -> float:
        """Exponential backoff with jitter, so that many clients throttled together spread out."""
        base = min(self.backoff_s * 2.0**attempt, _MAX_DELAY_S)
        return base * random.uniform(0.5, 1.5)

    def call(self, uri: str, fn: Callable[[], T], *, writing: bool = False) -> T:
        """Run `fn`, retrying transient faults; raise storage errors that name `uri`.

        Missing objects raise `ObjectNotFoundError` (also a `FileNotFoundError`), except when
        `writing`: a write that finds nothing there lacks its bucket, which is permanent. Faults
        that never heal raise `PermanentStorageError` at once. Transient faults that outlast
        every retry raise `TransientStorageError`. Exceptions that are not storage faults (bugs)
        propagate unchanged.
        """
        attempt = 0
        while True:
            try:
                return fn()
            except StorageError:
                raise
            except Exception as exc:
                if is_missing_object(exc) and writing:
                    reason = f"nowhere to write (does the bucket exist?): {describe(exc)}"
                    raise PermanentStorageError(uri, reason) from exc
                if is_missing_object(exc):
                    raise ObjectNotFoundError(uri, "no such object") from exc
                if is_permanent(exc):
                    raise PermanentStorageError(uri, describe(exc)) from exc
                if not is_transient(exc):
                    if isinstance(exc, OSError):
                        raise PermanentStorageError(uri, describe(exc)) from exc
                    raise
                if attempt >= self.retries:
                    reason = f"gave up after {attempt + 1} attempts: {describe(exc)}"
                    raise TransientStorageError(uri, reason) from exc
                time.sleep(self.delay_s(attempt))
                attempt += 1
