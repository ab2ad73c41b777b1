"""RL training data: the committed rollout shards of one step, checked and turned into samples.

The storage layer already verified checksums and the shard schema (per-token columns aligned,
no nulls, finite rewards). What only the trainer can check is checked here, before any compute:
token ids inside the model's vocabulary, sequences that fit `seq_len` (unless truncation is
configured) and positive temperatures. Each error names the step, the row and the value.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from engine.trainer.packing import Sample, truncate
from storage.layout import RunLayout
from storage.store import ObjectStore


class RolloutDataError(ValueError):
    """A committed shard holds data the trainer cannot train on."""


def no_rollouts_error(store: ObjectStore, step: int, timeout_s: float) -> TimeoutError:
    """What a trainer that waited `timeout_s` for step `step`'s rollouts in vain raises."""
    return TimeoutError(
        f"trainer: no rollouts for step {step} at {store.url(RunLayout.rollouts_dir(step))} "
        f"after {timeout_s:g}s (trainer.rollout_timeout_s); is the orchestrator running "
        "and writing to the same run?"
    )


def _flat(table: pa.Table, name: str, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (offsets [rows + 1], values) numpy arrays, read from Arrow's buffers
    (numbers without a copy where the types agree; booleans are unpacked from their bits)."""
    column = table.column(name).combine_chunks()
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return offsets, values


def _first(flags: np.ndarray) -> int | None:
    rows = np.flatnonzero(flags)
    return int(rows[0]) if rows.size else None


def samples_from_rollouts(
    table: pa.Table, *, step: int, vocab_size: int, seq_len: int, allow_truncation: bool
) -> list[Sample]:
    """One `Sample` per rollout row; `RolloutDataError` on anything the model cannot take.

    Each sample's arrays are views into one flat array per column: no Python lists.
    """
    offsets, token_ids = _flat(table, "token_ids", np.int64)
    mask_offsets, loss_mask = _flat(table, "loss_mask", np.bool_)
    logprob_offsets, logprobs = _flat(table, "logprobs", np.float32)
    advantages = table.column("advantage").to_numpy().astype(np.float64)
    temperatures = table.column("temperature").to_numpy().astype(np.float64)
    # Versions behind the weights that train on batch `step` (version step - 1).
    lags = (step - 1) - table.column("policy_version").to_numpy().astype(np.int64)
    lengths = np.diff(offsets)
    if len(token_ids) and token_ids.max() >= vocab_size:
        bad = int(np.searchsorted(offsets, np.argmax(token_ids >= vocab_size), side="right")) - 1
        raise RolloutDataError(
            f"rollouts step {step}, row {bad}: token id {token_ids.max()} is outside the model's "
            f"vocabulary (size {vocab_size}); were the rollouts made with another model?"
        )
    if (row := _first(lengths == 0)) is not None:
        raise RolloutDataError(f"rollouts step {step}, row {row}: no tokens")
    if not allow_truncation and (row := _first(lengths > seq_len)) is not None:
        raise RolloutDataError(
            f"rollouts step {step}, row {row}: {lengths[row]} tokens exceed "
            f"seq_len={seq_len}; raise seq_len or set trainer.truncate = true"
        )
    if (row := _first(~(temperatures > 0))) is not None:
        raise RolloutDataError(
            f"rollouts step {step}, row {row}: temperature {temperatures[row]} must be "
            "> 0 (greedy samples cannot be importance-weighted; sample with temperature > 0)"
        )
    samples = []
    for row in range(table.num_rows):
        start, end = offsets[row], offsets[row + 1]
        sample = Sample(
            token_ids=token_ids[start:end],
            loss_mask=loss_mask[mask_offsets[row] : mask_offsets[row + 1]],
            logprobs=logprobs[logprob_offsets[row] : logprob_offsets[row + 1]],
            advantage=float(advantages[row]),
            temperature=float(temperatures[row]),
            lag=int(lags[row]),
        )
        samples.append(truncate(sample, seq_len))
    return samples
