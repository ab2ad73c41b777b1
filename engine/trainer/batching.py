"""Split one step's packed rows across ranks (balanced by tokens) and into micro-batches.

FSDP2 runs collectives in every forward and backward, so every rank must run the same number of
micro-batches in a step; ranks that run short of data get all-padding rows, which carry no loss.
Within that constraint rows are dealt out longest-first to the rank with the fewest tokens so
far (LPT scheduling), which keeps the slowest rank — the one the others wait for — close to the
mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from engine.trainer.packing import PackedRows, empty_rows


def rows_per_micro_batch(micro_batch_tokens: int | None, seq_len: int) -> int:
    """Rows of `seq_len` in one micro-batch of at most `micro_batch_tokens` (at least one row)."""
    if micro_batch_tokens is None:
        return 1
    return max(1, micro_batch_tokens // seq_len)


def rows_per_rank(num_rows: int, world_size: int, per_micro: int) -> int:
    """Rows each rank processes: an equal share, rounded up to whole micro-batches (≥ 1)."""
    share = max(1, math.ceil(num_rows / world_size))
    return math.ceil(share / per_micro) * per_micro


def balance_rows(tokens: Sequence[int], world_size: int, capacity: int) -> list[list[int]]:
    """Row indices per rank: LPT by `tokens`, at most `capacity` rows per rank.

    Deterministic (ties go to the lower row and rank index), so every rank computes the same
    assignment from the same batch without talking to the others.
    """
    if len(tokens) > world_size * capacity:
        raise ValueError(f"{len(tokens)} rows do not fit {world_size} ranks × {capacity} rows")
    order = sorted(range(len(tokens)), key=lambda i: (-tokens[i], i))
    load = [0] * world_size
    assigned: list[list[int]] = [[] for _ in range(world_size)]
    for row in order:
        open_ranks = [r for r in range(world_size) if len(assigned[r]) < capacity]
        rank = min(open_ranks, key=lambda r: (load[r], r))
        assigned[rank].append(row)
        load[rank] += tokens[row]
    return assigned


def rank_share(rows: PackedRows, rank: int, world_size: int, per_micro: int) -> PackedRows:
    """The rows `rank` trains on this step, padded with empty rows to the common count."""
    capacity = rows_per_rank(rows.num_rows, world_size, per_micro)
    mine = balance_rows(rows.real_tokens().tolist(), world_size, capacity)[rank]
    share = rows.select(mine)
    missing = capacity - share.num_rows
    if missing:
        share = concat_rows([share, empty_rows(missing, rows.seq_len)])
    return share


def concat_rows(parts: Sequence[PackedRows]) -> PackedRows:
    """Rows of every part, in order."""
    return PackedRows(
        input_ids=np.concatenate([p.input_ids for p in parts]),
        position_ids=np.concatenate([p.position_ids for p in parts]),
        targets=np.concatenate([p.targets for p in parts]),
        loss_mask=np.concatenate([p.loss_mask for p in parts]),
        inference_logprobs=np.concatenate([p.inference_logprobs for p in parts]),
        advantages=np.concatenate([p.advantages for p in parts]),
        temperatures=np.concatenate([p.temperatures for p in parts]),
        loss_weights=np.concatenate([p.loss_weights for p in parts]),
        lags=np.concatenate([p.lags for p in parts]),
        doc_lens=[lens for p in parts for lens in p.doc_lens],
        sample_index=[members for p in parts for members in p.sample_index],
    )


def micro_batches(rows: PackedRows, per_micro: int) -> list[PackedRows]:
    """Consecutive groups of `per_micro` rows (the last may be shorter)."""
    return [
        rows.select(range(start, min(start + per_micro, rows.num_rows)))
        for start in range(0, rows.num_rows, per_micro)
    ]
