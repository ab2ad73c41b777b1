"""Rollout shards: round trips, sharding, and rows that must never reach the trainer."""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pytest

from storage.commit import MARKER, commit_step, committed_steps, digest_bytes, read_commit
from storage.errors import (
    AlreadyCommittedError,
    CorruptObjectError,
    InvalidRolloutError,
    NotCommittedError,
)
from storage.layout import RunLayout
from storage.shard_schema import conform_table
from storage.shards import ROLLOUT_SCHEMA, read_rollouts, rows_to_table, write_rollouts
from storage.store import ObjectStore
from tests.unit.storage.samples import make_row, rows


def test_round_trip_keeps_every_value(store: ObjectStore) -> None:
    table = rows_to_table(rows(6))
    record = write_rollouts(store, 3, table, meta={"policy_version": 2})
    assert record.rows == 6
    assert record.meta == {"policy_version": 2}
    assert list(record.files) == ["shard-00000.arrow"]
    back = read_rollouts(store, 3)
    assert back.schema == ROLLOUT_SCHEMA
    assert back.equals(table)
    assert back.to_pylist()[1]["metrics"] == [("reversed_similarity", 1.0), ("format", 1.0)]
    assert committed_steps(store, RunLayout.ROLLOUTS) == [3]


def test_each_row_keeps_the_lineage_of_its_version(store: ObjectStore) -> None:
    """Version 2 of a dead trainer and version 2 of the one resumed after it differ only by
    `policy_lineage`; a shard written before the column reads as lineage unknown ('')."""
    table = rows_to_table(rows(4))
    write_rollouts(store, 3, table)
    back = read_rollouts(store, 3)
    assert back.column("policy_version").to_pylist() == [2, 2, 2, 2]
    assert back.column("policy_lineage").to_pylist() == ["lineage-0", "lineage-1"] * 2
    older = conform_table(table.drop_columns(["policy_lineage"]), "<older>")
    assert older.column("policy_lineage").to_pylist() == [""] * 4
    assert older.schema == ROLLOUT_SCHEMA


def test_rows_are_split_into_ordered_shards(store: ObjectStore) -> None:
    table = rows_to_table(rows(10))
    record = write_rollouts(store, 3, rows(10), max_rows_per_shard=3)
    assert sorted(record.files) == [f"shard-0000{i}.arrow" for i in range(4)]
    assert read_rollouts(store, 3).equals(table)


@pytest.mark.parametrize("compression", ["auto", "lz4", "zstd", None])
def test_every_compression_reads_back(memory_store: ObjectStore, compression: str | None) -> None:
    write_rollouts(memory_store, 3, rows(5), compression=compression)  # type: ignore[arg-type]
    assert read_rollouts(memory_store, 3).num_rows == 5


def test_auto_compression_leaves_local_shards_uncompressed(store: ObjectStore) -> None:
    auto = write_rollouts(store, 1, rows(20, step=1))
    plain = write_rollouts(store, 2, rows(20, step=2), compression=None)
    zstd = write_rollouts(store, 3, rows(20, step=3), compression="zstd")
    assert auto.files["shard-00000.arrow"].size == plain.files["shard-00000.arrow"].size
    assert zstd.files["shard-00000.arrow"].size < plain.files["shard-00000.arrow"].size


def test_unknown_compression_is_refused(memory_store: ObjectStore) -> None:
    with pytest.raises(ValueError, match="compression"):
        write_rollouts(memory_store, 3, rows(1), compression="gzip")  # type: ignore[arg-type]


def test_empty_step_commits_with_no_shards(store: ObjectStore) -> None:
    record = write_rollouts(store, 0, ROLLOUT_SCHEMA.empty_table())
    assert record.files == {} and record.rows == 0
    assert read_rollouts(store, 0).equals(ROLLOUT_SCHEMA.empty_table())


