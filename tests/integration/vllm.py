"""One real vLLM CPU server for the whole test session, serving a tiny tied-embedding Qwen3.

Starting vLLM costs 25-80 s and ~1.5 GB of RAM, so every integration test that needs a server
(inference, orchestrator) shares the pool started here; tests that reload weights put the base
weights back when they finish. `-O0` skips torch.compile: the tiny model gains nothing from it
and it triples start-up time. `tests/integration/conftest.py` registers these fixtures.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.config.inference import InferenceConfig
from engine.inference.pool import InferencePool
from engine.models.tiny import TinyModelSpec, write_tiny_model

#: Larger than the demo's 0.02 so output distributions are peaked and log-probs discriminate.
INIT_STD = 0.3
MAX_MODEL_LEN = 1024


@dataclass(frozen=True)
class Weights:
    """Model folders the session's tests swap between."""

    base: Path  # what the server starts from (seed 0)
    other: Path  # same shapes, other values (seed 1)
    wrong_shape: Path  # another hidden size: must be refused
    truncated: Path  # base with its safetensors file cut short: must be refused
    untied_base: Path  # an untied-head model and a second checkpoint of it
    untied_other: Path


@pytest.fixture(scope="session")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Weights:
    root = tmp_path_factory.mktemp("weights")
    base = write_tiny_model(root / "base", TinyModelSpec(init_std=INIT_STD, seed=0))
    other = write_tiny_model(root / "step_000001", TinyModelSpec(init_std=INIT_STD, seed=1))
    wrong = write_tiny_model(root / "wrong", TinyModelSpec(init_std=INIT_STD, hidden_size=192))
    truncated = root / "truncated"
    shutil.copytree(base, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    untied = TinyModelSpec(init_std=INIT_STD, tie_word_embeddings=False)
    return Weights(
        base=base,
        other=other,
        wrong_shape=wrong,
        truncated=truncated,
        untied_base=write_tiny_model(root / "untied_base", untied),
        untied_other=write_tiny_model(root / "untied_other", dataclasses.replace(untied, seed=1)),
    )


def pool_config(weights: Weights) -> InferenceConfig:
    """The shared server's config; tests that must kill a server start their own from it."""
    return InferenceConfig(
        model=str(weights.base),
        max_model_len=MAX_MODEL_LEN,
        dtype="float32",  # as transformers computes; "auto" would run bf16 on this CPU
        kv_cache_gb=0.25,
        extra_args=["-O0"],
    )


@pytest.fixture(scope="session")
def pool(weights: Weights, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferencePool]:
    started = time.monotonic()
    inference_pool = InferencePool(pool_config(weights), log_dir=tmp_path_factory.mktemp("logs"))
    inference_pool.start()
    print(f"\nvLLM pool ready in {time.monotonic() - started:.1f} s")
    yield inference_pool
    inference_pool.stop()
