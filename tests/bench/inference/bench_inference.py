"""Inference benchmark: our client against a plain OpenAI client, and reload latency vs size.

    .venv/bin/python -m tests.bench.inference.bench_inference
    .venv/bin/python -m tests.bench.inference.bench_inference --part throughput --rounds 5
    .venv/bin/python -m tests.bench.inference.bench_inference --part reload

**Throughput.** One vLLM CPU server serves the demo's tiny model. The same rollout batch (chat
prompts as token ids, each sent `--n` times, log-probs and token ids requested) goes through
`InferenceClient` and through `openai.AsyncOpenAI` behind an `asyncio.Semaphore`, each with
`--concurrency` requests in flight, each client in its own process. Decoding is greedy so both
make the server do exactly the same work (vLLM refuses `n > 1` when greedy, hence the repeats);
prefix caching is off so no run profits from another. Two measurements per round:

- *alone*: each client runs the batch by itself, twice per round in A B B A order; completion
  tokens per second of each, and the median over rounds of their ratio. On a machine others
  share this swings with their load.
- *together*: both clients run the batch at the same moment against the same server; the ratio of
  tokens each completed while both were running. Both see the same load at the same time, so this
  ratio is steady where the alone numbers are not; it is the figure to compare against 1.

- *one at a time*: single requests, alternating between the clients request by request; the
  paired difference of their latencies is each client's own per-request cost, and load that
  comes and goes hits both alike.

**Reload latency.** For tiny-Qwen3 shapes of growing size, a server starts on one seed's weights
and `InferencePool.reload` swaps in another seed's, `--repeats` times; reported is the median
wall time of the whole reload (pause, validate, load, re-pack, version stamp, resume) against the
checkpoint's size on disk.

The file name does not match `test_*.py`, so test runs never collect it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from openai import AsyncOpenAI
from transformers import AutoTokenizer

from engine.config.inference import InferenceConfig
from engine.config.orchestrator import SamplingConfig
from engine.inference.client import InferenceClient
from engine.inference.endpoint import Endpoint
from engine.inference.pool import InferencePool
from engine.models.tiny import TinyModelSpec, write_tiny_model

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
]


def server_config(model: Path, max_model_len: int) -> InferenceConfig:
    return InferenceConfig(
        model=str(model),
        max_model_len=max_model_len,
        dtype="float32",
        kv_cache_gb=1.0,
        extra_args=["-O0", "--no-enable-prefix-caching"],
    )


def rollout_prompts(model: Path, count: int) -> list[list[int]]:
    """Reverse-text-like chat prompts, rendered once to token ids as the orchestrator does."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = []
    for i in range(count):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + i % 7))
        messages = [
            {"role": "system", "content": "Reverse the text character by character."},
            {"role": "user", "content": text},
        ]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"]))
    return prompts


Completions = list[tuple[float, int]]  # (wall-clock time a request finished, its tokens)


async def ours(
    endpoint: Endpoint, api_key: str, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> Completions:
    done: Completions = []
    sampling = SamplingConfig(temperature=0, max_tokens=max_tokens)
    async with InferenceClient([endpoint], api_key, max_concurrent=concurrency) as client:

        async def one(prompt: list[int]) -> None:
            (sample,) = await client.generate(prompt, sampling)
            done.append((time.time(), len(sample.completion_ids)))

        await asyncio.gather(*(one(p) for p in prompts))
    return done


async def plain(
    endpoint: Endpoint, api_key: str, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> Completions:
    done: Completions = []
    client = AsyncOpenAI(base_url=f"{endpoint.base_url}/v1", api_key=api_key, max_retries=0)
    slots = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int]) -> None:
        async with slots:
            response = await client.completions.create(
                model=endpoint.model,
                prompt=prompt,
                temperature=0,
                max_tokens=max_tokens,
                logprobs=0,
                extra_body={"return_token_ids": True},
            )
        done.append((time.time(), len(response.choices[0].token_ids)))  # type: ignore[attr-defined]

    async with client:
        await asyncio.gather(*(one(p) for p in prompts))
    return done


