"""RL training data: the committed rollout shards of one step, checked and turned into samples.

The storage layer already verified checksums and the shard schema (per-token columns aligned,
no nulls, finite rewards). What only the trainer can check is checked here, before any compute:
token ids inside the model's vocabulary, sequences that fit `seq_len` (unless truncation is
configured) and positive temperatures. Each error names the step, the row and the value.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.trainer.packing import Sample, truncate
from storage.commit import wait_for_step
from storage.errors import StepTimeoutError
from storage.layout import RunLayout
from storage.shards import read_rollouts
from storage.store import ObjectStore


class RolloutDataError(ValueError):
    """A committed shard holds data the trainer cannot train on."""


def wait_for_rollouts(store: ObjectStore, step: int, timeout_s: float, poll_s: float) -> pa.Table:
    """Block until `rollouts/step_<step>` is committed, then read and verify it."""
    try:
        wait_for_step(store, RunLayout.ROLLOUTS, step, timeout_s=timeout_s, poll_s=poll_s)
    except StepTimeoutError as exc:
        raise TimeoutError(
            f"trainer: no rollouts for step {step} at {store.url(RunLayout.rollouts_dir(step))} "
            f"after {timeout_s:g}s (trainer.rollout_timeout_s); is the orchestrator running "
            "and writing to the same run?"
        ) from exc
    return read_rollouts(store, step)


def samples_from_rollouts(
    table: pa.Table, *, step: int, vocab_size: int, seq_len: int, allow_truncation: bool
) -> list[Sample]:
    """One `Sample` per rollout row; `RolloutDataError` on anything the model cannot take."""
    token_ids = table.column("token_ids").combine_chunks()
    if len(token_ids) and len(pc.list_flatten(token_ids)):
        largest = pc.max(pc.list_flatten(token_ids)).as_py()
        if largest >= vocab_size:
            flags = pc.greater_equal(pc.list_flatten(token_ids), vocab_size)
            item = pc.index(flags, True).as_py()
            row = pc.list_parent_indices(token_ids)[item].as_py()
            raise RolloutDataError(
                f"rollouts step {step}, row {row}: token id {largest} is outside the model's "
                f"vocabulary (size {vocab_size}); were the rollouts made with another model?"
            )
    columns = table.select(["token_ids", "loss_mask", "logprobs", "advantage", "temperature"])
    samples = []
    for row, values in enumerate(columns.to_pylist()):
        if not values["token_ids"]:
            raise RolloutDataError(f"rollouts step {step}, row {row}: no tokens")
        if len(values["token_ids"]) > seq_len and not allow_truncation:
            raise RolloutDataError(
                f"rollouts step {step}, row {row}: {len(values['token_ids'])} tokens exceed "
                f"seq_len={seq_len}; raise seq_len or set trainer.truncate = true"
            )
        if not values["temperature"] > 0:
            raise RolloutDataError(
                f"rollouts step {step}, row {row}: temperature {values['temperature']} must be "
                "> 0 (greedy samples cannot be importance-weighted; sample with temperature > 0)"
            )
        sample = Sample(
            token_ids=np.asarray(values["token_ids"], dtype=np.int64),
            loss_mask=np.asarray(values["loss_mask"], dtype=np.bool_),
            logprobs=np.asarray(values["logprobs"], dtype=np.float32),
            advantage=float(values["advantage"]),
            temperature=float(values["temperature"]),
        )
        samples.append(truncate(sample, seq_len))
    return samples
