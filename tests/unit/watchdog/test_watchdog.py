"""The hang watch: its allowance, and the stacks it collects from live, spinning and stopped
processes (real child processes: one that answers the dump signal, one that is stopped)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config.watchdog import WatchdogConfig
from engine.watchdog import (
    STACKS_DIR_ENV,
    ProgressClock,
    allowed_silence,
    capture_stacks,
    dump_file_name,
)

CONFIG = WatchdogConfig(factor=10.0, min_s=30.0, startup_s=600.0)

#: A rank stand-in: registers the dump as the trainer worker does, then spins in a named frame.
SPINNER = """
from engine.watchdog import register_stack_dump
register_stack_dump()
def spinning_in_a_collective():
    while True:
        pass
print("ready", flush=True)
spinning_in_a_collective()
"""


def test_the_allowance_is_startup_then_a_multiple_of_the_median_step() -> None:
    assert allowed_silence([], CONFIG) == 600.0
    assert allowed_silence([1.0, 1.0, 50.0], CONFIG) == 30.0  # at least min_s
    assert allowed_silence([5.0, 6.0, 400.0], CONFIG) == 60.0  # one slow step: the median


def test_the_clock_counts_steps_after_the_first_and_reports_a_stall() -> None:
    clock = ProgressClock(CONFIG, last=0.0)
    assert clock.stall(now=599.0) is None  # start-up: model load, compile, first rollouts
    clock.beat(now=599.0)  # the first step: its time includes start-up, so no interval
    assert clock.intervals == []
    clock.beat(now=604.0)
    assert clock.intervals == [5.0]
    assert clock.stall(now=604.0 + 50.0) is None
    stall = clock.stall(now=604.0 + 51.0)
    assert stall is not None and (stall.allowed_s, stall.step_s) == (50.0, 5.0)
    assert stall.describe(CONFIG) == (
        "no new step for 51 s (allowed 50 s: 10× the recent step time 5.0 s)"
    )
    assert ProgressClock(WatchdogConfig(enabled=False), last=0.0).stall(now=1e9) is None


@pytest.fixture
def spinners(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    env = {**os.environ, STACKS_DIR_ENV: str(tmp_path / "stacks")}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", SPINNER], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for child in children:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
    yield children
    for child in children:
        child.kill()
        child.wait()


def test_stacks_of_a_spinning_process_and_the_state_of_a_stopped_one(
    spinners: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    spinning, stopped = spinners
    os.kill(stopped.pid, signal.SIGSTOP)
    time.sleep(0.2)
    report = tmp_path / "hang.txt"
    started = time.monotonic()
    unanswered = capture_stacks([spinning.pid, stopped.pid], tmp_path / "stacks", report)
    assert time.monotonic() - started < 10
    assert unanswered == [f"pid {stopped.pid} [stopped]"]
    text = report.read_text()
    spinning_part = text.split(f"=== pid {spinning.pid} ")[1].split("===")[0]
    assert "spinning_in_a_collective" in spinning_part  # its Python stack, taken mid-spin
    stopped_part = text.split(f"=== pid {stopped.pid} ")[1].split("===")[0]
    assert "(stopped: SIGSTOP or a debugger" in stopped_part
    assert "test_stacks_of_a_spinning_process" in text  # this process's own threads
    assert (tmp_path / "stacks" / dump_file_name(stopped.pid)).is_file()
