"""`make bench` entry for the trainer's shard read (CPU: it needs no GPU)."""

from __future__ import annotations

from tests.bench.trainer import bench_rollout_read


def test_the_shard_read_runs_and_reports_its_speedup() -> None:
    result = bench_rollout_read.main(["--rows", "1024", "--repeats", "3"])
    assert result["rows_per_s"] > 0 and result["speedup"] > 0
