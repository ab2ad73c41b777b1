"""One write at a time on a background thread, its failure raised on the trainer's thread.

Policy versions and resume checkpoints are snapshotted on the step and written while the next
steps train. A writer that fails must stop the stage, but a thread cannot raise into another:
the error is kept and raised by the next `wait` (the trainer's next publication or checkpoint,
or the end of the stage) as it is, with a note of what was being written, so the stage fails
with the storage error itself (its type and the object's URI).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BackgroundWrite:
    """At most one job in flight; `what` names it in the error (e.g. "a policy version")."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: How long the last job that ended ran: on-policy, the trainer's write of a policy
        #: version is on the step's critical path, however little it stalls the trainer.
        self.last_seconds = 0.0

    def start(self, name: str, job: Callable[[], object]) -> None:
        """Run `job` on a thread called `name`; the previous one must have been waited for."""
        if self._thread is not None:
            raise RuntimeError(f"writing {self.what}: the previous write was not waited for")
        self._thread = threading.Thread(target=self._run, args=(job,), name=name, daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[], object]) -> None:
        started = time.perf_counter()
        try:
            job()
        except BaseException as exc:  # raised on the trainer's thread by `wait`
            self._error = exc
        finally:
            self.last_seconds = time.perf_counter() - started

    def wait(self) -> None:
        """Wait for the job in flight; raise its error, if it failed."""
        self.close()
        if self._error is not None:
            error, self._error = self._error, None
            error.add_note(f"(raised while writing {self.what} in the background)")
            raise error

    def close(self) -> None:
        """Wait for the job in flight, if any, without raising (on the way out of a failed
        stage: its own error is the one to report)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
