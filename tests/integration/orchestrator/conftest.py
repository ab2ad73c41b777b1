"""A real vLLM CPU server with the tiny model, shared by the orchestrator integration tests.

The server serves the offline tiny model (demo shape, seeded weights, character-level ChatML
tokenizer). Tests that make the pool load another checkpoint put the base weights back after
themselves, so every test starts from policy version 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.config import PrimeflowConfig
from engine.config.inference import InferenceConfig
from engine.inference.pool import InferencePool
from engine.models.tiny import TinyModelSpec, write_tiny_model

SEQ_LEN = 512
#: Peaked output distributions: completions stop on their own often enough to see EOS handling.
SPEC = TinyModelSpec(init_std=0.3)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", SPEC)


@pytest.fixture(scope="session")
def session_pool(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InferencePool]:
    config = InferenceConfig(
        model=str(tiny_model), max_model_len=SEQ_LEN, kv_cache_gb=0.25, extra_args=["-O0"]
    )
    started = time.monotonic()
    with InferencePool(config, log_dir=tmp_path_factory.mktemp("pool-logs")) as pool:
        print(f"\nvLLM pool ready in {time.monotonic() - started:.1f} s")
        yield pool


@pytest.fixture
def pool(session_pool: InferencePool, tiny_model: Path) -> Iterator[InferencePool]:
    """The session pool, back on the base weights (version 0) after the test."""
    yield session_pool
    if session_pool.policy_version != 0:
        session_pool.reload(tiny_model, version=0)


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
