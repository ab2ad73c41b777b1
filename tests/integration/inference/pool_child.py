"""A process that owns a pool, for tests that must kill the pool's owner.

    python -m tests.integration.inference.pool_child '<json>'

The JSON names a model folder (`base`), a second checkpoint (`other`), a log folder and a prompt.
The child starts a pool on `base` with two API-server processes (`inference.api_servers`),
samples greedily, reloads `other`, samples again from `CLIENTS` clients at once (each its own
connection, which the kernel hands to either process), prints one JSON line with the results,
then serves until it is killed. Its process groups are in the pool's record,
`<logs>/inference-pool.json`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

from engine.config.inference import InferenceConfig
from engine.config.orchestrator import SamplingConfig
from engine.inference.client import InferenceClient
from engine.inference.pool import InferencePool

#: Clients sampling at once after the reload.
CLIENTS = 6


async def greedy(pool: InferencePool, prompt: list[int], max_tokens: int) -> dict:
    async with InferenceClient.from_pool(pool) as client:
        sampling = SamplingConfig(temperature=0, max_tokens=max_tokens)
        (sample,) = await client.generate(prompt, sampling)
    return {
        "ids": sample.completion_ids,
        "logprobs": sample.logprobs,
        "version": sample.policy_version,
    }


def main(argv: list[str]) -> None:
    job = json.loads(argv[1])
    config = InferenceConfig(
        model=job["base"],
        max_model_len=512,
        dtype="float32",
        kv_cache_gb=0.25,
        api_servers=2,
        extra_args=["-O0"],
    )
    pool = InferencePool(config, log_dir=Path(job["logs"]))
    pool.start()
    before = asyncio.run(greedy(pool, job["prompt"], job["max_tokens"]))
    pool.reload(job["other"], version=1)

    async def from_every_client() -> list[dict]:
        return list(
            await asyncio.gather(
                *(greedy(pool, job["prompt"], job["max_tokens"]) for _ in range(CLIENTS))
            )
        )

    after = asyncio.run(from_every_client())
    print(json.dumps({"before": before, "after": after}), flush=True)
    threading.Event().wait()  # until killed: the servers must then go by themselves


if __name__ == "__main__":
    main(sys.argv)
