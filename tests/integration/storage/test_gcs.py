"""The storage layer against a GCS emulator (fake-gcs-server): the same contract as on S3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from storage.checkpoints import fetch_checkpoint, load_checkpoint_weights, write_checkpoint
from storage.commit import latest_committed_step
from storage.errors import ObjectNotFoundError, PermanentStorageError
from storage.layout import RunLayout
from storage.shards import read_rollouts, write_rollouts
from storage.store import ObjectStore
from tests.integration.servers import GcsEndpoint
from tests.integration.storage.data import rollout_table

pytestmark = pytest.mark.integration


def test_bytes_listing_and_delete(gcs_store: ObjectStore, tmp_path: Path) -> None:
    store = gcs_store
    store.write_bytes("a/one.bin", b"one")
    store.write_bytes("a/two.bin", b"two")
    store.write_bytes("b/three.bin", b"three")

    assert store.url("a/one.bin").startswith("gs://")
    assert store.read_bytes("a/two.bin") == b"two"
    assert store.size("b/three.bin") == 5
    assert store.list() == ["a", "b"]
    assert store.list("a") == ["one.bin", "two.bin"]
    assert store.walk_files() == ["a/one.bin", "a/two.bin", "b/three.bin"]

    store.download_file("a/one.bin", tmp_path / "one.bin")
    assert (tmp_path / "one.bin").read_bytes() == b"one"
    store.delete("a")
    assert store.walk_files() == ["b/three.bin"]
    with pytest.raises(ObjectNotFoundError) as missing:
        store.read_bytes("a/one.bin")
    assert store.url("a/one.bin") in str(missing.value)


def test_shards_and_a_checkpoint_round_trip(gcs_store: ObjectStore, tmp_path: Path) -> None:
    table = rollout_table(9, step=1, seq_len=32)
    write_rollouts(gcs_store, 1, table, max_rows_per_shard=4)
    assert read_rollouts(gcs_store, 1).equals(table)
    assert latest_committed_step(gcs_store, RunLayout.ROLLOUTS) == 1

    weights = {"model.norm.weight": torch.arange(64, dtype=torch.float32)}
    write_checkpoint(gcs_store, 1, weights=weights, config={"model_type": "qwen3"})
    back = load_checkpoint_weights(fetch_checkpoint(gcs_store, 1, tmp_path / "ckpt"))
    assert torch.equal(back["model.norm.weight"], weights["model.norm.weight"])


def test_a_write_to_a_missing_bucket_is_a_permanent_error(gcs_emulator: GcsEndpoint) -> None:
    store = ObjectStore(
        "gs://no-such-bucket-primeflow/run",
        endpoint_url=gcs_emulator.url,
        storage_options={"token": "anon", "project": gcs_emulator.project},
    )
    # gcsfs answers an upload to a missing bucket with a bare 404, like a missing object.
    with pytest.raises(PermanentStorageError) as error:
        store.write_bytes("x.bin", b"x")
    assert str(error.value).startswith("gs://no-such-bucket-primeflow/run/x.bin: ")
    assert "bucket" in error.value.reason