def test_tables_in_wider_types_are_cast_without_loss(memory_store: ObjectStore) -> None:
    table = rows_to_table(rows(4))
    wide = table.set_column(
        table.schema.get_field_index("token_ids"),
        "token_ids",
        pa.array(table["token_ids"].to_pylist(), pa.large_list(pa.int64())),
    ).set_column(
        table.schema.get_field_index("reward"),
        "reward",
        pa.array(table["reward"].to_pylist(), pa.float64()),
    )
    write_rollouts(memory_store, 3, wide)
    assert read_rollouts(memory_store, 3).equals(table)


def _assert_nothing_written(store: ObjectStore, step: int) -> None:
    assert store.walk_files(RunLayout.rollouts_dir(step)) == []


@pytest.mark.parametrize(
    ("changes", "column", "message"),
    [
        ({"reward": math.nan}, "reward", "is nan, not a finite number"),
        ({"advantage": -math.inf}, "advantage", "is -inf, not a finite number"),
        ({"loss_mask": [True]}, "loss_mask", "per-token columns must have equal lengths"),
        ({"logprobs": [0.0] * 20}, "logprobs", "per-token columns must have equal lengths"),
        ({"token_ids": [5, -1, 7, 8]}, "token_ids", "token id -1 is negative"),
        ({"step": 2}, "step", "is 2 but the shard belongs to step 3"),
    ],
)
def test_bad_rows_name_the_shard_row_and_column(
    memory_store: ObjectStore, changes: dict[str, Any], column: str, message: str
) -> None:
    batch = rows(8)
    batch[5] = make_row(5, **changes)  # row 5 has 4 tokens; it lands in the second shard
    with pytest.raises(InvalidRolloutError) as info:
        write_rollouts(memory_store, 3, batch, max_rows_per_shard=4)
    error = info.value
    assert (error.row, error.column) == (5, column)
    assert error.uri == memory_store.url("rollouts/step_000003/shard-00001.arrow")
    assert message in str(error)
    assert f"row 5, column {column!r}" in str(error)
    _assert_nothing_written(memory_store, 3)


def test_rows_with_missing_or_undeclared_keys_are_refused() -> None:
    with pytest.raises(InvalidRolloutError, match="row 1, column 'reward': is missing"):
        rows_to_table([make_row(0), {k: v for k, v in make_row(1).items() if k != "reward"}])
    with pytest.raises(InvalidRolloutError, match="column 'extra': is not declared"):
        rows_to_table([make_row(0, extra=1)])
    with pytest.raises(InvalidRolloutError, match="row 1, column 'example_id': cannot hold 'x'"):
        rows_to_table([make_row(0), make_row(1, example_id="x")])


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda t: t.append_column("extra", pa.array([1] * t.num_rows)), "column 'extra'"),
        (lambda t: t.drop_columns(["advantage"]), "column 'advantage': is missing"),
        (
            lambda t: t.set_column(1, "policy_version", pa.array(["v"] * t.num_rows)),
            "column 'policy_version': has type string, the schema needs int64",
        ),
        (
            lambda t: t.set_column(
                t.schema.get_field_index("token_ids"),
                "token_ids",
                pa.array([[2**40]] * t.num_rows, pa.list_(pa.int64())),
            ),
            "column 'token_ids': cannot be stored as list<item: int32> without loss",
        ),
    ],
)
def test_wrong_schemas_are_refused_before_writing(
    memory_store: ObjectStore, mutate: Any, match: str
) -> None:
    with pytest.raises(InvalidRolloutError, match=match):
        write_rollouts(memory_store, 3, mutate(rows_to_table(rows(3))))
    _assert_nothing_written(memory_store, 3)


def _write_raw_shard(store: ObjectStore, step: int, table: pa.Table) -> str:
    """Commit a shard written with plain pyarrow, bypassing the writer's checks."""
    path = f"{RunLayout.rollouts_dir(step)}/shard-00000.arrow"
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    store.write_bytes(path, data)
    commit_step(
        store, RunLayout.rollouts_dir(step), {"shard-00000.arrow": digest_bytes(data)}, step=step
    )
    return path


