"""Exit when the supervisor or torchrun is gone, so a killed flow never leaves a rank running.

The pool launcher records its own pid in `PRIMEFLOW_SUPERVISOR_PID` and starts torchrun in a new
process group; torchrun starts every rank in a session of its own. Each rank polls two
processes: the supervisor (gone, or its pid reused by a later process) and its parent, torchrun
(the rank was re-parented). When either is gone the rank kills its own process group. torchrun,
having lost its workers, exits by itself; ranks on other nodes fail their next collective.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

from engine.process_groups import process_exists

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
        return process_exists(pid)
    return _start_time(pid) == started


def _kill_group(why: str) -> None:
    """SIGKILL this rank's group, itself included: a rank stuck in a collective ignores SIGTERM,
    and nothing needs a graceful end (a half-written checkpoint is never committed)."""
    group = os.getpgrp()
    log.error("%s; killing trainer process group %d", why, group)
    os.killpg(group, signal.SIGKILL)


def watch_supervisor(poll_s: float = 1.0) -> threading.Thread | None:
    """Start a daemon thread watching `$PRIMEFLOW_SUPERVISOR_PID` and the parent; None when the
    variable is unset (a worker started by hand)."""
    value = os.environ.get(SUPERVISOR_ENV)
    if not value:
        return None
    pid = int(value)
    started = _start_time(pid)
    parent = os.getppid()

    def watch() -> None:
        while True:
            if started is None or not _alive(pid, started):
                _kill_group(f"supervisor {pid} is gone")
            if os.getppid() != parent:
                _kill_group(f"parent {parent} (torchrun) is gone")
            time.sleep(poll_s)

    thread = threading.Thread(target=watch, name="primeflow-supervisor-watch", daemon=True)
    thread.start()
    return thread
