"""Which processes belong to a process group, read from /proc (vLLM runs on Linux only).

`killpg(pgid, 0)` cannot answer this: it also counts zombies, and when a group's leader dies its
children are re-parented to PID 1, which in containers does not always reap them. A group whose
members are all zombies holds no memory and no device, so it counts as gone.
"""

from __future__ import annotations

from pathlib import Path

_PROC = Path("/proc")


def _stat_fields(pid_dir: Path) -> list[str] | None:
    try:
        text = (pid_dir / "stat").read_text()
    except OSError:
        return None
    # `pid (comm) state ppid pgrp ...`; comm may contain spaces and parentheses.
    return text[text.rfind(")") + 2 :].split()


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is `pgid`."""
    members = []
    for pid_dir in _PROC.iterdir():
        if not pid_dir.name.isdigit():
            continue
        fields = _stat_fields(pid_dir)
        if fields and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            members.append(int(pid_dir.name))
    return sorted(members)
