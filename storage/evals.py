"""Evaluation results: `<run>/eval/<name>/step_N/`, `results.arrow` (one row per rollout) and
`summary.json` (the numbers), committed together like any step.

Readers (the run report, DuckDB, a resumed evaluation that finds its step done) need only this
module; what the numbers mean is `engine.orchestrator.evaluate`'s.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from storage.commit import begin_step, commit_step, committed_steps, digest_bytes, verify_step
from storage.layout import RunLayout
from storage.paths import join
from storage.store import ObjectStore

RESULTS = "results.arrow"
SUMMARY = "summary.json"

EVAL_SCHEMA = pa.schema(
    [
        pa.field("env", pa.string(), nullable=False),
        pa.field("example_id", pa.int64(), nullable=False),
        pa.field("mode", pa.string(), nullable=False),  # "sampled" or "greedy"
        pa.field("sample", pa.int32(), nullable=False),  # index within the example's k
        pa.field("reward", pa.float64(), nullable=False),  # NaN when it could not be scored
        pa.field("passed", pa.bool_(), nullable=False),
        pa.field("skip_reason", pa.string()),
        pa.field("error", pa.string()),
        pa.field("policy_version", pa.int64()),
        pa.field("temperature", pa.float32(), nullable=False),
        pa.field("completion_tokens", pa.int32(), nullable=False),
        pa.field("is_truncated", pa.bool_(), nullable=False),
        pa.field("prompt_text", pa.string(), nullable=False),
        pa.field("completion_text", pa.string(), nullable=False),
        pa.field("metrics", pa.map_(pa.string(), pa.float64()), nullable=False),
    ]
)


def write_eval(
    store: ObjectStore,
    name: str,
    step: int,
    results: list[dict[str, Any]],
    summary: dict[str, Any],
) -> str:
    """Commit `results.arrow` and `summary.json` under `eval/<name>/step_N/`; its URI."""
    table = pa.Table.from_pylist(results, schema=EVAL_SCHEMA)
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, EVAL_SCHEMA) as writer:
        writer.write_table(table)
    payloads = {
        RESULTS: sink.getvalue().to_pybytes(),
        SUMMARY: (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode(),
    }
    step_dir = RunLayout.eval_dir(name, step)
    begin_step(store, step_dir)
    for file, data in payloads.items():
        store.write_bytes(join(step_dir, file), data)
    commit_step(
        store,
        step_dir,
        {file: digest_bytes(data) for file, data in payloads.items()},
        step=step,
        rows=table.num_rows,
    )
    return store.url(step_dir)


def committed_summary(
    store: ObjectStore, name: str, step: int
) -> tuple[str, dict[str, Any]] | None:
    """URI and summary of `eval/<name>/step_N` when it is committed already (a resumed run
    reuses it: committed steps are immutable), else None."""
    if step not in committed_steps(store, RunLayout.eval_parent(name)):
        return None
    step_dir = RunLayout.eval_dir(name, step)
    verify_step(store, step_dir)
    return store.url(step_dir), json.loads(store.read_bytes(join(step_dir, SUMMARY)))
