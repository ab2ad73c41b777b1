"""The configured S3 endpoint reaches every reader of a run (issue 15, items 1 and 2).

`storage.endpoint_url` alone names the SeaweedFS server here: the environment's endpoint
points at a closed loopback port, so a store opened without the run's settings fails at once
(and never reaches AWS) instead of passing by accident.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import PrimeflowConfig, with_overrides
from engine.config.run import StorageConfig
from engine.local_checkpoints import local_checkpoint, version_chain
from engine.run import open_run, store_at
from flows.reproduce import main as reproduce
from storage.checkpoints import load_checkpoint_weights, write_checkpoint
from storage.layout import RunLayout
from tests.integration.servers import S3Endpoint

pytestmark = pytest.mark.integration

MODEL = {"model_type": "qwen3", "tie_word_embeddings": False}
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.fixture
def storage(
    seaweed_env: S3Endpoint, run_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> StorageConfig:
    monkeypatch.setenv("AWS_ENDPOINT_URL", CLOSED)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    return StorageConfig(uri=seaweed_env.uri(run_prefix), endpoint_url=seaweed_env.url, retries=0)


def test_policy_versions_and_checkpoints_are_fetched_through_the_configured_endpoint(
    storage: StorageConfig, tmp_path: Path
) -> None:
    root = f"{storage.uri}/run"
    store = store_at(root, storage)
    weights = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    meta = {"kind": "full", "uid": "u1", "full_every": 3}
    write_checkpoint(store, 1, weights=weights, config=MODEL, parent=RunLayout.POLICIES, meta=meta)
    write_checkpoint(store, 2, weights=weights, config=MODEL)

    version = f"{root}/{RunLayout.policy_dir(1)}"
    assert version_chain(version, None, storage) == [version]
    for uri in (version, f"{root}/{RunLayout.checkpoint_dir(2)}"):
        folder = local_checkpoint(uri, tmp_path / "cache", storage)
        assert torch.equal(load_checkpoint_weights(folder)["w"], weights["w"]), uri


def test_reproduce_reads_a_run_in_an_s3_compatible_store(
    storage: StorageConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    config = with_overrides(
        PrimeflowConfig(),
        {"storage.uri": storage.uri, "storage.endpoint_url": storage.endpoint_url},
    )
    root = open_run(config, command=["prefect", "post-train"]).store.url()
    args = [root, "--storage.endpoint-url", storage.endpoint_url or ""]
    assert reproduce(args, dry_run=True) == 0
    rebuilt = json.loads(capsys.readouterr().out)
    assert rebuilt["storage"]["endpoint_url"] == storage.endpoint_url
    assert rebuilt["run"]["parent"] == root

    # Without the endpoint: one line naming the store, no traceback.
    assert reproduce([root], dry_run=True) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and root in err, err
