"""The trainer's shard read: committed rollout rows → `Sample`s, against the way it used to.

    .venv/bin/python -m tests.bench.trainer.bench_rollout_read [--rows 4096] [--seq-len 512]
    make bench        # through tests/bench/trainer/test_bench_rollout_read.py

`samples_from_rollouts` takes each sample's arrays as views into one numpy array per column,
read from Arrow's buffers. The baseline, measured in the same run on the same table, is what it
did before (issue 17): every row through `Table.to_pylist()`, then `np.asarray` per column per
row. Both make the same samples (checked). Reported: rows/s of each and their ratio, the median
of `--repeats` back-to-back pairs (their order alternating), so load that drifts cancels.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from engine.trainer.packing import Sample
from engine.trainer.rollouts import samples_from_rollouts
from tests.integration.storage.data import VOCAB, rollout_table


def pylist_samples(table: pa.Table) -> list[Sample]:
    """The former read: Python lists per row, then numpy arrays per row."""
    columns = table.select(["token_ids", "loss_mask", "logprobs", "advantage", "temperature"])
    return [
        Sample(
            token_ids=np.asarray(values["token_ids"], dtype=np.int64),
            loss_mask=np.asarray(values["loss_mask"], dtype=np.bool_),
            logprobs=np.asarray(values["logprobs"], dtype=np.float32),
            advantage=float(values["advantage"]),
            temperature=float(values["temperature"]),
        )
        for values in columns.to_pylist()
    ]


def _seconds(read: Callable[[pa.Table], list[Sample]], table: pa.Table) -> float:
    started = time.perf_counter()
    read(table)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(prog="bench_rollout_read")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    table = rollout_table(args.rows, step=1, seq_len=args.seq_len)

    def current(rows: pa.Table) -> list[Sample]:
        return samples_from_rollouts(
            rows, step=1, vocab_size=VOCAB, seq_len=args.seq_len, allow_truncation=False
        )

    ratios, new_s, old_s = [], [], []
    for repeat in range(args.repeats):
        pair = [(current, new_s), (pylist_samples, old_s)]
        for read, times in pair if repeat % 2 == 0 else pair[::-1]:
            times.append(_seconds(read, table))
        ratios.append(old_s[-1] / new_s[-1])
    new, old = current(table), pylist_samples(table)
    for a, b in zip(new, old, strict=True):  # the same samples, value for value
        assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.loss_mask, b.loss_mask)
        assert np.array_equal(a.logprobs, b.logprobs) and a.advantage == b.advantage
    result = {
        "rows": args.rows,
        "tokens_per_row": args.seq_len,
        "rows_per_s": args.rows / statistics.median(new_s),
        "baseline_rows_per_s": args.rows / statistics.median(old_s),
        "speedup": statistics.median(ratios),
    }
    print(
        f"{args.rows} rows x {args.seq_len} tokens: {result['rows_per_s']:,.0f} rows/s from "
        f"Arrow buffers, {result['baseline_rows_per_s']:,.0f} rows/s through Python lists: "
        f"{result['speedup']:.1f}x (median of {args.repeats} pairs)"
    )
    return result


if __name__ == "__main__":
    main()
