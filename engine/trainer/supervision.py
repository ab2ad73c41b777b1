"""Exit when the supervisor is gone, so a killed flow never leaves a trainer running.

The pool launcher records its own pid in `PRIMEFLOW_SUPERVISOR_PID` before it starts torchrun in
a new process group. Each worker polls that process; once it is gone (or its pid was reused by
a process that started later) the worker terminates its whole group — torchrun and every rank
on this node — and ranks on other nodes fail their next collective and exit too.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

SUPERVISOR_ENV = "PRIMEFLOW_SUPERVISOR_PID"
log = logging.getLogger("primeflow.trainer")


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (Linux), or None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    # Field 22; the command name (field 2) may hold spaces, so count from its closing paren.
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    if not Path("/proc").is_dir():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return _start_time(pid) == started


def _kill_group() -> None:
    """SIGKILL the group, this process included: a rank stuck in a collective ignores SIGTERM,
    and nothing needs a graceful end (a half-written checkpoint is never committed)."""
    group = os.getpgrp()
    log.error("supervisor is gone; killing trainer process group %d", group)
    os.killpg(group, signal.SIGKILL)


def watch_supervisor(poll_s: float = 1.0) -> threading.Thread | None:
    """Start a daemon thread watching `$PRIMEFLOW_SUPERVISOR_PID`; None when it is unset."""
    value = os.environ.get(SUPERVISOR_ENV)
    if not value:
        return None
    pid = int(value)
    started = _start_time(pid)

    def watch() -> None:
        while started is not None and _alive(pid, started):
            time.sleep(poll_s)
        _kill_group()

    thread = threading.Thread(target=watch, name="primeflow-supervisor-watch", daemon=True)
    thread.start()
    return thread
