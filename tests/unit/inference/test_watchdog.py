"""A server's process group ends when the process that started it is gone, however it went."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

from engine.inference.procs import group_members

# Stands in for vLLM: a group leader with a child, watched the way `launch.main` watches.
LEADER = (
    "import subprocess, sys\n"
    "from engine.inference.launch import end_group_when_closed\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print('up', flush=True)\n"
    "end_group_when_closed(int(sys.argv[1]), grace_s=0.5)\n"
)


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_group_ends_when_the_pipe_writer_is_gone() -> None:
    read_end, write_end = os.pipe()
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER, str(read_end)],
        pass_fds=(read_end,),
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    os.close(read_end)
    try:
        assert leader.stdout is not None and leader.stdout.readline() == "up\n"
        assert wait_for(lambda: len(group_members(leader.pid)) == 2, 10)
        os.close(write_end)  # what the kernel does when the pool's process dies
        assert wait_for(lambda: not group_members(leader.pid), 10)
    finally:
        leader.kill()
        leader.wait()


def test_group_members_ignores_other_groups() -> None:
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert group_members(sleeper.pid) == [sleeper.pid]
        assert sleeper.pid not in group_members(os.getpgrp())
    finally:
        sleeper.kill()
        sleeper.wait()
    assert group_members(sleeper.pid) == []
