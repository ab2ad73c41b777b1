"""Prefect's overhead per RL step: the same steps with and without the flow around them.

    .venv/bin/python -m tests.bench.prefect.bench_prefect               # 5 s steps, 6 per run
    .venv/bin/python -m tests.bench.prefect.bench_prefect --step-s 1 --steps 3 --pairs 1
    make bench        # every benchmark; this one through test_bench_prefect.py

The steps come from a stand-in for the trainer pool (`stand_in_trainer.py`): a process that
spends `--step-s` CPU seconds of one-core compute per step (the demo config's RL step takes
about 5 s here), then commits a metric line and a checkpoint, as the trainer does. It
stands in for the real loop because a real step needs vLLM and torchrun, whose own variance on a
shared 2-core machine would swamp a 1% effect. The flow process does what `rl_loop` does: start
the pool and wait for it.

- **direct**: start the stand-in, wait for it.
- **prefect**: the same inside a flow and a stage task, under the real `StageMonitor` (polling
  storage every 2 s, a progress artifact per step, a table artifact every 10 steps, one
  `primeflow.checkpoint.committed` event per checkpoint), against a real Prefect server that
  this benchmark starts on loopback (its own home, SQLite) with `flows.server.start`.

Runs alternate (direct, prefect, then prefect, direct, ...). The pool never waits on Prefect, so
Prefect can lengthen a step only by taking CPU from it: the headline overhead is the CPU the flow
process and the server spend beyond the direct run, per step, over the step's `--step-s` (a bound
that holds even with the pool on every core), plus the fixed cost of starting and finishing the
flow and the task, paid once per stage and spread over the demo's 100 steps. The wall-time ratio of
the stand-in's own loop (first step start to last commit, median over pairs) is printed too, with
the spread among the direct runs: on a shared machine that spread is its resolution.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psutil

from flows import server

TARGET_OVERHEAD = 0.01
DEMO_STEPS = 100
STAND_IN = "tests.bench.prefect.stand_in_trainer"


@dataclass(frozen=True)
class Run:
    """One stage of `steps` steps, timed from the outside and from the stand-in's own clock."""

    variant: str
    steps: int
    loop_s: float  # the stand-in's first step start to last commit
    stage_s: float  # starting the stand-in to its exit, as the stage sees it
    total_s: float  # the whole call: flow and task start and finish included for prefect
    flow_cpu_s: float  # this process, every thread
    server_cpu_s: float  # the Prefect server's process tree

    @property
    def step_s(self) -> float:
        return self.loop_s / self.steps


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((server.DEFAULT_HOST, 0))
        return sock.getsockname()[1]


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children, as now."""
    root = psutil.Process(pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def run_stand_in(root: str, steps: int, step_s: float) -> tuple[float, float]:
    """(the stand-in's loop seconds, seconds from its start to its exit)."""
    started = time.perf_counter()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            STAND_IN,
            "--root",
            root,
            "--steps",
            str(steps),
            "--cpu-s",
            str(step_s),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = process.communicate()
    stage_s = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"the stand-in trainer exited with status {process.returncode}")
    return float(out.split()[-1]), stage_s


def measure(variant: str, root: str, steps: int, step_s: float, server_pid: int) -> Run:
    cpu0, server0, started = time.process_time(), tree_cpu_s(server_pid), time.perf_counter()
    if variant == "direct":
        loop_s, stage_s = run_stand_in(root, steps, step_s)
    else:
        from tests.bench.prefect.flow import overhead_flow

        loop_s, stage_s = overhead_flow(root, steps, step_s)
    return Run(
        variant=variant,
        steps=steps,
        loop_s=loop_s,
        stage_s=stage_s,
        total_s=time.perf_counter() - started,
        flow_cpu_s=time.process_time() - cpu0,
        server_cpu_s=tree_cpu_s(server_pid) - server0,
    )


def extra_cpu_s(direct: Run, prefect: Run) -> float:
    """CPU seconds the prefect run spent beyond its direct pair. The server's services tick
    whether or not a flow runs, so its direct-run CPU is scaled to the prefect run's length."""
    idle_server = direct.server_cpu_s * prefect.total_s / direct.total_s
    return prefect.flow_cpu_s - direct.flow_cpu_s + prefect.server_cpu_s - idle_server


