"""Flow results persist to the run's object store through a block that holds no credential."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client

from engine.config.run import StorageConfig
from storage.store import ObjectStore
from tasks.results import RESULTS_DIR, block_name, result_storage
from tests.integration.servers import S3Endpoint

pytestmark = pytest.mark.integration


def block_document(name: str, block_type: str) -> dict:
    """The block document as the API serves it, secrets included where a block has any."""
    with get_client(sync_client=True) as client:
        document = client.read_block_document_by_name(
            name, block_type_slug=block_type, include_secrets=True
        )
    return document.model_dump(mode="json")


def test_s3_results_block_holds_no_credential_and_stores_results(
    prefect_api: str, moto_env: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SESSION_TOKEN", "session-token-that-must-stay-local")
    storage = StorageConfig(
        uri=moto_env.uri("results-test"), endpoint_url=moto_env.url, region=moto_env.region
    )
    block = result_storage(storage)
    document = block_document(block_name(storage), "remote-file-system")
    assert document["data"] == {
        "basepath": f"{moto_env.uri('results-test')}/{RESULTS_DIR}",
        "settings": {
            "config_kwargs": {"s3": {"addressing_style": "path"}, "region_name": moto_env.region},
            "endpoint_url": moto_env.url,
        },
    }
    text = json.dumps(document)
    for secret in (moto_env.access_key, moto_env.secret_key, "session-token-that-must-stay-local"):
        assert secret not in text

    @flow(result_storage=block, persist_result=True)
    def summary() -> dict[str, str]:
        return {"checkpoint": "s3://bucket/run/checkpoints/step_000004"}

    assert summary() == {"checkpoint": "s3://bucket/run/checkpoints/step_000004"}
    # The result object landed in the bucket, written with the environment's credentials.
    store = ObjectStore(moto_env.uri("results-test"), endpoint_url=moto_env.url)
    assert len(store.list(RESULTS_DIR)) == 1
    # The same settings find the same block again rather than making another.
    assert result_storage(storage).basepath == block.basepath


def test_local_results_live_beside_the_runs_at_an_absolute_path(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    storage = StorageConfig(uri="file://./runs")
    result_storage(storage)
    document = block_document(block_name(storage), "local-file-system")
    assert document["data"] == {"basepath": f"{tmp_path}/runs/{RESULTS_DIR}"}
