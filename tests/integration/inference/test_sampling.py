"""Sampling through the client against a real vLLM CPU server, checked against transformers.

Tolerance: weights are float32 and both vLLM's CPU kernels and transformers compute in float32,
so per-token log-probs may differ only by summation order. We allow 1e-3 absolute (observed
differences are ~1e-5); token ids must match exactly where decoding is deterministic.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from transformers import AutoTokenizer

from engine.config.orchestrator import SamplingConfig
from engine.inference.client import CONNECTIONS_PER_CLIENT, InferenceClient, InferenceError
from engine.inference.endpoint import Endpoint
from engine.inference.pool import InferencePool
from engine.inference.ports import free_port
from tests.integration.inference.reference import greedy, token_logprobs
from tests.integration.vllm import MAX_MODEL_LEN, Weights

pytestmark = pytest.mark.integration

LOGPROB_TOLERANCE = 1e-3


def chat_prompt(weights: Weights, text: str) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(weights.base)
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)[
        "input_ids"
    ]


def run(coro):
    return asyncio.run(coro)


def test_sampled_tokens_and_logprobs_match_transformers(
    base_pool: InferencePool, weights: Weights
) -> None:
    prompt = chat_prompt(weights, "Reverse this: hello world")
    sampling = SamplingConfig(temperature=0.8, max_tokens=24)

    async def sample():
        async with InferenceClient.from_pool(base_pool) as client:
            return await client.generate(prompt, sampling, n=4)

    samples = run(sample())
    assert len(samples) == 4
    assert len({tuple(s.completion_ids) for s in samples}) > 1  # really sampled
    tokenizer = AutoTokenizer.from_pretrained(weights.base)
    for sample in samples:
        assert sample.prompt_ids == prompt
        assert len(sample.completion_ids) == len(sample.logprobs) > 0
        assert sample.policy_version == 0
        expected = token_logprobs(weights.base, prompt, sample.completion_ids, temperature=0.8)
        worst = max(abs(a - b) for a, b in zip(sample.logprobs, expected, strict=True))
        assert worst < LOGPROB_TOLERANCE
        assert sample.text == tokenizer.decode(sample.completion_ids, skip_special_tokens=True)


def test_greedy_matches_transformers(base_pool: InferencePool, weights: Weights) -> None:
    prompt = chat_prompt(weights, "abc")

    async def sample():
        async with InferenceClient.from_pool(base_pool) as client:
            return await client.generate(prompt, SamplingConfig(temperature=0, max_tokens=32))

    (sample,) = run(sample())
    assert sample.completion_ids == greedy(weights.base, prompt, 32)
    expected = token_logprobs(weights.base, prompt, sample.completion_ids)
    assert max(abs(a - b) for a, b in zip(sample.logprobs, expected, strict=True)) < 1e-4


def test_max_tokens_and_stop_strings(base_pool: InferencePool, weights: Weights) -> None:
    prompt = chat_prompt(weights, "stop here")

    async def sample():
        async with InferenceClient.from_pool(base_pool) as client:
            free = await client.generate(prompt, SamplingConfig(temperature=0, max_tokens=7))
            text = free[0].text
            stop = text[3:5]
            stopped = await client.generate(
                prompt, SamplingConfig(temperature=0, max_tokens=7, stop=[stop])
            )
            return free[0], stopped[0], stop

    free, stopped, stop = run(sample())
    assert len(free.completion_ids) == 7 and free.is_truncated
    assert stopped.finish_reason == "stop" and not stopped.is_truncated
    assert stop not in stopped.text and free.text.startswith(stopped.text)
    assert len(stopped.completion_ids) == len(stopped.logprobs) < 7


def test_batch_under_a_concurrency_cap(base_pool: InferencePool, weights: Weights) -> None:
    prompts = [chat_prompt(weights, f"prompt number {i}") for i in range(12)]

    async def sample():
        async with InferenceClient.from_pool(base_pool, max_concurrent=4) as client:
            return await client.generate_batch(
                prompts, SamplingConfig(temperature=1.0, max_tokens=8), n=3
            )

    groups = run(sample())
    assert [len(group) for group in groups] == [3] * 12
    assert all(s.prompt_ids == p for group, p in zip(groups, prompts, strict=True) for s in group)


def test_more_requests_than_one_connection_pool_holds(
    base_pool: InferencePool, weights: Weights
) -> None:
    """Multi-turn rollouts send one request per turn: the client spreads them over several
    HTTP connection pools (`CONNECTIONS_PER_CLIENT` each), and every answer still reaches the
    request it belongs to."""
    count = 2 * CONNECTIONS_PER_CLIENT + 3
    prompts = [chat_prompt(weights, f"turn {i}") for i in range(count)]

    async def sample():
        async with InferenceClient.from_pool(base_pool, max_concurrent=count) as client:
            answers = await client.generate_batch(
                prompts, SamplingConfig(temperature=1.0, max_tokens=4)
            )
            return answers, client.requests_in_flight

    answers, in_flight = run(sample())
    assert [s.prompt_ids for (s,) in answers] == prompts
    assert all(len(s.completion_ids) == len(s.logprobs) > 0 for (s,) in answers)
    assert in_flight == 0


def test_prompt_too_long_is_a_permanent_error(base_pool: InferencePool) -> None:
    async def sample():
        async with InferenceClient.from_pool(base_pool) as client:
            await client.generate([5] * (MAX_MODEL_LEN + 10), SamplingConfig(max_tokens=4))

    started = time.monotonic()
    with pytest.raises(InferenceError) as error:
        run(sample())
    assert error.value.status == 400 and not error.value.transient
    assert "1034" in str(error.value) or "maximum" in str(error.value).lower()
    assert time.monotonic() - started < 2  # not retried


def test_wrong_api_key_is_refused(base_pool: InferencePool) -> None:
    async def sample():
        async with InferenceClient(base_pool.endpoints, "not-the-key") as client:
            await client.generate([1, 2, 3], SamplingConfig(max_tokens=2))

    with pytest.raises(InferenceError) as error:
        run(sample())
    assert error.value.status == 401


def test_unreachable_server_is_retried_on_another(base_pool: InferencePool) -> None:
    live = base_pool.endpoints[0]
    dead = Endpoint(index=9, base_url=f"http://127.0.0.1:{free_port()}", model=live.model)

    async def sample():
        client = InferenceClient([dead, live], base_pool.api_key, retries=2, backoff_s=0.01)
        async with client:
            return [await client.generate([1, 2, 3], SamplingConfig(max_tokens=2)) for _ in "ab"]

    results = run(sample())
    assert [samples[0].server for samples in results] == [0, 0]
    assert all(len(samples[0].completion_ids) == 2 for samples in results)


def test_all_servers_down_gives_a_clear_error() -> None:
    dead = Endpoint(index=0, base_url=f"http://127.0.0.1:{free_port()}", model="m")

    async def sample():
        async with InferenceClient([dead], "key", retries=1, backoff_s=0.01) as client:
            await client.generate([1], SamplingConfig(max_tokens=1))

    with pytest.raises(InferenceError) as error:
        run(sample())
    assert error.value.transient and "ConnectError" in str(error.value)


def test_control_routes_need_the_key(base_pool: InferencePool) -> None:
    url = base_pool.endpoints[0].base_url
    key = {"Authorization": f"Bearer {base_pool.api_key}"}
    assert httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}).status_code == 403
    assert httpx.post(f"{url}/reset_prefix_cache").status_code == 403
    rpc = {"method": "primeflow_version", "args": []}
    answer = httpx.post(f"{url}/collective_rpc", json=rpc, headers=key, timeout=60)
    assert answer.json() == {"results": [{"version": 0}]}
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/v1/models").status_code == 401
