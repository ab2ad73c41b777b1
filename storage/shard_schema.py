"""The rollout-shard schema, and the checks that keep bad rows out of training.

The orchestrator writes and the trainer reads these rows, usually in different processes and
versions, so the schema is strict: every declared column, no undeclared ones, and a cast only
where it keeps every value. A ragged per-token row or a NaN reward would otherwise surface as a
shape error or a NaN loss steps later, far from its cause; here it fails at once, naming the
shard, the row and the column.

`metrics` is a `map<string, float32>` rather than a struct: environments score with different
reward functions, and a map keeps one schema for all of them. DuckDB reads it as
`metrics['name']`, pyarrow with `pyarrow.compute.map_lookup`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from storage.errors import InvalidRolloutError

ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("policy_lineage", pa.string(), nullable=False),
        pa.field("env", pa.string(), nullable=False),
        pa.field("example_id", pa.int64(), nullable=False),
        pa.field("group_id", pa.int64(), nullable=False),
        pa.field("rollout_id", pa.int64(), nullable=False),
        pa.field("row_index", pa.int32(), nullable=False),
        pa.field("rollout_rows", pa.int32(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.bool_()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("token_versions", pa.list_(pa.int32()), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("advantage", pa.float32(), nullable=False),
        pa.field("temperature", pa.float32(), nullable=False),
        pa.field("is_truncated", pa.bool_(), nullable=False),
        pa.field("prompt_text", pa.string(), nullable=False),
        pa.field("completion_text", pa.string(), nullable=False),
        pa.field("metrics", pa.map_(pa.string(), pa.float32()), nullable=False),
    ]
)
PER_TOKEN_COLUMNS = ("token_ids", "loss_mask", "logprobs", "token_versions")
#: Columns added after shards were first written: a shard without them reads as rows that are
#: each a whole rollout of their own, every sampled token from the row's `policy_version`.
ADDED_COLUMNS = ("rollout_id", "row_index", "rollout_rows", "token_versions")
#: Columns added later still, and what a shard written before them reads as: `policy_lineage`
#: unknown ('').
DEFAULTED_COLUMNS = {"policy_lineage": ""}
FINITE_COLUMNS = ("reward", "advantage")
ROWS_URI = "<rows>"
_CONVERSION_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError)


def _kind(data_type: pa.DataType) -> str:
    """What a type holds, ignoring width: casts are allowed only between types of one kind."""
    if pa.types.is_map(data_type):
        return f"map<{_kind(data_type.key_type)},{_kind(data_type.item_type)}>"
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        return f"list<{_kind(data_type.value_type)}>"
    if pa.types.is_integer(data_type):
        return "int"
    if pa.types.is_floating(data_type):
        return "float"
    if pa.types.is_string(data_type) or pa.types.is_large_string(data_type):
        return "string"
    return str(data_type)


def _conform_column(column: pa.ChunkedArray, field: pa.Field, uri: str) -> pa.ChunkedArray:
    """Cast `column` to the field's type where no value changes; floats may round to float32."""
    if column.type == field.type:
        return column
    if _kind(column.type) != _kind(field.type):
        raise InvalidRolloutError(
            uri, f"has type {column.type}, the schema needs {field.type}", column=field.name
        )
    try:
        return pc.cast(column, field.type, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise InvalidRolloutError(
            uri, f"cannot be stored as {field.type} without loss: {exc}", column=field.name
        ) from exc


def conform_table(table: pa.Table, uri: str) -> pa.Table:
    """`table` with exactly the schema's columns, in order and types; `InvalidRolloutError` else."""
    names = table.column_names
    if len(set(names)) != len(names):
        duplicate = next(name for name in names if names.count(name) > 1)
        raise InvalidRolloutError(uri, "appears more than once", column=duplicate)
    for name in names:
        if name not in ROLLOUT_SCHEMA.names:
            raise InvalidRolloutError(
                uri, "is not declared in ROLLOUT_SCHEMA (extra columns are refused)", column=name
            )
    if any(name in names for name in ADDED_COLUMNS) or "group_id" not in names:
        legacy = {}
    else:
        legacy = _legacy_columns(table)
    for name, value in DEFAULTED_COLUMNS.items():
        if name not in names:
            legacy[name] = pa.array([value] * table.num_rows, ROLLOUT_SCHEMA.field(name).type)
    for field in ROLLOUT_SCHEMA:
        if field.name not in names and field.name not in legacy:
            raise InvalidRolloutError(uri, "is missing", column=field.name)
    columns = [
        legacy[field.name]
        if field.name in legacy
        else _conform_column(table[field.name], field, uri)
        for field in ROLLOUT_SCHEMA
    ]
    return pa.Table.from_arrays(columns, schema=ROLLOUT_SCHEMA)


def _legacy_columns(table: pa.Table) -> dict[str, pa.Array]:
    """`ADDED_COLUMNS` for a shard written before them (see there)."""
    rows = table.num_rows
    mask = table["loss_mask"].combine_chunks()
    versions = pc.if_else(
        pc.list_flatten(mask),
        pc.take(table["policy_version"].combine_chunks(), pc.list_parent_indices(mask)),
        -1,
    )
    return {
        "rollout_id": pa.array(range(-rows, 0), pa.int64()),  # negative: never a real id
        "row_index": pa.array([0] * rows, pa.int32()),
        "rollout_rows": pa.array([1] * rows, pa.int32()),
        "token_versions": pa.ListArray.from_arrays(mask.offsets, versions.cast(pa.int32())),
    }


def _first(mask: pa.Array) -> int | None:
    """Index of the first true value of a boolean array without nulls."""
    index = pc.index(mask, True).as_py()
    return None if index < 0 else index


def _first_row_of_item(values: pa.Array, item_mask: pa.Array) -> tuple[int, int]:
    """(row, item index) of the first flagged item of a list column known to have one."""
    item = pc.index(item_mask, True).as_py()
    return pc.list_parent_indices(values)[item].as_py(), item


_Problem = tuple[int, str, str]  # (row within the batch, column, what is wrong)
_Check = Callable[[pa.RecordBatch, int | None], _Problem | None]


def _list_values(column: pa.Array) -> pa.Array:
    """A list or map column as one list of values per row (compute kernels take no maps)."""
    if pa.types.is_map(column.type):
        return pa.ListArray.from_arrays(column.offsets, column.items)
    return column


def _check_nulls(batch: pa.RecordBatch, step: int | None) -> _Problem | None:
    # null_count is a cheap bitmap count; rows are searched only once a null is known to exist.
    for name in ROLLOUT_SCHEMA.names:
        column = batch.column(name)
        if column.null_count:
            row = _first(column.is_null())
            assert row is not None  # null_count > 0: some row is null
            return row, name, "is null"
        if pa.types.is_list(column.type) or pa.types.is_map(column.type):
            values = _list_values(column)
            items = pc.list_flatten(values)
            if items.null_count:
                row, _ = _first_row_of_item(values, items.is_null())
                return row, name, "has a null item"
    return None


def _check_lengths(batch: pa.RecordBatch, step: int | None) -> _Problem | None:
    first, *others = PER_TOKEN_COLUMNS
    expected = pc.list_value_length(batch.column(first))
    for name in others:
        lengths = pc.list_value_length(batch.column(name))
        row = _first(pc.not_equal(lengths, expected))
        if row is not None:
            return (
                row,
                name,
                f"has {lengths[row]} items but {first} has {expected[row]}: per-token columns "
                "must have equal lengths",
            )
    return None


def _check_token_ids(batch: pa.RecordBatch, step: int | None) -> _Problem | None:
    column = batch.column("token_ids")
    items = pc.list_flatten(column)
    lowest = pc.min(items).as_py()
    if lowest is None or lowest >= 0:
        return None
    row, item = _first_row_of_item(column, pc.less(items, 0))
    return row, "token_ids", f"token id {items[item]} is negative"


def _check_finite(batch: pa.RecordBatch, step: int | None) -> _Problem | None:
    for name in FINITE_COLUMNS:
        column = batch.column(name)
        row = _first(pc.invert(pc.is_finite(column)))
        if row is not None:
            return row, name, f"is {column[row]}, not a finite number"
    return None


def _check_step(batch: pa.RecordBatch, step: int | None) -> _Problem | None:
    if step is None:
        return None
    column = batch.column("step")
    row = _first(pc.not_equal(column, step))
    if row is None:
        return None
    return row, "step", f"is {column[row]} but the shard belongs to step {step}"


_CHECKS: tuple[_Check, ...] = (
    _check_nulls,
    _check_lengths,
    _check_token_ids,
    _check_finite,
    _check_step,
)


def check_whole_rollouts(table: pa.Table, uri: str = ROWS_URI) -> None:
    """Every rollout in `table` has all its rows, once each: the trainer never sees a fragment
    of a rollout (a row of a split one whose other rows were dropped)."""
    if not table.num_rows:
        return
    keys = table.select(["rollout_id", "row_index", "rollout_rows"])
    rows = keys.group_by("rollout_id").aggregate(
        [
            ("row_index", "count_distinct"),
            ("row_index", "count"),
            ("rollout_rows", "min"),
            ("rollout_rows", "max"),
            ("row_index", "max"),
        ]
    )
    whole = pc.and_(
        pc.and_(
            pc.equal(rows["row_index_count_distinct"], rows["row_index_count"]),
            pc.equal(rows["rollout_rows_min"], rows["rollout_rows_max"]),
        ),
        pc.and_(
            pc.equal(rows["row_index_count"], rows["rollout_rows_max"]),
            pc.less(rows["row_index_max"], rows["rollout_rows_max"]),
        ),
    )
    broken = _first(pc.invert(whole))
    if broken is None:
        return
    rollout = rows["rollout_id"][broken].as_py()
    present = sorted(
        pc.filter(keys["row_index"], pc.equal(keys["rollout_id"], rollout)).to_pylist()
    )
    expected = rows["rollout_rows_max"][broken].as_py()
    first_row = _first(pc.equal(keys["rollout_id"], rollout).combine_chunks())
    raise InvalidRolloutError(
        uri,
        f"rollout {rollout} has rows {present} of {expected}: a rollout's rows are kept or "
        "dropped together",
        row=first_row,
        column="row_index",
    )


def validate_rollouts(
    table: pa.Table, *, step: int | None, uri: str = ROWS_URI, row_offset: int = 0
) -> pa.Table:
    """Conform `table` to `ROLLOUT_SCHEMA` and check every row.

    `step`, when given, is what the `step` column must hold. Rows are reported counting from
    `row_offset`, so that a writer splitting its table into shards hears about its own rows.
    """
    table = conform_table(table, uri)
    check_rows(table, step=step, uri=uri, row_offset=row_offset)
    return table


def check_rows(table: pa.Table, *, step: int | None, uri: str, row_offset: int = 0) -> None:
    """`validate_rollouts`' row checks, for a table already in the schema (`conform_table`)."""
    offset = row_offset
    for batch in table.to_batches():
        for check in _CHECKS:
            problem = check(batch, step)
            if problem is not None:
                row, column, detail = problem
                raise InvalidRolloutError(uri, detail, row=offset + row, column=column)
        offset += batch.num_rows


def _column_from_rows(field: pa.Field, values: list[Any]) -> pa.Array:
    """One column built from Python values; a failure names the first row that cannot fit."""
    try:
        return pa.array(values, type=field.type)
    except _CONVERSION_ERRORS as whole:
        for row, value in enumerate(values):
            try:
                pa.array([value], type=field.type)
            except _CONVERSION_ERRORS as exc:
                raise InvalidRolloutError(
                    ROWS_URI, f"cannot hold {value!r:.80}: {exc}", row=row, column=field.name
                ) from exc
        raise InvalidRolloutError(ROWS_URI, str(whole), column=field.name) from whole


def rows_to_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Build a rollout table from one dict per sample, with exactly the schema's keys."""
    expected = set(ROLLOUT_SCHEMA.names)
    for index, row in enumerate(rows):
        keys = set(row)
        if keys != expected:
            missing, extra = sorted(expected - keys), sorted(keys - expected)
            column = (missing or extra)[0]
            detail = "is missing" if missing else "is not declared in ROLLOUT_SCHEMA"
            raise InvalidRolloutError(ROWS_URI, detail, row=index, column=column)
    columns = [
        _column_from_rows(field, [row[field.name] for row in rows]) for field in ROLLOUT_SCHEMA
    ]
    return pa.Table.from_arrays(columns, schema=ROLLOUT_SCHEMA)
