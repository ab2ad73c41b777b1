"""Sampled tokens/s of long agentic rollouts (several turns, a slow tool between them) against
single-turn rollouts of the same environment, at the same batch (issue 31).

The environment is alphabet-sort: `num_turns` model turns, each environment reply after
`response_delay_s` (the latency of a tool). The orchestrator runs alone on one pool (no
trainer: `max_async_level` is the step count, so every step may use the starting policy), and
each arm's rate is the sampled tokens it committed over the time from its first step's start
to its last commit (give it many more rollouts than are in flight at once). While a rollout
waits for its tool it samples nothing, so with as many rollouts in flight as requests the
server idles; issue 31's target is ≥ 0.7× the single-turn rate.

    python -m tests.bench.e2e.bench_agentic                           # CPU: the tiny model
    python -m tests.bench.e2e.bench_agentic --config configs/reverse_text/gpu.toml --steps 8
    python -m tests.bench.e2e.bench_agentic --arm "t4-c256=4 1.0 --orchestrator.max-concurrent 256"

An arm is `NAME=TURNS DELAY_S [FLAGS...]`; the first arm is the baseline of the ratios. Its flag
`--client-connections N` (the bench's, not a config flag) sets how many connections each of the
client's HTTP pools holds (`CONNECTIONS_PER_CLIENT`), e.g. 100000 for one pool, as before it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.config import PrimeflowConfig, load_config
from engine.inference import client
from engine.inference.pool import InferencePool
from engine.orchestrator.main import run_orchestrator
from engine.run import local_run_dir, run_store
from storage.metrics import read_metrics

DEFAULT_ARMS = (
    "single=1 0",
    "t4-d0.5=4 0.5",
    "t4-d2=4 2.0",
    "t8-d1=8 1.0",
)


def parse_arm(text: str) -> tuple[str, int, float, list[str]]:
    """`NAME=TURNS DELAY_S [FLAGS...]` → (name, turns, delay, flags)."""
    name, sep, rest = text.partition("=")
    words = shlex.split(rest)
    if not sep or not name or len(words) < 2:
        raise SystemExit(f"--arm {text!r}: give NAME=TURNS DELAY_S [FLAGS...]")
    return name, int(words[0]), float(words[1]), words[2:]


def client_connections(flags: list[str]) -> tuple[int, list[str]]:
    """The arm's `--client-connections N` (default: the client's own) and its other flags."""
    if "--client-connections" not in flags:
        return client.CONNECTIONS_PER_CLIENT, flags
    at = flags.index("--client-connections")
    return int(flags[at + 1]), flags[:at] + flags[at + 2 :]


def arm_config(
    args: argparse.Namespace, root: Path, name: str, turns: int, delay: float, flags: list[str]
) -> PrimeflowConfig:
    files = [item for path in args.config or [] for item in ("@", str(path))]
    env = {"num_turns": turns, "response_delay_s": delay, "num_train_examples": 1000}
    return load_config(
        [
            *files,
            "--storage.uri", f"file://{root}",
            "--run.name", name,
            "--max-steps", str(args.steps),
            "--seq-len", str(args.seq_len),
            "--orchestrator.max-async-level", str(args.steps),
            "--orchestrator.batch-size", str(args.batch_size),
            "--orchestrator.rollouts-per-example", "8",
            "--orchestrator.sampling.max-tokens", str(args.max_tokens),
            "--orchestrator.envs", json.dumps([{"id": "alphabet-sort", "args": env}]),
            *args.overrides,
            *flags,
        ]
    )  # fmt: skip


def measure(config: PrimeflowConfig, pool: InferencePool) -> dict[str, Any]:
    """Run the arm's steps on `pool`; its rates from the orchestrator's lines."""
    started = time.monotonic()
    run_orchestrator(config, pool)
    wall = time.monotonic() - started
    lines = read_metrics(run_store(config), "orchestrator")
    # Every committed token over the time from the first step's start to the last commit: the
    # loop samples ahead (up to max_concurrent rollouts), so one step's own rate says little,
    # and what is still in flight at the end is not counted (a rate a little low, the more so
    # the more rollouts are in flight against the steps' total).
    origin = lines[0]["time"] - lines[0]["time/step_s"]
    span = lines[-1]["time"] - origin
    return {
        "steps": len(lines),
        "wall_s": wall,
        "tokens_per_s": sum(line["sampled_tokens"] for line in lines) / span,
        "sampled_tokens_per_step": statistics.median(line["sampled_tokens"] for line in lines),
        "step_s": span / len(lines),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.e2e.bench_agentic")
    parser.add_argument("--config", action="append", help="config file(s); default: built-in")
    parser.add_argument("--arm", action="append", help="NAME=TURNS DELAY_S [FLAGS...]")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out", default=None, help="JSON of the results")
    parser.add_argument("overrides", nargs="*", help="flags for every arm, after --")
    args = parser.parse_args(argv)
    arms = [parse_arm(text) for text in args.arm or DEFAULT_ARMS]
    connections = {name: client_connections(flags) for name, _, _, flags in arms}
    root = Path(tempfile.mkdtemp(prefix="bench-agentic-"))
    configs = {
        name: arm_config(args, root, name, t, d, connections[name][1]) for name, t, d, _ in arms
    }
    first = next(iter(configs.values()))
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    shipped = client.CONNECTIONS_PER_CLIENT
    with InferencePool.for_run(first, local_run_dir(first) / "logs") as pool:
        for (name, turns, delay, flags), config in zip(arms, configs.values(), strict=True):
            client.CONNECTIONS_PER_CLIENT = connections[name][0]
            results[name] = {"turns": turns, "delay_s": delay, "flags": flags}
            try:
                results[name].update(measure(config, pool))
            finally:
                client.CONNECTIONS_PER_CLIENT = shipped
            print(name, json.dumps(results[name]), flush=True)
    base = results[arms[0][0]]["tokens_per_s"]
    print(f"\n| arm | turns | tool latency | tokens/s | × {arms[0][0]} | step |")
    print("|---|---|---|---|---|---|")
    for name, turns, delay, _ in arms:
        arm = results[name]
        arm["ratio"] = arm["tokens_per_s"] / base
        print(f"| {name} | {turns} | {delay:g} s | {arm['tokens_per_s']:,.0f} | "
              f"**{arm['ratio']:.2f}×** | {arm['step_s']:.2f} s |")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
