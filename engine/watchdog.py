"""Hang detection: how long a stage may go without a new step, and what to save when it does.

prime-rl's users lose hours to silent hangs: a rank stuck in a collective, a stopped process, an
environment that never returns. A stage's progress is the metric lines its pools commit (one
per step), so the watch needs no cooperation from a stuck process. When the silence outlasts
`factor` × the recent step time, the stage fails with one line naming the processes and where
their stacks are: each trainer rank dumps its threads on `DUMP_SIGNAL` (faulthandler writes
from the signal handler, so a rank spinning or blocked while holding the GIL still answers);
the watching process adds its own threads (the orchestrator's among them); a process that is
stopped (SIGSTOP, a debugger) cannot answer, and the report says so.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from engine.config.watchdog import WatchdogConfig
from engine.process_groups import process_tree

#: Set by the trainer pool: the folder where each rank keeps the file it dumps its stacks into.
STACKS_DIR_ENV = "PRIMEFLOW_STACKS_DIR"
DUMP_SIGNAL = signal.SIGUSR1
#: Step intervals the median is taken over.
RECENT_STEPS = 10
_dump_file: IO[str] | None = None  # kept open for the life of the rank


def allowed_silence(intervals: list[float], config: WatchdogConfig) -> float:
    """Seconds without a new step before the stage counts as hung: `startup_s` before its first
    step, then `factor` × the median of the recent step intervals, at least `min_s`."""
    if not intervals:
        return config.startup_s
    return max(config.min_s, config.factor * statistics.median(intervals[-RECENT_STEPS:]))


@dataclass(frozen=True)
class Stall:
    """A stage found silent for longer than allowed."""

    silence_s: float
    allowed_s: float
    #: The median recent step time the allowance came from; None before the first step.
    step_s: float | None

    def describe(self, config: WatchdogConfig) -> str:
        if self.step_s is None:
            basis = f"watchdog.startup_s = {config.startup_s:g} s before the first step"
        else:
            basis = f"{config.factor:g}× the recent step time {self.step_s:.1f} s"
        return f"no new step for {self.silence_s:.0f} s (allowed {self.allowed_s:.0f} s: {basis})"


@dataclass
class ProgressClock:
    """When the stage last made progress, and how long its steps have been taking."""

    config: WatchdogConfig
    last: float = field(default_factory=time.monotonic)
    intervals: list[float] = field(default_factory=list)
    _stepped: bool = False

    def beat(self, now: float | None = None) -> None:
        """A new step arrived (the time to the first includes start-up, so it is not a step)."""
        now = time.monotonic() if now is None else now
        if self._stepped:
            self.intervals.append(now - self.last)
        self.last, self._stepped = now, True

    def stall(self, now: float | None = None) -> Stall | None:
        if not self.config.enabled:
            return None
        silence = (time.monotonic() if now is None else now) - self.last
        allowed = allowed_silence(self.intervals, self.config)
        if silence <= allowed:
            return None
        step = statistics.median(self.intervals[-RECENT_STEPS:]) if self.intervals else None
        return Stall(silence_s=silence, allowed_s=allowed, step_s=step)


def dump_file_name(pid: int) -> str:
    return f"stacks-{pid}.txt"


def register_stack_dump() -> None:
    """In a trainer rank: dump every thread's stack on `DUMP_SIGNAL` into the stacks folder."""
    global _dump_file
    folder = os.environ.get(STACKS_DIR_ENV)
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    _dump_file = (Path(folder) / dump_file_name(os.getpid())).open("a")
    faulthandler.register(DUMP_SIGNAL, file=_dump_file, all_threads=True, chain=False)


def _describe(process: psutil.Process) -> tuple[str, str]:
    """(status, heading) of one process; a vanished one reads as `gone`."""
    try:
        with process.oneshot():
            status = process.status()
            cpu = process.cpu_times()
            command = " ".join(process.cmdline())[:300]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone", f"pid {process.pid}: gone"
    return status, (
        f"pid {process.pid} [{status}] cpu user {cpu.user:.1f} s system {cpu.system:.1f} s: "
        f"{command}"
    )


def capture_stacks(
    root_pids: Iterable[int], stacks_dir: Path, report: Path, wait_s: float = 3.0
) -> list[str]:
    """Write `report`: every process under `root_pids` (state, command, Python stacks where it
    answers `DUMP_SIGNAL`) and this process's own threads. Returns "pid N [status]" for each
    process that is stopped or did not answer, for the one-line error."""
    processes = [p for pid in root_pids for p in process_tree(pid)]
    asked: dict[int, int] = {}  # pid -> size of its dump file before the request
    for process in processes:
        dump_path = stacks_dir / dump_file_name(process.pid)
        if dump_path.is_file():
            asked[process.pid] = dump_path.stat().st_size
            try:
                os.kill(process.pid, DUMP_SIGNAL)
            except ProcessLookupError:
                del asked[process.pid]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(
        (stacks_dir / dump_file_name(pid)).stat().st_size == size for pid, size in asked.items()
    ):
        time.sleep(0.1)
    time.sleep(0.2)  # let a dump that just started finish
    unresponsive: list[str] = []
    report.parent.mkdir(parents=True, exist_ok=True)
    with report.open("w") as out:
        for process in processes:
            status, heading = _describe(process)
            out.write(f"=== {heading}\n")
            stacks = ""
            if process.pid in asked:
                with (stacks_dir / dump_file_name(process.pid)).open() as dump:
                    dump.seek(asked[process.pid])
                    stacks = dump.read()
                out.write(stacks or "(no stacks: it did not answer the dump signal)\n")
            stopped = status == psutil.STATUS_STOPPED
            if stopped:
                out.write("(stopped: SIGSTOP or a debugger; no stack until it continues)\n")
            if stopped or (process.pid in asked and not stacks):
                unresponsive.append(f"pid {process.pid} [{status}]")
            out.write("\n")
        out.write(f"=== this process, pid {os.getpid()} (the stage's supervisor)\n")
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
    return unresponsive
