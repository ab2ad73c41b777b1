"""Two vLLM servers on one GPU: the pool starts the second once the first is ready, because
vLLM sizes its KV cache from the whole device's free memory and charges a neighbour that loads
at the same time to itself (both at once failed on the H200: "No available memory for the
cache blocks"). Skipped without a GPU or without vLLM.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import pytest

from engine.config.inference import InferenceConfig
from engine.inference.pool import InferencePool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]


def test_two_servers_share_gpu_0(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = InferenceConfig(
        model=str(tiny_model_dir),
        num_servers=2,
        gpu_ids=[0, 0],
        gpu_memory_utilization=0.1,
        max_model_len=512,
    )
    with InferencePool(config, log_dir=tmp_path) as pool:
        for endpoint in pool.endpoints:
            response = httpx.post(
                f"{endpoint.base_url}/v1/completions",
                json={"model": endpoint.model, "prompt": "abc", "max_tokens": 4},
                headers={"Authorization": f"Bearer {pool.api_key}"},
                timeout=60,
            )
            response.raise_for_status()
            assert response.json()["usage"]["completion_tokens"] == 4
