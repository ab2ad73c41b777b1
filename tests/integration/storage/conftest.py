"""Stores rooted at a fresh prefix per test, so tests share one bucket without seeing each other."""

from __future__ import annotations

import re
import uuid

import pytest

from storage.store import ObjectStore
from tests.integration.servers import GcsEndpoint, S3Endpoint


@pytest.fixture
def run_prefix(request: pytest.FixtureRequest) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name).strip("-")[:60]
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def moto_store(moto_env: S3Endpoint, run_prefix: str) -> ObjectStore:
    return ObjectStore(moto_env.uri(run_prefix))


@pytest.fixture
def seaweed_store(seaweed_env: S3Endpoint, run_prefix: str) -> ObjectStore:
    return ObjectStore(seaweed_env.uri(run_prefix))


@pytest.fixture
def gcs_store(gcs_emulator: GcsEndpoint, run_prefix: str) -> ObjectStore:
    return ObjectStore(
        gcs_emulator.uri(run_prefix),
        endpoint_url=gcs_emulator.url,
        storage_options={"token": "anon", "project": gcs_emulator.project},
    )
