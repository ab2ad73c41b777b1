"""The orchestrator tests run against the session's shared vLLM server (tests/integration/
vllm.py: the offline tiny model, seeded weights, character-level ChatML tokenizer). Tests that
make the pool load another checkpoint put the base weights back, so each starts at version 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.config import PrimeflowConfig
from engine.inference.pool import InferencePool
from tests.integration.vllm import Weights

SEQ_LEN = 512


@pytest.fixture(scope="session")
def tiny_model(weights: Weights) -> Path:
    """The base weights the shared vLLM server starts from."""
    return weights.base


@pytest.fixture
def pool(pool: InferencePool, tiny_model: Path) -> Iterator[InferencePool]:
    """The session's shared pool, back on the base weights (version 0) after the test."""
    yield pool
    if pool.policy_version != 0:
        pool.reload(tiny_model, version=0)


@pytest.fixture
def make_config(tmp_path: Path, tiny_model: Path) -> Callable[..., PrimeflowConfig]:
    """A small RL config on the tiny model, its run root under the test's tmp folder."""

    def make(**sections: Any) -> PrimeflowConfig:
        orchestrator = {
            "batch_size": 8,
            "rollouts_per_example": 4,
            "max_concurrent": 16,
            "sampling": {"temperature": 1.0, "max_tokens": 24},
            "poll_interval_s": 0.1,
            "policy_timeout_s": 120.0,
            **sections.pop("orchestrator", {}),
        }
        return PrimeflowConfig.model_validate(
            {
                "run": {"name": "it"},
                "model": {"name": str(tiny_model)},
                "storage": {"uri": f"file://{tmp_path}/runs"},
                "seq_len": SEQ_LEN,
                "max_steps": sections.pop("max_steps", 2),
                "orchestrator": orchestrator,
                **sections,
            }
        )

    return make
