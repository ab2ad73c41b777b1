"""ObjectStore on memory:// and file://: round trips, paths, listings, errors."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from storage.errors import ObjectNotFoundError, PermanentStorageError, StorageError
from storage.paths import clean_path, join
from storage.store import TMP_PREFIX, ObjectStore


def test_bytes_round_trip_accepts_any_buffer(store: ObjectStore) -> None:
    store.write_bytes("a/b/one.bin", b"one")
    store.write_bytes("a/two.bin", bytearray(b"two"))
    store.write_bytes("three.bin", memoryview(b"xthreex")[1:-1])
    assert store.read_bytes("a/b/one.bin") == b"one"
    assert store.read_bytes("a/two.bin") == b"two"
    assert store.read_bytes("three.bin") == b"three"
    assert store.size("a/b/one.bin") == 3
    with store.open_input("a/two.bin") as stream:
        assert stream.read(2) == b"tw"


def test_overwrite_replaces_the_whole_object(store: ObjectStore) -> None:
    store.write_bytes("x", b"a much longer first version")
    store.write_bytes("x", b"short")
    assert store.read_bytes("x") == b"short"


def test_exists_for_objects_and_prefixes(store: ObjectStore) -> None:
    store.write_bytes("dir/file", b"1")
    assert store.exists("dir/file")
    assert store.exists("dir")
    assert not store.exists("dir/other")
    assert not store.exists("nothing")


def test_list_gives_sorted_immediate_children(store: ObjectStore) -> None:
    for path in ["p/b", "p/a/deep/x", "p/c/y", "q"]:
        store.write_bytes(path, b"")
    assert store.list("p") == ["a", "b", "c"]
    assert store.list() == ["p", "q"]
    assert store.list("missing") == []


def test_walk_files_lists_every_object_relative_to_the_root(store: ObjectStore) -> None:
    for path in ["p/b", "p/a/deep/x", "q"]:
        store.write_bytes(path, b"")
    assert store.walk_files("p") == ["p/a/deep/x", "p/b"]
    assert store.walk_files() == ["p/a/deep/x", "p/b", "q"]
    assert store.walk_files("missing") == []


def test_delete_removes_objects_and_whole_prefixes(store: ObjectStore) -> None:
    for path in ["d/1", "d/sub/2", "keep"]:
        store.write_bytes(path, b"x")
    store.delete("d/1")
    assert store.walk_files() == ["d/sub/2", "keep"]
    store.delete("d")
    assert store.walk_files() == ["keep"]
    store.delete("d")  # missing is fine
    with pytest.raises(ValueError, match="empty"):
        store.delete("")


def test_missing_object_error_names_the_uri_and_is_a_file_not_found(store: ObjectStore) -> None:
    for call in (store.read_bytes, store.size, store.open_input):
        with pytest.raises(ObjectNotFoundError) as info:
            call("no/such/object")
        assert isinstance(info.value, FileNotFoundError)
        assert info.value.uri == store.url("no/such/object")
        assert store.url("no/such/object") in str(info.value)


def test_upload_and_download_files(store: ObjectStore, tmp_path: Path) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(1000))
    store.upload_file(source, "up/loaded.bin")
    assert store.read_bytes("up/loaded.bin") == source.read_bytes()
    target = tmp_path / "new" / "folder" / "copy.bin"
    store.download_file("up/loaded.bin", target)
    assert target.read_bytes() == source.read_bytes()
    with pytest.raises(ObjectNotFoundError):
        store.download_file("absent", tmp_path / "absent")
    assert not (tmp_path / "absent").exists()
    with pytest.raises(FileNotFoundError, match="no such local file"):
        store.upload_file(tmp_path / "absent", "up/absent.bin")


def test_child_store_is_rooted_at_the_prefix(store: ObjectStore) -> None:
    run = store.child("runs/r1")
    run.write_bytes("manifest.json", b"{}")
    assert store.read_bytes("runs/r1/manifest.json") == b"{}"
    assert run.url("manifest.json") == store.url("runs/r1/manifest.json")
    assert run.walk_files() == ["manifest.json"]
    assert run.child("a").url() == store.url("runs/r1/a")


@pytest.mark.parametrize("bad", ["/abs", "../up", "a/../b", "a//b", "a/", ".", "a/./b", "a\\b"])
def test_unsafe_paths_are_refused_before_any_io(store: ObjectStore, bad: str) -> None:
    with pytest.raises(ValueError, match="object path"):
        store.write_bytes(bad, b"x")
    with pytest.raises(ValueError, match="object path"):
        store.child(bad)


_segment = st.text(st.sampled_from("abcXYZ019._-"), min_size=1, max_size=8).filter(
    lambda s: s not in (".", "..")
)


@given(st.lists(_segment, min_size=1, max_size=5))
def test_safe_paths_join_and_validate(segments: list[str]) -> None:
    path = join(*segments)
    assert clean_path(path) == path
    assert path.split("/") == segments


def test_file_uri_forms_resolve_against_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    relative = ObjectStore("file://./runs")
    bare = ObjectStore("runs")
    absolute = ObjectStore(f"file://{tmp_path}/runs")
    assert relative.url() == bare.url() == absolute.url() == f"file://{tmp_path}/runs"
    relative.write_bytes("r/x", b"1")
    assert (tmp_path / "runs" / "r" / "x").read_bytes() == b"1"
    assert bare.read_bytes("r/x") == b"1"


def test_bucket_uris_keep_their_form_and_never_show_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    s3 = ObjectStore("s3://bucket/prefix/", endpoint_url="http://127.0.0.1:9", region="eu-west-1")
    assert s3.url("a/b") == "s3://bucket/prefix/a/b"
    assert s3.child("a").url() == "s3://bucket/prefix/a"
    assert "very-secret-value" not in repr(s3)
    assert "very-secret-value" not in str(vars(s3))
    gcs = ObjectStore("gcs://bucket", storage_options={"token": "anon"})
    assert gcs.url("x") == "gs://bucket/x"


@pytest.mark.parametrize(
    ("uri", "options"),
    [
        ("s3://b", {"key": "AKIA", "secret": "s"}),
        ("s3://b", {"client_kwargs": {"aws_secret_access_key": "s"}}),
        ("s3://b", {"token": "session-token"}),
        ("gs://b", {"token": {"private_key": "..."}}),
    ],
)
def test_credentials_in_storage_options_are_refused(uri: str, options: dict) -> None:
    with pytest.raises(ValueError, match="credentials"):
        ObjectStore(uri, storage_options=options)


@pytest.mark.parametrize("uri", ["ftp://host/x", "s3://", "file://"])
def test_bad_root_uris_are_refused(uri: str) -> None:
    with pytest.raises(ValueError):
        ObjectStore(uri)


def test_region_and_endpoint_apply_to_buckets_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="s3:// and gs://"):
        ObjectStore(f"file://{tmp_path}", region="us-east-1")


def test_unreachable_endpoint_is_transient_and_names_the_uri(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    # Port 9 (discard) on loopback is closed on test machines: every connection is refused.
    s3 = ObjectStore("s3://bucket/run", endpoint_url="http://127.0.0.1:9", retries=1, backoff_s=0)
    with pytest.raises(StorageError) as info:
        s3.read_bytes("x")
    assert type(info.value).__name__ == "TransientStorageError"
    assert info.value.uri == "s3://bucket/run/x"
    assert "2 attempts" in str(info.value)


def test_permanent_local_fault_fails_at_once_naming_the_uri(file_store: ObjectStore) -> None:
    file_store.write_bytes("plain", b"a file, not a folder")
    slow = ObjectStore(file_store.url(), backoff_s=10.0)
    started = time.monotonic()
    with pytest.raises(PermanentStorageError) as info:
        slow.write_bytes("plain/below", b"x")
    assert time.monotonic() - started < 5.0  # no backoff sleep happened
    assert info.value.uri == file_store.url("plain/below")


def test_failed_local_write_keeps_the_old_object_and_leaves_no_temp_file(
    file_store: ObjectStore, tmp_path: Path
) -> None:
    file_store.write_bytes("dir/obj", b"old")
    with pytest.raises(PermanentStorageError):
        file_store.upload_file(tmp_path, "dir/obj")  # a folder is no file: copying fails midway
    assert file_store.read_bytes("dir/obj") == b"old"
    assert os.listdir(tmp_path / "root" / "dir") == ["obj"]


def test_leftover_temp_files_are_invisible(file_store: ObjectStore, tmp_path: Path) -> None:
    file_store.write_bytes("step/shard", b"x")
    (tmp_path / "root" / "step" / f"{TMP_PREFIX}shard.123").write_bytes(b"partial")
    assert file_store.list("step") == ["shard"]
    assert file_store.walk_files() == ["step/shard"]


def test_storage_errors_survive_pickling() -> None:
    error = ObjectNotFoundError("s3://b/k", "no such object")
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, FileNotFoundError)
    assert (copy.uri, str(copy)) == ("s3://b/k", str(error))


def test_stores_survive_pickling_with_their_settings(memory_store: ObjectStore) -> None:
    child = memory_store.child("runs/r1")
    child.write_bytes("x", b"1")
    copy = pickle.loads(pickle.dumps(child))
    assert repr(copy) == repr(child)
    assert copy.read_bytes("x") == b"1"
    s3 = ObjectStore("s3://bucket/p", endpoint_url="http://127.0.0.1:9", retries=2)
    assert repr(pickle.loads(pickle.dumps(s3.child("a")))) == repr(s3.child("a"))


def test_write_stream_is_atomic_and_retries_from_the_start(
    store: ObjectStore, tmp_path: Path
) -> None:
    import xxhash

    from storage.commit import download_hashed, write_hashed

    calls: list[int] = []

    def fill(out) -> None:
        calls.append(1)
        out.write(b"first ")
        if len(calls) == 1:
            raise ConnectionResetError("dropped")  # transient: the whole write is repeated
        out.write(memoryview(b"second"))

    digest = write_hashed(store, "s/obj", fill)
    assert len(calls) == 2
    assert store.read_bytes("s/obj") == b"first second"
    assert digest.size == 12 and digest.checksum == xxhash.xxh3_128(b"first second").hexdigest()
    assert store.list("s") == ["obj"]

    def broken(out) -> None:
        out.write(b"partial")
        raise ValueError("a bug in the writer")

    with pytest.raises(ValueError, match="a bug"):
        write_hashed(store, "s/obj", broken)
    assert store.read_bytes("s/obj") == b"first second"  # the old version stays whole
    assert store.list("s") == ["obj"]

    fetched = download_hashed(store, "s/obj", tmp_path / "copy")
    assert fetched == digest
    assert (tmp_path / "copy").read_bytes() == b"first second"
    with pytest.raises(FileNotFoundError):
        download_hashed(store, "s/missing", tmp_path / "missing")
    assert not (tmp_path / "missing").exists()
