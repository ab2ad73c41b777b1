"""End-to-end RL benchmark against TRL: wall time to a training reward from one SFT checkpoint.

Same task (reverse-text train split, same seed), model (the demo's SFT checkpoint), batch
(16 prompts × 8 samples), sampling (temperature 1.0, 64 tokens), learning rate, no KL, group-mean
baseline. primeflow runs its RL stage (`max_async_level = 1`, trainer on core 0, vLLM on core 1,
as `bench_async.py`); TRL runs `GRPOTrainer` on the same 2 cores in its own virtual environment
(`--trl-python`, e.g. /tmp/trl-venv/bin/python with `pip install torch==2.13.0 trl`), generating
with transformers since TRL's vLLM path needs CUDA.

Reported: for each, seconds from launch until the 5-step moving average of the training reward
first reaches `--target`, and steps per second; the ratio TRL / primeflow. primeflow's clock
starts when its trainer pool starts against an inference pool that is already up (the pipeline
keeps one up across stages); TRL's when its process starts.

    python -m tests.bench.e2e.bench_trl --sft-checkpoint file:///.../sft/checkpoints/step_000300 \
        --trl-python /tmp/trl-venv/bin/python --target 0.6 --steps 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from engine.envs.reverse_text import SYSTEM_PROMPT, make_splits, prompt_messages
from engine.inference.pool import InferencePool
from engine.local_checkpoints import local_checkpoint
from engine.models.tiny import default_cache_dir
from tests.bench.e2e.bench_async import _moving, base_config, emit, run_variant

HERE = Path(__file__).resolve().parent


def write_prompts(path: Path, num: int, seed: int, system_prompt: str = SYSTEM_PROMPT) -> None:
    """The train split's prompts, as the recipe's reverse-text environment renders them."""
    train, _ = make_splits(num, 0, seed)
    with path.open("w", encoding="utf-8") as out:
        for text in train:
            row = {"prompt": prompt_messages(text, system_prompt), "answer": text[::-1]}
            out.write(json.dumps(row) + "\n")


def json_lines(text: str) -> list[dict]:
    """The JSON objects trl_grpo.py printed, one per line; transformers' own log lines (Python
    dict reprs) and progress bars sharing a line are skipped."""
    found = []
    for line in text.splitlines():
        start = line.find('{"')
        if start < 0:
            continue
        try:
            found.append(json.loads(line[start:]))
        except json.JSONDecodeError:
            continue
    return found


@contextlib.contextmanager
def pinned(cores: set[int]) -> Iterator[None]:
    """Bind this process (and what it starts meanwhile) to `cores`; restore on exit."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run_trl(
    python: str, model: Path, data: Path, workdir: Path, steps: int, lr: float, cores: set[int]
) -> list[dict]:
    command = [
        python,
        str(HERE / "trl_grpo.py"),
        f"--model={model}",
        f"--data={data}",
        f"--steps={steps}",
        f"--lr={lr}",
        f"--output-dir={workdir / 'trl-out'}",
    ]
    start = time.time()
    with pinned(cores):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    (workdir / "trl.log").write_text(result.stdout + "\n" + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"TRL failed ({result.returncode}); see {workdir / 'trl.log'}")
    lines = [entry for entry in json_lines(result.stdout) if "reward" in entry]
    launch_overhead = 0.0
    summary = [entry for entry in json_lines(result.stdout) if entry.get("summary")]
    if summary:
        launch_overhead = (time.time() - start) - summary[-1]["wall_s"]
    for entry in lines:
        entry["time_from_launch"] = entry["time"] + launch_overhead
    return lines


def time_to_target(times: Sequence[float], rewards: Sequence[float], target: float) -> float | None:
    for t, value in zip(times, _moving(rewards), strict=True):
        if value >= target:
            return t
    return None


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.e2e.bench_trl")
    parser.add_argument("--sft-checkpoint", required=True)
    parser.add_argument("--trl-python", required=True)
    parser.add_argument("--target", type=float, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-primeflow", action="store_true")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-trl-"))
    config = base_config(workdir, [f"--max-steps={args.steps}"])
    lr = config.trainer.optim.lr
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_avg_before": os.getloadavg(),
        "target": args.target,
        "steps": args.steps,
        "lr": lr,
    }
    if not args.skip_primeflow:
        pool = InferencePool(config.inference, log_dir=workdir / "logs")
        pool.start()
        try:
            variant = run_variant(config, pool, args.sft_checkpoint, 1, args.target)
        finally:
            pool.stop()
        result["primeflow"] = {
            "seconds_to_target": variant.seconds_to_target,
            "steps_per_s": variant.steps_per_s,
            "wall_s": variant.wall_s,
            "reward_first": variant.reward_first,
            "reward_last5": variant.reward_last5,
        }
    data = workdir / "prompts.jsonl"
    write_prompts(data, 10_000, config.run.seed)
    model = local_checkpoint(args.sft_checkpoint, default_cache_dir())
    lines = run_trl(args.trl_python, model, data, workdir, args.steps, lr, {0, 1})
    times = [entry["time_from_launch"] for entry in lines]
    rewards = [entry["reward"] for entry in lines]
    result["trl"] = {
        "seconds_to_target": time_to_target(times, rewards, args.target),
        "steps_per_s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None,
        "wall_s": times[-1] if times else None,
        "reward_first": rewards[0] if rewards else None,
        "reward_last5": _moving(rewards)[-1] if rewards else None,
    }
    result["load_avg_after"] = os.getloadavg()
    ours = result.get("primeflow", {}).get("seconds_to_target")
    theirs = result["trl"]["seconds_to_target"]
    if ours and theirs:
        result["trl_over_primeflow_time_to_target"] = theirs / ours
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
