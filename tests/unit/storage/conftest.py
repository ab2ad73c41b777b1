"""Stores for unit tests: a private `memory://` root and a `file://` root under tmp_path."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.store import ObjectStore


@pytest.fixture
def memory_store() -> Iterator[ObjectStore]:
    # memory:// is one process-wide filesystem: a unique root keeps tests apart.
    store = ObjectStore(f"memory://unit-{uuid.uuid4().hex}", backoff_s=0.001)
    yield store
    memory_root = ObjectStore("memory://")
    memory_root.delete(store.url().removeprefix("memory://"))


@pytest.fixture
def file_store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(f"file://{tmp_path}/root", backoff_s=0.001)


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest) -> ObjectStore:
    """Each test using `store` runs once per backend."""
    return request.getfixturevalue(f"{request.param}_store")
