"""The RL loop on a GPU, step by step: where an RL step's time goes, against its parts alone.

One process, one GPU shared by both pools (`configs/qwen3_0_6b/one_gpu.toml` placement), the
reverse-text task, a built-in offline model (default: Qwen3-0.6B's body). Three phases, in one run:

1. **Sampling alone:** vLLM generates the RL batch's request shape (`orchestrator.batch_size`
   samples, `rollouts_per_example` per prompt, the RL sampling settings) with nothing else on
   the GPU; the median of `--repeats` batches is the sampling time alone, and the generated
   tokens over it vLLM's raw rate.
2. **The loop:** the trainer pool and the orchestrator run `--steps` async RL steps. Per step the
   metrics say how long the trainer waited for rollouts, trained, stalled publishing the policy
   version (waiting for the previous one + the snapshot) and committing a resume checkpoint
   (steps where one is due), and how long the orchestrator spent reloading the pool and blocked
   on the policy.
3. **Training alone:** a second trainer trains on the loop's committed rollouts (all there
   before it starts, vLLM idle) with no checkpoint but the last: its median step time is the
   training time alone, and its tokens per second the trainer's standalone rate.

The headline is `interval_over_parts`: the loop's median step interval over (training alone +
sampling alone), issue 14's measure (target ≤ 1.2). Steps 1-2 pay start-up and are left out.

    python -m tests.bench.e2e.bench_gpu_rl --steps 10 --out bench_gpu_rl.json
    python -m tests.bench.e2e.bench_gpu_rl --model primeflow/qwen3-char-76m -- --seq-len 512
    # the instrument itself on a CPU machine, with the CPU demo's placement:
    python -m tests.bench.e2e.bench_gpu_rl --config configs/reverse_text/pipeline.toml \
        --model primeflow/tiny-qwen3 --steps 5
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from engine.config import PrimeflowConfig, load_config, with_overrides
from engine.envs.reverse_text import prompt_messages, sft_examples
from engine.inference.client import InferenceClient
from engine.inference.pool import InferencePool
from engine.models.resolve import resolve_model
from engine.run import local_run_dir, run_store
from storage.layout import RunLayout
from storage.metrics import read_metrics
from tests.bench.e2e.bench_async import emit, run_rl

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = [ROOT / "configs/qwen3_0_6b/reverse_text.toml", ROOT / "configs/qwen3_0_6b/one_gpu.toml"]
#: Per-step seconds in the table, the interval first, then the parts the breakdown reports.
STEP_TIMES = (
    "interval_s", "train_s", "publish_s", "checkpoint_s", "trainer_wait_s", "reload_s",
    "policy_wait_s",
)  # fmt: skip
#: Steps that pay start-up (the first reloads, compile, allocator growth), left out of medians.
WARMUP_STEPS = 2


def bench_config(
    files: Sequence[str], workdir: Path, model: str, steps: int, extra: Sequence[str]
) -> PrimeflowConfig:
    args = [arg for path in files for arg in ("@", str(path))]
    args += ["--model.name", model, "--storage.uri", f"file://{workdir}", "--run.name", "loop"]
    return load_config([*args, "--max-steps", str(steps), *extra])


def run_facts(config: PrimeflowConfig, model: str, steps: int) -> dict[str, Any]:
    """When and on what a GPU benchmark ran: its result's first keys."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": model,
        "steps": steps,
        "batch_size": config.orchestrator.batch_size,
        "max_tokens": config.orchestrator.sampling.max_tokens,
    }


