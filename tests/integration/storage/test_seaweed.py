"""The storage layer against SeaweedFS with S3 auth enforced: refused credentials, missing
buckets, and objects large enough to go up in several parts."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from storage.checkpoints import fetch_checkpoint, load_checkpoint_weights, write_checkpoint
from storage.errors import PermanentStorageError
from storage.layout import RunLayout
from storage.store import ObjectStore
from tests.integration.servers import S3Endpoint

pytestmark = pytest.mark.integration

# s3fs sends anything below 2 x 50 MiB as one PUT; this goes up in 3 parts (50 + 50 + 12 MiB).
MULTIPART_BYTES = 112 * 2**20
# A refused request is answered at once. The stores below back off 10 s (jittered to >= 5 s)
# before a first retry, so finishing within 5 s proves there was none, even on a loaded machine.
FAST_S = 5.0
BACKOFF_S = 10.0


def _etag_parts(endpoint: S3Endpoint, store: ObjectStore, path: str) -> int:
    """How many parts the object was uploaded in (a multipart ETag ends in `-N`)."""
    key = store.url(path).split("/", 3)[3]
    etag = endpoint.boto3_client().head_object(Bucket=endpoint.bucket, Key=key)["ETag"]
    _, _, parts = etag.strip('"').partition("-")
    return int(parts) if parts else 1


@pytest.mark.parametrize(
    ("variable", "value"),
    [("AWS_SECRET_ACCESS_KEY", "not-the-secret"), ("AWS_ACCESS_KEY_ID", "nobody-we-know")],
)
def test_refused_credentials_fail_fast_and_say_so(
    seaweed_env: S3Endpoint,
    seaweed_store: ObjectStore,
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    value: str,
) -> None:
    seaweed_store.write_bytes("kept.bin", b"written with the right key")
    monkeypatch.setenv(variable, value)
    refused = ObjectStore(seaweed_store.url(), retries=5, backoff_s=BACKOFF_S)

    for path, call in [
        ("new.bin", lambda: refused.write_bytes("new.bin", b"x")),
        ("kept.bin", lambda: refused.read_bytes("kept.bin")),
        ("kept.bin", lambda: refused.exists("kept.bin")),
        ("", lambda: refused.list()),
    ]:
        began = time.monotonic()
        with pytest.raises(PermanentStorageError) as error:
            call()
        assert time.monotonic() - began < FAST_S, f"{path!r}: refused calls must not be retried"
        message = str(error.value)
        assert message.startswith(f"{refused.url(path)}: "), message
        assert "credentials" in message, message
        assert len(message.splitlines()) == 1


def test_a_missing_bucket_is_a_clear_permanent_error(seaweed_env: S3Endpoint) -> None:
    store = ObjectStore("s3://no-such-bucket-primeflow/run", retries=5, backoff_s=BACKOFF_S)
    for path, call in [
        ("x.bin", lambda: store.write_bytes("x.bin", b"x")),
        ("x.bin", lambda: store.read_bytes("x.bin")),
        ("", lambda: store.list()),
    ]:
        began = time.monotonic()
        with pytest.raises(PermanentStorageError) as error:
            call()
        assert time.monotonic() - began < FAST_S
        assert str(error.value).startswith(f"s3://no-such-bucket-primeflow/run/{path}".rstrip("/"))
        assert "NoSuchBucket" in str(error.value)


def test_a_multipart_object_round_trips_byte_exact(
    seaweed_env: S3Endpoint, seaweed_store: ObjectStore, tmp_path: Path
) -> None:
    data = os.urandom(MULTIPART_BYTES)
    seaweed_store.write_bytes("big/blob.bin", data)
    assert _etag_parts(seaweed_env, seaweed_store, "big/blob.bin") == 3
    assert seaweed_store.size("big/blob.bin") == MULTIPART_BYTES
    assert seaweed_store.read_bytes("big/blob.bin") == data
    seaweed_store.download_file("big/blob.bin", tmp_path / "blob.bin")
    assert (tmp_path / "blob.bin").read_bytes() == data


def test_a_checkpoint_with_a_multipart_safetensors_file_round_trips(
    seaweed_env: S3Endpoint, seaweed_store: ObjectStore, tmp_path: Path
) -> None:
    generator = torch.Generator().manual_seed(0)
    # 112 MiB of float32 in one safetensors file, plus a small tensor.
    weights = {
        "model.embed_tokens.weight": torch.randn(28 * 1024, 1024, generator=generator),
        "model.norm.weight": torch.randn(1024, generator=generator),
    }
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    record = write_checkpoint(seaweed_store, 2, weights=weights, config=config)

    weights_file = f"{RunLayout.checkpoint_dir(2)}/model.safetensors"
    assert record.files["model.safetensors"].size > MULTIPART_BYTES
    assert _etag_parts(seaweed_env, seaweed_store, weights_file) >= 3

    folder = fetch_checkpoint(seaweed_store, 2, tmp_path / "ckpt")
    assert (folder / "model.safetensors").stat().st_size == record.files["model.safetensors"].size
    back = load_checkpoint_weights(folder)
    assert set(back) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(back[name], tensor), name
