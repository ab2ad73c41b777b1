"""End-to-end RL benchmark: `max_async_level = 1` against `0` on the reverse-text demo.

Both variants run in one process, one after the other, against one vLLM CPU server and from
the same SFT checkpoint, with the demo's task, model, batch and sampling
(`configs/reverse_text/pipeline.toml`). The trainer and the vLLM server run on separate
cores, as that config places them: the trainer's rank on core 0 with one torch thread
(`trainer.cpu_cores`), the whole server on core 1 (`inference.cpu_cores`). Pinning isolates
the point of async RL: with level 0 the trainer waits for rollouts and vLLM waits for each
checkpoint; with level 1 they overlap.

Reported per variant: RL steps per second over steps 2..N (the first step pays start-up
costs), the steps' mean reward, and the time to reach a training reward (5-step moving average
of the orchestrator's `reward/mean`) when one is given.

    python -m tests.bench.e2e.bench_async --sft-checkpoint file:///path/run/sft/checkpoints/step_000300
    python -m tests.bench.e2e.bench_async            # trains the SFT checkpoint first

Needs at least 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.config import PrimeflowConfig, load_config, with_overrides
from engine.inference.pool import InferencePool
from engine.orchestrator.main import run_orchestrator
from engine.run import local_run_dir, run_store
from engine.trainer.pool import TrainerPool
from storage.commit import latest_committed_step
from storage.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "configs/reverse_text/pipeline.toml"


def base_config(root: Path, args: Sequence[str] = ()) -> PrimeflowConfig:
    return load_config(["@", str(DEMO), "--storage.uri", f"file://{root}", *args])


def train_sft(config: PrimeflowConfig) -> str:
    """Run the demo's SFT stage; the URI of its last checkpoint."""
    config = with_overrides(config, {"run.name": "sft"})
    pool = TrainerPool(config, "sft", log_path=local_run_dir(config) / "logs" / "trainer-sft.log")
    pool.start()
    try:
        code = pool.wait()
    finally:
        pool.stop()
    if code != 0:
        raise RuntimeError(f"SFT failed ({code}); see {pool.log_path}")
    store = run_store(config).child("sft")
    step = latest_committed_step(store, "checkpoints")
    assert step is not None
    return store.url(f"checkpoints/step_{step:06d}")


def run_rl(config: PrimeflowConfig, pool: InferencePool | None, log_name: str) -> float:
    """The RL stage by hand: the trainer pool, and the orchestrator on `pool` (None: the trainer
    alone, on rollouts already committed). Returns the time it started."""
    trainer = TrainerPool(config, "rl", log_path=local_run_dir(config) / "logs" / f"{log_name}.log")
    started = time.time()
    trainer.start()
    try:
        if pool is not None:
            run_orchestrator(config, pool)
        code = trainer.wait()
    finally:
        trainer.stop()
    if code != 0:
        raise RuntimeError(f"RL trainer failed ({code}); see {trainer.log_path}")
    return started


@dataclass
class Variant:
    max_async_level: int
    steps: int
    wall_s: float
    steps_per_s: float
    reward_mean: float
    reward_first: float
    reward_last5: float
    seconds_to_target: float | None
    trainer_wait_s_mean: float


def _moving(values: Sequence[float], window: int = 5) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def run_variant(
    config: PrimeflowConfig,
    pool: InferencePool,
    sft_checkpoint: str,
    level: int,
    target: float | None,
) -> Variant:
    config = with_overrides(
        config,
        {
            "run.name": f"rl-async{level}",
            "orchestrator.max_async_level": level,
            "trainer.init_checkpoint": sft_checkpoint,
        },
    )
    pool.reload(sft_checkpoint, version=0)
    start = run_rl(config, pool, f"trainer-async{level}")
    store = run_store(config)
    lines = read_metrics(store, "rl")
    rewards = [line["reward/mean"] for line in read_metrics(store, "orchestrator")]
    times = [line["time"] for line in lines]
    assert len(lines) == config.max_steps and len(rewards) == config.max_steps
    moving = _moving(rewards)
    reached = next((i for i, value in enumerate(moving) if target and value >= target), None)
    reward_lines = read_metrics(store, "orchestrator")
    return Variant(
        max_async_level=level,
        steps=len(lines),
        wall_s=times[-1] - start,
        steps_per_s=(len(times) - 1) / (times[-1] - times[0]),
        reward_mean=sum(rewards) / len(rewards),
        reward_first=rewards[0],
        reward_last5=moving[-1],
        seconds_to_target=None if reached is None else reward_lines[reached]["time"] - start,
        trainer_wait_s_mean=sum(line.get("wait_seconds", 0.0) for line in lines[1:])
        / max(1, len(lines) - 1),
    )


def save(result: dict, out: str | None) -> None:
    """Write the result as JSON to `out`, when given."""
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")


def emit(result: dict, out: str | None) -> None:
    """Print the result as JSON, and write it to `out` too when given."""
    print(json.dumps(result, indent=2))
    save(result, out)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.e2e.bench_async")
    parser.add_argument("--sft-checkpoint", help="URI of the SFT checkpoint (else train one)")
    parser.add_argument("--steps", type=int, default=12, help="RL steps per variant")
    parser.add_argument("--target", type=float, default=None, help="training reward to reach")
    parser.add_argument("--levels", default="1,0", help="max_async_level values, in run order")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None, help="write the JSON result here too")
    parser.add_argument("overrides", nargs="*", help="extra config flags, e.g. --seq-len 256")
    args = parser.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs at least 2 cores: one for the trainer, one for vLLM")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-e2e-"))
    config = base_config(workdir, [f"--max-steps={args.steps}", *args.overrides])
    load_before = os.getloadavg()
    sft_checkpoint = args.sft_checkpoint or train_sft(config)
    pool = InferencePool(config.inference, log_dir=workdir / "logs")
    pool.start()
    try:
        variants = [
            run_variant(config, pool, sft_checkpoint, int(level), args.target)
            for level in args.levels.split(",")
        ]
    finally:
        pool.stop()
    by_level = {v.max_async_level: v for v in variants}
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cores": os.cpu_count(),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "sft_checkpoint": sft_checkpoint,
        "steps": args.steps,
        "variants": [asdict(v) for v in variants],
    }
    if 0 in by_level and 1 in by_level:
        result["async1_over_async0_steps_per_s"] = by_level[1].steps_per_s / by_level[0].steps_per_s
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