CLIENTS = {"ours": ours, "plain": plain}


def drive(
    name: str,
    endpoint: Endpoint,
    api_key: str,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    start_at: float,
) -> Completions:
    """One client's whole batch, in its own process, starting at wall-clock `start_at`."""
    time.sleep(max(0.0, start_at - time.time()))
    return asyncio.run(CLIENTS[name](endpoint, api_key, prompts, concurrency, max_tokens))


def tokens_per_s(done: Completions, start: float, until: float) -> float:
    return sum(tokens for finished, tokens in done if finished <= until) / (until - start)


async def interleaved_latency(
    endpoint: Endpoint, api_key: str, prompts: list[list[int]], max_tokens: int
) -> tuple[list[float], list[float]]:
    """One request at a time, alternating clients request by request (ABBA...): per-request
    latency of each under the same load at the same moment."""
    sampling = SamplingConfig(temperature=0, max_tokens=max_tokens)
    body = {"temperature": 0, "max_tokens": max_tokens, "logprobs": 0}
    latency: dict[str, list[float]] = {"ours": [], "plain": []}
    plain_client = AsyncOpenAI(base_url=f"{endpoint.base_url}/v1", api_key=api_key, max_retries=0)
    async with InferenceClient([endpoint], api_key) as ours_client, plain_client:
        for index, prompt in enumerate(prompts):
            for name in ("ours", "plain") if index % 2 == 0 else ("plain", "ours"):
                started = time.perf_counter()
                if name == "ours":
                    await ours_client.generate(prompt, sampling)
                else:
                    await plain_client.completions.create(
                        model=endpoint.model,
                        prompt=prompt,
                        extra_body={"return_token_ids": True},
                        **body,  # type: ignore[arg-type]
                    )
                latency[name].append(time.perf_counter() - started)
    return latency["ours"], latency["plain"]


