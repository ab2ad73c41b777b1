"""The process groups a run started, recorded on local disk so a hook can kill them.

Pools start in their own sessions, so cancelling or killing the flow process does not reach
them. Each group id is written to `<local run dir>/logs/process-groups.json` the moment it
exists; `on_cancellation` / `on_crashed` hooks and `finally` blocks call `kill_recorded_groups`,
which needs nothing but that file (the pool objects may be gone with a crashed process).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from pathlib import Path

import psutil

GROUPS_FILE = "process-groups.json"


def process_tree(pid: int) -> list[psutil.Process]:
    """Process `pid` and all its descendants, root first; empty when it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def process_exists(pid: int) -> bool:
    """Whether process `pid` exists (a zombie too), whoever owns it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def groups_file(log_dir: Path) -> Path:
    return log_dir / GROUPS_FILE


def recorded_groups(log_dir: Path) -> dict[str, int]:
    """name → process group id, for groups started on this host."""
    try:
        record = json.loads(groups_file(log_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return {k: int(v) for k, v in record.get("groups", {}).items()}


def record_group(log_dir: Path, name: str, pgid: int) -> None:
    """Add (or replace) one group; written atomically so a crash never leaves half a record."""
    log_dir.mkdir(parents=True, exist_ok=True)
    groups = recorded_groups(log_dir) | {name: pgid}
    tmp = groups_file(log_dir).with_suffix(".tmp")
    tmp.write_text(json.dumps({"host": socket.gethostname(), "groups": groups}, indent=2))
    os.replace(tmp, groups_file(log_dir))


def forget_group(log_dir: Path, name: str) -> None:
    groups = recorded_groups(log_dir)
    if groups.pop(name, None) is not None:
        tmp = groups_file(log_dir).with_suffix(".tmp")
        tmp.write_text(json.dumps({"host": socket.gethostname(), "groups": groups}, indent=2))
        os.replace(tmp, groups_file(log_dir))


def kill_recorded_groups(log_dir: Path) -> list[str]:
    """SIGKILL every recorded group that still exists; return the names it killed."""
    killed = []
    for name, pgid in recorded_groups(log_dir).items():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
            killed.append(name)
        forget_group(log_dir, name)
    return killed
