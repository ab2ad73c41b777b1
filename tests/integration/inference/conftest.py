"""Inference tests share the session's vLLM server (`tests/integration/vllm.py`); tests that
reload weights put the base weights back when they finish."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.inference.pool import InferencePool
from tests.integration.vllm import Weights


@pytest.fixture
def base_pool(pool: InferencePool, weights: Weights) -> Iterator[InferencePool]:
    """The session pool, put back on the base weights (version 0) after the test."""
    yield pool
    if pool.policy_version != 0:
        pool.reload(weights.base, version=0)
