"""Rollout shards: `<run>/rollouts/step_NNNNNN/shard-NNNNN.arrow` plus `_COMMITTED`.

Shards are Arrow IPC files (the random-access "file" format, which pyarrow, DuckDB and polars
open directly), LZ4-compressed by default. LZ4 is chosen for the reader: the trainer waits on
reads, and LZ4 decodes at 5-14 GiB/s where zstd-1 decodes at 1.6-3 GiB/s; it also encodes
faster than zstd-1 (0.8-2.4 vs 0.6-1.7 GiB/s on one core), for files 17-36% smaller than
uncompressed (zstd-1: 33-46%). Writers on a slow network link may pass `compression="zstd"`
(zstd level 1) for smaller files; `None` writes uncompressed. Readers need no setting: the
codec is recorded in the file.

Each shard is encoded in memory, hashed from the same bytes and written in one PUT, so nothing
is read back; `max_rows_per_shard` bounds that memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import pyarrow as pa
import pyarrow.ipc as ipc

from storage.commit import (
    CommitRecord,
    FileDigest,
    begin_step,
    commit_step,
    digest_bytes,
    read_commit,
    read_verified,
)
from storage.errors import CorruptObjectError
from storage.layout import RunLayout
from storage.paths import join
from storage.shard_schema import (
    ROLLOUT_SCHEMA,
    conform_table,
    rows_to_table,
    validate_rollouts,
)
from storage.store import ObjectStore

__all__ = ["ROLLOUT_SCHEMA", "read_rollouts", "rows_to_table", "shard_name", "write_rollouts"]

Compression = Literal["lz4", "zstd"] | None
_WRITE_OPTIONS: dict[Compression, ipc.IpcWriteOptions] = {
    "lz4": ipc.IpcWriteOptions(compression="lz4"),
    "zstd": ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=1)),
    None: ipc.IpcWriteOptions(),
}
_SHARD_PREFIX = "shard-"
_SHARD_SUFFIX = ".arrow"


def shard_name(index: int) -> str:
    """`shard-00003.arrow`: zero-padded so that names sort in write order."""
    return f"{_SHARD_PREFIX}{index:05d}{_SHARD_SUFFIX}"


def _encode(table: pa.Table, compression: Compression) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, ROLLOUT_SCHEMA, options=_WRITE_OPTIONS[compression]) as writer:
        writer.write_table(table)
    return sink.getvalue()


def write_rollouts(
    store: ObjectStore,
    step: int,
    table: pa.Table | Sequence[Mapping[str, Any]],
    *,
    max_rows_per_shard: int = 4096,
    compression: Compression = "lz4",
    meta: Mapping[str, Any] | None = None,
) -> CommitRecord:
    """Validate and write the rollouts of `step` below the run root `store`, then commit them.

    Every row is checked before the first byte is written, so an invalid batch leaves nothing
    behind. An empty table commits a step with no shards.
    """
    if compression not in _WRITE_OPTIONS:
        raise ValueError(f"compression must be 'lz4', 'zstd' or None, got {compression!r}")
    if max_rows_per_shard < 1:
        raise ValueError(f"max_rows_per_shard must be >= 1, got {max_rows_per_shard}")
    if not isinstance(table, pa.Table):
        table = rows_to_table(table)
    step_dir = RunLayout.rollouts_dir(step)
    table = conform_table(table, store.url(step_dir))
    slices = [
        (offset, table.slice(offset, max_rows_per_shard))
        for offset in range(0, table.num_rows, max_rows_per_shard)
    ]
    checked = [
        validate_rollouts(
            part, step=step, uri=store.url(join(step_dir, shard_name(index))), row_offset=offset
        )
        for index, (offset, part) in enumerate(slices)
    ]
    begin_step(store, step_dir)
    digests: dict[str, FileDigest] = {}
    for index, part in enumerate(checked):
        name = shard_name(index)
        data = memoryview(_encode(part, compression))
        digests[name] = digest_bytes(data)
        store.write_bytes(join(step_dir, name), data)
    return commit_step(store, step_dir, digests, step=step, rows=table.num_rows, meta=meta)


def _decode(uri: str, data: bytes) -> pa.Table:
    try:
        return ipc.open_file(pa.py_buffer(data)).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise CorruptObjectError(uri, f"not a readable Arrow IPC file: {exc}") from exc


def read_rollouts(store: ObjectStore, step: int) -> pa.Table:
    """All rows of committed `step`, each shard verified against `_COMMITTED` and validated.

    Raises `NotCommittedError` when the step is not committed (yet), `CorruptObjectError` when
    a shard is missing, truncated or altered, and `InvalidRolloutError` for rows that break the
    schema.
    """
    step_dir = RunLayout.rollouts_dir(step)
    record = read_commit(store, step_dir)
    tables = []
    for name, expected in sorted(record.files.items()):
        path = join(step_dir, name)
        uri = store.url(path)
        data = read_verified(store, path, expected)
        tables.append(validate_rollouts(_decode(uri, data), step=step, uri=uri))
    table = pa.concat_tables(tables) if tables else ROLLOUT_SCHEMA.empty_table()
    if record.rows is not None and table.num_rows != record.rows:
        raise CorruptObjectError(
            store.url(step_dir),
            f"shards hold {table.num_rows} rows but _COMMITTED records {record.rows}",
        )
    return table
