"""The commit protocol: only committed steps exist, and committed bytes are proven on read."""

from __future__ import annotations

import io
import json
import threading
import time

import numpy as np
import pytest
import xxhash

from storage import commit
from storage.commit import (
    MARKER,
    FileDigest,
    HashingWriter,
    begin_step,
    commit_step,
    committed_steps,
    delete_step,
    digest_bytes,
    latest_committed_step,
    read_commit,
    verify_step,
    wait_for_step,
)
from storage.errors import (
    AlreadyCommittedError,
    CorruptObjectError,
    NotCommittedError,
    StepTimeoutError,
)
from storage.layout import RunLayout
from storage.store import Bytes, ObjectStore

PARENT = "rollouts"


def _write_step(store: ObjectStore, step: int, *, commit: bool = True) -> dict[str, bytes]:
    """Write two data objects for `step`, and the marker unless `commit` is False."""
    step_dir = RunLayout.rollouts_dir(step)
    objects = {"shard-00000.arrow": b"first shard " * 10, "shard-00001.arrow": b"second"}
    for name, data in objects.items():
        store.write_bytes(f"{step_dir}/{name}", data)
    if commit:
        digests = {name: digest_bytes(data) for name, data in objects.items()}
        commit_step(store, step_dir, digests, step=step, rows=7, meta={"env": "reverse"})
    return objects


def test_commit_record_round_trips(store: ObjectStore) -> None:
    objects = _write_step(store, 3)
    record = read_commit(store, RunLayout.rollouts_dir(3))
    assert record.step == 3
    assert record.rows == 7
    assert record.meta == {"env": "reverse"}
    assert record.files == {name: digest_bytes(data) for name, data in objects.items()}
    assert record.created_at.endswith("+00:00")
    marker = json.loads(store.read_bytes(f"{RunLayout.rollouts_dir(3)}/{MARKER}"))
    assert marker["version"] == 1
    assert marker["files"]["shard-00001.arrow"] == {
        "size": 6,
        "xxh3_128": digest_bytes(b"second").checksum,
    }
    assert verify_step(store, RunLayout.rollouts_dir(3)) == record


def test_commit_from_names_reads_and_hashes_the_objects(store: ObjectStore) -> None:
    objects = _write_step(store, 1, commit=False)
    record = commit_step(store, RunLayout.rollouts_dir(1), sorted(objects), step=1)
    assert record.files == {name: digest_bytes(data) for name, data in objects.items()}


def test_uncommitted_steps_are_invisible(store: ObjectStore) -> None:
    _write_step(store, 1)
    _write_step(store, 2, commit=False)  # the writer "crashed" before its marker
    _write_step(store, 3)
    _write_step(store, 4, commit=False)
    store.write_bytes(f"{PARENT}/notes.txt", b"not a step")
    assert committed_steps(store, PARENT) == [1, 3]
    assert latest_committed_step(store, PARENT) == 3
    with pytest.raises(NotCommittedError) as info:
        read_commit(store, RunLayout.rollouts_dir(4))
    assert info.value.uri == store.url(RunLayout.rollouts_dir(4))


def test_no_steps_at_all(store: ObjectStore) -> None:
    assert committed_steps(store, PARENT) == []
    assert latest_committed_step(store, PARENT) is None


def test_truncated_object_is_detected_and_named(store: ObjectStore) -> None:
    objects = _write_step(store, 5)
    path = f"{RunLayout.rollouts_dir(5)}/shard-00000.arrow"
    store.write_bytes(path, objects["shard-00000.arrow"][:-3])
    with pytest.raises(CorruptObjectError) as info:
        verify_step(store, RunLayout.rollouts_dir(5))
    assert info.value.uri == store.url(path)
    assert "size is 117 bytes but _COMMITTED records 120" in str(info.value)


def test_altered_byte_is_detected_and_named(store: ObjectStore) -> None:
    objects = _write_step(store, 5)
    path = f"{RunLayout.rollouts_dir(5)}/shard-00001.arrow"
    store.write_bytes(path, b"Second")  # same size, one byte differs
    with pytest.raises(CorruptObjectError) as info:
        verify_step(store, RunLayout.rollouts_dir(5))
    assert info.value.uri == store.url(path)
    assert "xxh3_128 is" in str(info.value)
    assert digest_bytes(objects["shard-00001.arrow"]).checksum in str(info.value)


def test_missing_object_is_corruption_not_absence(store: ObjectStore) -> None:
    _write_step(store, 5)
    path = f"{RunLayout.rollouts_dir(5)}/shard-00001.arrow"
    store.delete(path)
    with pytest.raises(CorruptObjectError, match="listed in _COMMITTED but missing") as info:
        verify_step(store, RunLayout.rollouts_dir(5))
    assert info.value.uri == store.url(path)