def test_reader_validates_what_other_writers_committed(memory_store: ObjectStore) -> None:
    table = rows_to_table(rows(4))
    rewards = pc.if_else(pa.array([False, False, True, False]), math.nan, table["reward"])
    bad = table.set_column(table.schema.get_field_index("reward"), "reward", rewards)
    path = _write_raw_shard(memory_store, 3, bad)
    with pytest.raises(InvalidRolloutError) as info:
        read_rollouts(memory_store, 3)
    assert (info.value.uri, info.value.row, info.value.column) == (
        memory_store.url(path),
        2,
        "reward",
    )


def test_reader_detects_altered_shards(memory_store: ObjectStore) -> None:
    write_rollouts(memory_store, 3, rows(4))
    path = "rollouts/step_000003/shard-00000.arrow"
    data = bytearray(memory_store.read_bytes(path))
    data[len(data) // 2] ^= 0xFF
    memory_store.write_bytes(path, bytes(data))
    with pytest.raises(CorruptObjectError) as info:
        read_rollouts(memory_store, 3)
    assert info.value.uri == memory_store.url(path)


def test_uncommitted_step_cannot_be_read(memory_store: ObjectStore) -> None:
    write_rollouts(memory_store, 3, rows(2))
    memory_store.delete(f"{RunLayout.rollouts_dir(3)}/{MARKER}")  # as if the writer died
    with pytest.raises(NotCommittedError):
        read_rollouts(memory_store, 3)
    assert committed_steps(memory_store, RunLayout.ROLLOUTS) == []


def test_committed_step_is_never_rewritten(memory_store: ObjectStore) -> None:
    write_rollouts(memory_store, 3, rows(2))
    with pytest.raises(AlreadyCommittedError):
        write_rollouts(memory_store, 3, rows(5))
    assert read_rollouts(memory_store, 3).num_rows == 2
    assert read_commit(memory_store, RunLayout.rollouts_dir(3)).rows == 2


def test_rewrite_after_a_crash_replaces_the_debris(memory_store: ObjectStore) -> None:
    write_rollouts(memory_store, 3, rows(9), max_rows_per_shard=3)
    memory_store.delete(f"{RunLayout.rollouts_dir(3)}/{MARKER}")
    write_rollouts(memory_store, 3, rows(2), max_rows_per_shard=3)
    assert memory_store.list(RunLayout.rollouts_dir(3)) == [MARKER, "shard-00000.arrow"]
    assert read_rollouts(memory_store, 3).num_rows == 2


def test_a_fragment_of_a_split_rollout_is_refused_and_a_whole_one_is_kept(
    memory_store: ObjectStore,
) -> None:
    split = [make_row(0, rollout_id=7, row_index=i, rollout_rows=3) for i in range(3)]
    write_rollouts(memory_store, 3, [*split, make_row(1)], max_rows_per_shard=2)
    table = read_rollouts(memory_store, 3)  # its rows span two shards: still whole
    assert table.column("rollout_id").to_pylist() == [7, 7, 7, 1]
    with pytest.raises(InvalidRolloutError, match=r"rollout 7 has rows \[0, 2\] of 3") as bad:
        write_rollouts(memory_store, 4, [split[0], split[2]], max_rows_per_shard=2)
    assert bad.value.column == "row_index"
    assert committed_steps(memory_store, RunLayout.ROLLOUTS) == [3]


def test_a_shard_written_before_rollout_ids_reads_as_one_rollout_per_row(
    memory_store: ObjectStore,
) -> None:
    old = rows_to_table(rows(3)).drop_columns(
        ["rollout_id", "row_index", "rollout_rows", "token_versions"]
    )
    table = conform_table(old, "<old shard>")
    assert table.column("rollout_rows").to_pylist() == [1, 1, 1]
    assert len(set(table.column("rollout_id").to_pylist())) == 3
    mask, versions = table.column("loss_mask")[0].as_py(), table.column("token_versions")[0]
    assert versions.as_py() == [2 if sampled else -1 for sampled in mask]  # policy_version 2
