"""A small GQA Qwen3 model written once per session by the offline tiny-model factory."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.models import TinyModelSpec, write_tiny_model

#: 4 query heads over 2 key/value heads, so the grouped-query path of attention is exercised.
SPEC = TinyModelSpec(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    init_std=0.1,
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"), SPEC)