def throughput(args: argparse.Namespace, workdir: Path) -> None:
    model = write_tiny_model(workdir / "tiny")
    prompts = [p for p in rollout_prompts(model, args.prompts) for _ in range(args.n)]
    sequential: dict[str, list[float]] = {"ours": [], "plain": []}
    head_to_head: list[float] = []
    context = multiprocessing.get_context("spawn")
    with (
        InferencePool(server_config(model, 1024), log_dir=workdir / "logs") as pool,
        ProcessPoolExecutor(max_workers=2, mp_context=context) as processes,
    ):
        endpoint, key = pool.endpoints[0], pool.api_key
        common = (endpoint, key, prompts, args.concurrency, args.max_tokens)
        # Warm-up, which also starts both worker processes (their imports take seconds).
        warm = [processes.submit(drive, n, *common[:2], prompts[:32], 4, 8, 0.0) for n in CLIENTS]
        for future in warm:
            future.result()
        for index in range(args.rounds):
            # Alone, one after the other, in A B B A order (B A A B in odd rounds) so that drift
            # and whichever-runs-first effects fall on both clients alike.
            first, second = ("ours", "plain") if index % 2 == 0 else ("plain", "ours")
            runs: dict[str, list[float]] = {"ours": [], "plain": []}
            for name in (first, second, second, first):
                start = time.time() + 1.0
                done = processes.submit(drive, name, *common, start).result()
                runs[name].append(tokens_per_s(done, start, max(t for t, _ in done)))
            for name, values in runs.items():
                sequential[name].append(statistics.mean(values))
            # Together, each in its own process: both see the same load at the same moment.
            start = time.time() + 2.0
            futures = {name: processes.submit(drive, name, *common, start) for name in CLIENTS}
            done = {name: future.result() for name, future in futures.items()}
            until = min(max(t for t, _ in d) for d in done.values())
            head_to_head.append(
                tokens_per_s(done["ours"], start, until) / tokens_per_s(done["plain"], start, until)
            )
            print(
                f"  round {index}: alone ours {sequential['ours'][-1]:.0f} tok/s, plain "
                f"{sequential['plain'][-1]:.0f} tok/s; together ours/plain {head_to_head[-1]:.3f}",
                flush=True,
            )
        asyncio.run(interleaved_latency(endpoint, key, prompts[:10], 16))  # warm-up
        ours_s, plain_s = asyncio.run(interleaved_latency(endpoint, key, prompts, 16))
    alone = {name: statistics.median(values) for name, values in sequential.items()}
    alone_ratios = sorted(
        o / p for o, p in zip(sequential["ours"], sequential["plain"], strict=True)
    )
    print(
        f"throughput: {args.prompts} prompts x {args.n} samples, greedy, max_tokens="
        f"{args.max_tokens}, {args.concurrency} requests in flight per client"
    )
    print(
        f"  alone:    ours {alone['ours']:.0f} tok/s, plain OpenAI client {alone['plain']:.0f} "
        f"tok/s; ratio median {statistics.median(alone_ratios):.3f} "
        f"(rounds: {', '.join(f'{r:.3f}' for r in alone_ratios)})"
    )
    print(
        f"  together: ratio median {statistics.median(head_to_head):.3f} "
        f"(rounds: {', '.join(f'{r:.3f}' for r in sorted(head_to_head))})"
    )
    diffs = [(o - p) * 1000 for o, p in zip(ours_s, plain_s, strict=True)]
    ours_ms, plain_ms = statistics.median(ours_s) * 1000, statistics.median(plain_s) * 1000
    print(
        f"  one request at a time, interleaved ({len(diffs)} each, max_tokens=16): median "
        f"latency ours {ours_ms:.1f} ms, plain {plain_ms:.1f} ms; paired difference "
        f"ours - plain {statistics.median(diffs):+.1f} ms"
    )


RELOAD_SHAPES = {
    "tiny (demo)": TinyModelSpec(),
    "h512 x4": TinyModelSpec(
        hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=8, intermediate_size=1536
    ),
    "h1024 x8": TinyModelSpec(
        hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, intermediate_size=3072
    ),
}


def reload_latency(args: argparse.Namespace, workdir: Path) -> None:
    print(f"reload latency (median of {args.repeats} reloads):")
    print(f"  {'shape':12s} {'params':>8s} {'size MB':>8s} {'reload ms':>10s} {'MB/s':>8s}")
    for name, spec in RELOAD_SHAPES.items():
        base = write_tiny_model(workdir / f"{name}-a", spec)
        other = write_tiny_model(workdir / f"{name}-b", dataclasses.replace(spec, seed=1))
        size_mb = (other / "model.safetensors").stat().st_size / 1e6
        params = size_mb * 1e6 / 4
        with InferencePool(server_config(base, 256), log_dir=workdir / f"logs-{name}") as pool:
            times = []
            for repeat in range(args.repeats):
                folder, version = (other, repeat + 1) if repeat % 2 == 0 else (base, repeat + 1)
                started = time.perf_counter()
                pool.reload(folder, version=version)
                times.append(time.perf_counter() - started)
        ms = statistics.median(times) * 1000
        print(
            f"  {name:12s} {params / 1e6:7.1f}M {size_mb:8.1f} {ms:10.0f} "
            f"{size_mb / (ms / 1000):8.0f}",
            flush=True,
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "throughput", "reload"], default="all")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per client")
    parser.add_argument("--repeats", type=int, default=6, help="reloads per shape")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-inference-") as tmp:
        if args.part in ("all", "throughput"):
            throughput(args, Path(tmp))
        if args.part in ("all", "reload"):
            reload_latency(args, Path(tmp))


if __name__ == "__main__":
    main()