def test_malformed_marker_is_corruption(store: ObjectStore) -> None:
    store.write_bytes(f"{RunLayout.rollouts_dir(1)}/{MARKER}", b"{not json")
    with pytest.raises(CorruptObjectError, match="malformed commit marker") as info:
        read_commit(store, RunLayout.rollouts_dir(1))
    assert info.value.uri == store.url(f"{RunLayout.rollouts_dir(1)}/{MARKER}")


def test_sha256_markers_are_verified_too(store: ObjectStore) -> None:
    step_dir = RunLayout.rollouts_dir(2)
    store.write_bytes(f"{step_dir}/a", b"payload")
    commit_step(store, step_dir, {"a": digest_bytes(b"payload", "sha256")}, step=2)
    assert "sha256" in json.loads(store.read_bytes(f"{step_dir}/{MARKER}"))["files"]["a"]
    verify_step(store, step_dir)
    store.write_bytes(f"{step_dir}/a", b"PAYLOAD")
    with pytest.raises(CorruptObjectError, match="sha256 is"):
        verify_step(store, step_dir)


def test_commit_refuses_a_step_that_does_not_match_its_folder(store: ObjectStore) -> None:
    with pytest.raises(ValueError, match="does not match"):
        commit_step(store, RunLayout.rollouts_dir(1), {}, step=2)
    with pytest.raises(ValueError, match="cannot list itself"):
        commit_step(store, RunLayout.rollouts_dir(1), {MARKER: FileDigest(0, "0")}, step=1)


def test_begin_step_refuses_committed_steps_and_clears_debris(store: ObjectStore) -> None:
    _write_step(store, 1)
    with pytest.raises(AlreadyCommittedError) as info:
        begin_step(store, RunLayout.rollouts_dir(1))
    assert info.value.uri == store.url(RunLayout.rollouts_dir(1))
    _write_step(store, 2, commit=False)
    begin_step(store, RunLayout.rollouts_dir(2))
    assert store.walk_files(RunLayout.rollouts_dir(2)) == []


def test_delete_step_uncommits_before_removing_data(store: ObjectStore) -> None:
    _write_step(store, 1)
    _write_step(store, 2)
    delete_step(store, RunLayout.rollouts_dir(1))
    assert committed_steps(store, PARENT) == [2]
    assert store.walk_files(RunLayout.rollouts_dir(1)) == []


def test_wait_for_step_returns_when_another_thread_commits(memory_store: ObjectStore) -> None:
    def writer() -> None:
        time.sleep(0.2)
        _write_step(memory_store, 6)

    thread = threading.Thread(target=writer)
    started = time.monotonic()
    thread.start()
    record = wait_for_step(memory_store, PARENT, 6, timeout_s=10, poll_s=0.02)
    thread.join()
    assert record.step == 6
    assert 0.2 <= time.monotonic() - started < 5


def test_wait_for_step_times_out_naming_the_step(memory_store: ObjectStore) -> None:
    _write_step(memory_store, 7, commit=False)
    _write_step(memory_store, 8)  # a later step does not satisfy a wait for step 7
    with pytest.raises(StepTimeoutError) as info:
        wait_for_step(memory_store, PARENT, 7, timeout_s=0.2, poll_s=0.05)
    assert info.value.uri == memory_store.url(RunLayout.rollouts_dir(7))
    assert "step 7 was not committed within 0.2s" in str(info.value)


def test_hashing_writer_digest_equals_the_plain_hash() -> None:
    # Large writes are hashed and written piece by piece; the digest must be the plain xxh3 of
    # the bytes in order, whether a write was split or not and whatever its item type.
    rng = np.random.default_rng(0)
    large = rng.integers(0, 2**31, size=commit._WRITE_PIECE * 2 // 4 + 3, dtype=np.int32)
    pieces: list[Bytes] = [
        b"header",
        memoryview(large),  # int32 items: hashed as their bytes
        memoryview(large.reshape(-1, 1)[:1024]),  # 2-D and small
        memoryview(rng.random(commit._WRITE_PIECE * 2 // 8 * 3, dtype=np.float64).reshape(3, -1)),
        b"",
        bytearray(b"footer"),
    ]
    raw = io.BytesIO()
    writer = HashingWriter(raw)
    for piece in pieces:
        assert writer.write(piece) == memoryview(piece).nbytes
    expected = b"".join(memoryview(piece).cast("B").tobytes() for piece in pieces)
    assert raw.getvalue() == expected
    assert writer.tell() == len(expected)
    assert writer.digest() == FileDigest(len(expected), xxhash.xxh3_128(expected).hexdigest())
