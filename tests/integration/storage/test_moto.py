"""The storage layer against a real S3 server (moto): objects, shards, checkpoints, commits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from storage.checkpoints import fetch_checkpoint, load_checkpoint_weights, write_checkpoint
from storage.commit import MARKER, committed_steps, latest_committed_step, verify_step
from storage.errors import CorruptObjectError, NotCommittedError, ObjectNotFoundError
from storage.layout import RunLayout
from storage.shards import read_rollouts, shard_name, write_rollouts
from storage.store import ObjectStore
from tests.integration.servers import S3Endpoint
from tests.integration.storage.data import rollout_table, tiny_qwen3

pytestmark = pytest.mark.integration


def _key(store: ObjectStore, path: str) -> str:
    """The bucket key of `path`, for tampering with it through a plain boto3 client."""
    return store.url(path).split("/", 3)[3]


def test_bytes_listing_and_delete(moto_store: ObjectStore, tmp_path: Path) -> None:
    store = moto_store
    store.write_bytes("a/one.bin", b"1" * 10)
    store.write_bytes("a/two.bin", b"22")
    store.write_bytes("b/deep/three.bin", b"")

    assert store.read_bytes("a/one.bin") == b"1" * 10
    assert store.read_bytes("b/deep/three.bin") == b""
    assert store.size("a/two.bin") == 2
    assert store.list() == ["a", "b"]
    assert store.list("a") == ["one.bin", "two.bin"]
    assert store.list("nothing-here") == []
    assert store.walk_files() == ["a/one.bin", "a/two.bin", "b/deep/three.bin"]
    assert store.child("a").read_bytes("two.bin") == b"22"

    store.write_bytes("a/two.bin", b"replaced")
    assert store.read_bytes("a/two.bin") == b"replaced"

    local = tmp_path / "up.bin"
    local.write_bytes(b"via a local file")
    store.upload_file(local, "c/up.bin")
    store.download_file("c/up.bin", tmp_path / "down.bin")
    assert (tmp_path / "down.bin").read_bytes() == b"via a local file"

    store.delete("a/one.bin")
    assert not store.exists("a/one.bin")
    store.delete("b")
    store.delete("never/was")
    assert store.walk_files() == ["a/two.bin", "c/up.bin"]

    with pytest.raises(ObjectNotFoundError) as missing:
        store.read_bytes("a/one.bin")
    assert store.url("a/one.bin") in str(missing.value)
    assert str(missing.value).startswith("s3://")


def test_shards_round_trip_through_the_commit_protocol(moto_store: ObjectStore) -> None:
    table = rollout_table(10, step=4, seq_len=32)
    record = write_rollouts(moto_store, 4, table, max_rows_per_shard=4)

    assert sorted(record.files) == [shard_name(i) for i in range(3)]
    assert record.rows == 10
    step_dir = RunLayout.rollouts_dir(4)
    assert moto_store.list(step_dir) == [MARKER, *(shard_name(i) for i in range(3))]
    assert read_rollouts(moto_store, 4).equals(table)
    assert verify_step(moto_store, step_dir) == record
    assert latest_committed_step(moto_store, RunLayout.ROLLOUTS) == 4


def test_a_step_without_its_marker_is_invisible(
    moto_store: ObjectStore, moto_env: S3Endpoint
) -> None:
    write_rollouts(moto_store, 1, rollout_table(3, step=1))
    write_rollouts(moto_store, 2, rollout_table(3, step=2))
    # A writer that died after its shards but before its marker leaves exactly this behind.
    moto_env.boto3_client().delete_object(
        Bucket=moto_env.bucket, Key=_key(moto_store, f"{RunLayout.rollouts_dir(2)}/{MARKER}")
    )

    assert moto_store.exists(f"{RunLayout.rollouts_dir(2)}/{shard_name(0)}")
    assert committed_steps(moto_store, RunLayout.ROLLOUTS) == [1]
    assert latest_committed_step(moto_store, RunLayout.ROLLOUTS) == 1
    with pytest.raises(NotCommittedError) as hidden:
        read_rollouts(moto_store, 2)
    assert moto_store.url(RunLayout.rollouts_dir(2)) in str(hidden.value)


@pytest.mark.parametrize("damage", ["flip_one_byte", "truncate"])
def test_a_corrupted_shard_is_detected_and_named(
    moto_store: ObjectStore, moto_env: S3Endpoint, damage: str
) -> None:
    write_rollouts(moto_store, 6, rollout_table(8, step=6, seq_len=16), max_rows_per_shard=4)
    shard = f"{RunLayout.rollouts_dir(6)}/{shard_name(1)}"
    client = moto_env.boto3_client()
    key = _key(moto_store, shard)
    original = client.get_object(Bucket=moto_env.bucket, Key=key)["Body"].read()
    if damage == "flip_one_byte":
        middle = len(original) // 2
        tampered = original[:middle] + bytes([original[middle] ^ 0xFF]) + original[middle + 1 :]
    else:
        tampered = original[: len(original) - 100]
    client.put_object(Bucket=moto_env.bucket, Key=key, Body=tampered)

    for read in (
        lambda: read_rollouts(moto_store, 6),
        lambda: verify_step(moto_store, RunLayout.rollouts_dir(6)),
    ):
        with pytest.raises(CorruptObjectError) as corrupt:
            read()
        assert corrupt.value.uri == moto_store.url(shard)
        assert str(corrupt.value).startswith(f"s3://{moto_env.bucket}/")


def test_checkpoint_round_trip_gives_identical_logits(
    moto_store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tiny_qwen3()
    write_checkpoint(moto_store, 3, weights=model.state_dict(), config=model.config.to_dict())

    folder = fetch_checkpoint(moto_store, 3, tmp_path / "ckpt")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, actual = model(tokens).logits, loaded(tokens).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    weights = load_checkpoint_weights(folder)
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor), name
