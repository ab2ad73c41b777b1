"""Soak: the demo pipeline with 300 RL steps, watching every long-lived process's memory.

    python -m tests.soak.soak [--steps 300] [--out soak.json] [extra primeflow flags]
    make soak

Runs `primeflow pipeline @ configs/reverse_text/pipeline.toml` (SFT, then `--steps` RL steps,
small evaluations) as a user would, and samples the resident memory (RSS) of the flow process
and of everything it started (the vLLM server's processes, torchrun, the trainer rank) every few
seconds, with the RL step the run had committed at that moment. Reported per process: the peak
RSS over the first tenth of the RL steps after `--warmup` and over the last tenth, and the
growth between them (target < 10%); and the RL step time per block of 50 steps, from the
trainer's metric lines (steady, or drifting?). Exits 1 when the run fails or a process grows by
10% or more.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

from storage.commit import latest_committed_step
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.store import ObjectStore

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs/reverse_text/pipeline.toml"
MAX_GROWTH = 0.10
#: Process roles by what their command line runs (vLLM's processes retitle themselves).
ROLES = {
    "VLLM::EngineCore": "vllm engine core",
    "VLLM::Worker": "vllm worker",
    "engine.inference.launch": "vllm api server",
    "torch.distributed.run": "torchrun",
    "engine.trainer.worker": "trainer rank",
    "primeflow": "flow process",
}


def role(process: psutil.Process) -> str | None:
    try:
        command = " ".join(process.cmdline())
    except psutil.Error:
        return None
    return next((name for mark, name in ROLES.items() if mark in command), None)


def sample(flow: psutil.Process) -> dict[str, float]:
    """RSS in MiB per role, over the flow process and all its descendants (summed per role)."""
    rss: dict[str, float] = defaultdict(float)
    try:
        processes = [flow, *flow.children(recursive=True)]
    except psutil.Error:
        return {}
    for process in processes:
        name = role(process)
        if name is None:
            continue
        try:
            rss[name] += process.memory_info().rss / 2**20
        except psutil.Error:
            continue
    return dict(rss)


def growth(samples: list[dict[str, Any]], warmup: int, steps: int) -> dict[str, dict[str, float]]:
    """Per role: the peak RSS over the first tenth of the RL steps after warm-up and over the
    last tenth, and their ratio minus one.

    Peaks of equal windows, not a single sample against a peak: the trainer's RSS swings by
    ~30% within a step (activations, Arrow tables), so one sample against a window's peak
    would measure where in its step the sample fell.
    """
    width = max(1, steps // 10)
    result = {}
    roles = {name for entry in samples for name in entry["rss"]}
    for name in sorted(roles):
        present = [s for s in samples if name in s["rss"]]
        first = [s["rss"][name] for s in present if warmup <= s["step"] < warmup + width]
        last = [s["rss"][name] for s in present if s["step"] >= steps - width]
        if not first or not last:
            continue  # a process of SFT or evaluation only: not long-lived through RL
        result[name] = {
            "after_warmup_peak_mib": max(first),
            "last_tenth_peak_mib": max(last),
            "growth": max(last) / max(first) - 1,
        }
    return result


def step_times(store: ObjectStore, block: int = 50) -> list[dict[str, float]]:
    """Mean RL step time per block of `block` steps (from the metric lines' wall clock)."""
    lines = sorted(read_metrics(store, "rl"), key=lambda line: line["step"])
    times = [line["time"] for line in lines]
    blocks = []
    for start in range(1, len(times), block):
        chunk = times[start - 1 : start + block]
        if len(chunk) > 1:
            blocks.append(
                {
                    "steps": f"{start + 1}-{start + len(chunk) - 1}",
                    "seconds_per_step": (chunk[-1] - chunk[0]) / (len(chunk) - 1),
                }
            )
    return blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak.soak")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20, help="RL step where memory is read")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--runs", default=None, help="storage folder (default: a temp dir)")
    parser.add_argument("--out", default=None, help="write the JSON report here too")
    args, extra = parser.parse_known_args(argv)
    runs = Path(args.runs or tempfile.mkdtemp(prefix="primeflow-soak-")).resolve()
    command = [
        str(Path(sys.executable).with_name("primeflow")),
        "pipeline",
        "@",
        str(DEMO),
        f"--max-steps={args.steps}",
        "--run.name=soak",
        f"--storage.uri=file://{runs}",
        "--eval.num-examples=16",
        *extra,
    ]
    store = ObjectStore(f"file://{runs}/soak")
    started = time.time()
    process = subprocess.Popen(command, cwd=ROOT)
    flow = psutil.Process(process.pid)
    samples: list[dict[str, Any]] = []
    while process.poll() is None:
        step = latest_committed_step(store, RunLayout.ROLLOUTS)  # None until the first
        samples.append({"time": time.time() - started, "step": step or 0, "rss": sample(flow)})
        time.sleep(args.interval)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "command": command,
        "exit_code": process.returncode,
        "wall_s": time.time() - started,
        "load_avg_end": list(psutil.getloadavg()),
        "memory": growth(samples, args.warmup, args.steps),
        "step_times": step_times(store) if process.returncode == 0 else [],
        "samples": samples,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nsoak: exit {process.returncode}, {report['wall_s'] / 60:.1f} min, run {runs}/soak")
    for name, entry in report["memory"].items():
        print(
            f"  {name:18} peak RSS {entry['after_warmup_peak_mib']:7.0f} MiB after warm-up -> "
            f"{entry['last_tenth_peak_mib']:7.0f} MiB in the last tenth: {entry['growth']:+.1%}"
        )
    for block in report["step_times"]:
        print(f"  RL steps {block['steps']:>9}: {block['seconds_per_step']:.2f} s/step")
    grown = [name for name, e in report["memory"].items() if e["growth"] >= MAX_GROWTH]
    if grown:
        print(f"  grew by {MAX_GROWTH:.0%} or more: {', '.join(grown)}")
    if process.returncode != 0 or grown or not report["memory"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