def sampling_alone(config: PrimeflowConfig, pool: InferencePool, repeats: int) -> dict[str, Any]:
    """Seconds and generated tokens of one RL batch on vLLM with nothing else running."""
    orchestrator = config.orchestrator
    k = orchestrator.rollouts_per_example
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.model.name))
    texts = [row["messages"][1]["content"] for row in sft_examples(512, seed=1)]
    prompts = [
        tokenizer.apply_chat_template(
            prompt_messages(text), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for text in texts
    ]
    groups = orchestrator.batch_size // k

    async def batches() -> list[tuple[float, int]]:
        timings = []
        async with InferenceClient.from_pool(pool, max_concurrent=orchestrator.batch_size) as c:
            for repeat in range(repeats + 1):  # the first batch warms up
                chosen = prompts[repeat * groups : (repeat + 1) * groups]
                started = time.perf_counter()
                samples = await c.generate_batch(chosen, orchestrator.sampling, n=k)
                seconds = time.perf_counter() - started
                tokens = sum(len(s.completion_ids) for group in samples for s in group)
                timings.append((seconds, tokens))
        return timings[1:]

    timings = asyncio.run(batches())
    seconds = statistics.median(s for s, _ in timings)
    tokens = statistics.median(t for _, t in timings)
    return {"batch_s": seconds, "batch_tokens": tokens, "tokens_per_s": tokens / seconds}


def step_times(train: list[dict], orch: list[dict], started: float) -> list[dict[str, Any]]:
    """Per committed step of one run: its interval and its parts (`STEP_TIMES`), from the
    trainer's (`train`) and the orchestrator's (`orch`) metrics; `started`: the run's start."""
    return [
        {
            "step": t["step"],
            "time": t["time"],
            "interval_s": t["time"] - previous["time"] if previous else t["time"] - started,
            "trainer_wait_s": t["wait_seconds"],
            "train_s": t["step_seconds"],
            "checkpoint_s": t["checkpoint_seconds"],
            "publish_s": t["publish_wait_seconds"] + t["publish_snapshot_seconds"],
            "reload_s": o["time/reload_s"],
            "policy_wait_s": o["time/policy_wait_s"],
            "sample_step_s": o["time/step_s"],
            "sampled_tokens": o["sampled_tokens"],
            "trained_tokens": t["tokens"],
        }
        for previous, t, o in zip([None, *train[:-1]], train, orch, strict=True)
    ]


def the_loop(config: PrimeflowConfig, pool: InferencePool) -> dict[str, Any]:
    """Run the RL steps; per step, the trainer's and the orchestrator's timings."""
    started = run_rl(config, pool, "trainer")
    store = run_store(config)
    train, orch = read_metrics(store, "rl"), read_metrics(store, "orchestrator")
    return {"wall_s": train[-1]["time"] - started, "steps": step_times(train, orch, started)}


def training_alone(config: PrimeflowConfig, workdir: Path) -> dict[str, Any]:
    """The same steps again on the committed rollouts, checkpointing only at the end."""
    steps = config.max_steps
    assert steps is not None
    alone = with_overrides(
        config,
        {
            "run.name": "alone",
            "trainer.checkpoint.interval": steps,
            "orchestrator.max_async_level": steps,
        },
    )
    shutil.copytree(
        local_run_dir(config) / RunLayout.ROLLOUTS, local_run_dir(alone) / RunLayout.ROLLOUTS
    )
    run_rl(alone, None, "trainer-alone")
    lines = read_metrics(run_store(alone), "rl")[WARMUP_STEPS:-1]
    return {
        "train_s": statistics.median(line["step_seconds"] for line in lines),
        "tokens_per_s": statistics.median(line["tokens_per_second"] for line in lines),
    }


def summarise(loop: dict, sampling: dict, training: dict) -> dict[str, Any]:
    steady = loop["steps"][WARMUP_STEPS:]

    def median(key: str) -> float:
        return statistics.median(step[key] for step in steady)

    interval = median("interval_s")
    parts = training["train_s"] + sampling["batch_s"]
    seconds = sum(step["interval_s"] for step in steady)
    return {
        "interval_s": interval,
        "train_alone_s": training["train_s"],
        "sample_alone_s": sampling["batch_s"],
        "interval_over_parts": interval / parts,
        "breakdown_median_s": {key: median(key) for key in STEP_TIMES[1:]},
        "loop_sampled_tokens_per_s": sum(s["sampled_tokens"] for s in steady) / seconds,
        "vllm_alone_tokens_per_s": sampling["tokens_per_s"],
        "loop_trained_tokens_per_s": sum(s["trained_tokens"] for s in steady) / seconds,
        "trainer_alone_tokens_per_s": training["tokens_per_s"],
    }


def table(result: dict[str, Any]) -> str:
    """The per-step table and the summary as Markdown, for docs/benchmarks.md."""
    keys = list(STEP_TIMES)
    rows = ["| step | " + " | ".join(keys) + " | sampled tokens |", "|---" * (len(keys) + 2) + "|"]
    for step in result["loop"]["steps"]:
        cells = " | ".join(f"{step[key]:.2f}" for key in keys)
        rows.append(f"| {step['step']} | {cells} | {step['sampled_tokens']} |")
    summary = result["summary"]
    rows.append("")
    rows += [f"- {key}: {value}" for key, value in summary.items()]
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.e2e.bench_gpu_rl")
    parser.add_argument("--model", default="primeflow/qwen3-0.6b-body")
    parser.add_argument(
        "--config",
        action="append",
        help="config files composed in order (default: the Qwen3-0.6B recipe on one GPU)",
    )
    parser.add_argument("--steps", type=int, default=10, help="RL steps in the loop")
    parser.add_argument("--repeats", type=int, default=3, help="batches timed for phase 1")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None, help="write the JSON result here too")
    parser.add_argument("overrides", nargs="*", help="extra config flags, after --")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS + 1:
        parser.error(f"--steps must be more than {WARMUP_STEPS + 1}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-gpu-rl-"))
    files = args.config or [str(path) for path in CONFIGS]
    config = bench_config(files, workdir, args.model, args.steps, args.overrides)
    pool = InferencePool(config.inference, log_dir=workdir / "logs")
    started = time.perf_counter()
    pool.start()
    startup_s = time.perf_counter() - started
    try:
        sampling = sampling_alone(config, pool, args.repeats)
        loop = the_loop(config, pool)
    finally:
        pool.stop()
    training = training_alone(config, workdir)
    result = {
        **run_facts(config, args.model, args.steps),
        "vllm_startup_s": startup_s,
        "sampling_alone": sampling,
        "training_alone": training,
        "loop": loop,
        "summary": summarise(loop, sampling, training),
    }
    emit(result, args.out)
    print(table(result))
    if args.out:
        Path(args.out).with_suffix(".md").write_text(table(result) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