def summarise(runs: list[Run], step_cpu_s: float) -> dict[str, float]:
    """The overhead per step, bounded from CPU time, and the wall-time ratio with its noise.

    The pool never waits on Prefect (the monitor only reads what the pool committed), so Prefect
    can lengthen a step only by taking CPU the pool would have used: extra CPU per step over the
    step time bounds that, even with the pool on every core. Add the flow's fixed start and
    finish, paid once per stage, spread over the demo's 100 steps.
    """
    pairs = list(
        zip(
            [r for r in runs if r.variant == "direct"],
            [r for r in runs if r.variant == "prefect"],
            strict=True,
        )
    )
    steps = sum(p.steps for _, p in pairs)
    extra_cpu_share = sum(extra_cpu_s(d, p) for d, p in pairs) / steps / step_cpu_s
    fixed_s = statistics.median(p.total_s - p.stage_s for _, p in pairs)
    fixed_share_demo = fixed_s / (DEMO_STEPS * step_cpu_s)
    loops = [d.loop_s for d, _ in pairs]
    return {
        "step_s": step_cpu_s,
        "wall_step_s": statistics.median(d.step_s for d, _ in pairs),
        "overhead": extra_cpu_share + fixed_share_demo,
        "extra_cpu_ms_per_step": 1000.0 * extra_cpu_share * step_cpu_s,
        "extra_cpu_share": extra_cpu_share,
        "fixed_s": fixed_s,
        "fixed_share_demo": fixed_share_demo,
        "loop_ratio": statistics.median(p.loop_s / d.loop_s for d, p in pairs),
        # How much runs without Prefect differ among themselves: the resolution of the ratio.
        "direct_spread": (max(loops) - min(loops)) / statistics.median(loops),
    }


def report(runs: list[Run], summary: dict[str, float]) -> str:
    load1, load5, _ = os.getloadavg()
    lines = [
        f"Prefect overhead per RL step — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} cores, load average {load1:.1f}/{load5:.1f}, "
        f"{summary['step_s']:.1f} CPU s per step",
        "",
        "| run | variant | steps | wall s per step | stage s | call s | flow CPU s "
        "| server CPU s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs, 1):
        lines.append(
            f"| {i} | {r.variant} | {r.steps} | {r.step_s:.3f} | {r.stage_s:.2f} | "
            f"{r.total_s:.2f} | {r.flow_cpu_s:.2f} | {r.server_cpu_s:.2f} |"
        )
    s = summary
    verdict = "met" if s["overhead"] <= TARGET_OVERHEAD else "missed"
    lines += [
        "",
        f"overhead per {s['step_s']:.1f} s step: {100 * s['overhead']:.2f}% "
        f"(target ≤ {100 * TARGET_OVERHEAD:.0f}%: {verdict}) =",
        f"  extra CPU of the flow process and the server: {s['extra_cpu_ms_per_step']:.0f} ms "
        f"per step ({100 * s['extra_cpu_share']:.2f}%)",
        f"  + flow and task start/finish, {s['fixed_s']:.2f} s once per stage "
        f"({100 * s['fixed_share_demo']:.2f}% of a {DEMO_STEPS}-step stage)",
        f"wall time of the pool's steps with Prefect / without (median of pairs): "
        f"{s['loop_ratio']:.3f}; runs without Prefect differ among themselves by "
        f"{100 * s['direct_spread']:.1f}%, the resolution of that ratio on this machine now",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> tuple[list[Run], dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--step-s", type=float, default=5.0, help="CPU seconds per step")
    parser.add_argument("--steps", type=int, default=6, help="steps per run")
    parser.add_argument("--pairs", type=int, default=2, help="direct/prefect pairs")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="primeflow-bench-prefect-") as tmp:
        home = Path(tmp) / "prefect"
        state = server.start(home, port=free_port())
        # Set before Prefect is first imported, so this process never uses ephemeral mode.
        os.environ.update(
            PREFECT_API_URL=state.api_url,
            PREFECT_HOME=str(home),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            DO_NOT_TRACK="1",
        )
        try:
            from tests.bench.prefect.flow import overhead_flow

            overhead_flow(f"file://{tmp}/runs/warm-up", 1, 0.1)  # imports, flow registration
            runs = []
            for pair in range(args.pairs):
                order = ("direct", "prefect") if pair % 2 == 0 else ("prefect", "direct")
                for variant in order:
                    root = f"file://{tmp}/runs/{variant}-{pair}"
                    runs.append(measure(variant, root, args.steps, args.step_s, state.pid))
            # Send the last logs and events while the server still listens.
            from prefect.events.worker import EventsWorker
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=30)
            EventsWorker.drain_all(timeout=30)
        finally:
            server.stop(home)
    summary = summarise(runs, args.step_s)
    print(report(runs, summary))
    print(json.dumps(summary))
    return runs, summary


if __name__ == "__main__":
    main(sys.argv[1:])
