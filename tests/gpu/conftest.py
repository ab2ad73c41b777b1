"""GPU tests run only where CUDA is; elsewhere every test here is skipped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models import write_tiny_model
from tests.unit.trainer.conftest import SPEC


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "tests/gpu/" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"), SPEC)
