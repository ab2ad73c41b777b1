"""`make bench` entry: Prefect's overhead per RL step, printed as a ratio (see bench_prefect)."""

from __future__ import annotations

from tests.bench.prefect.bench_prefect import main


def test_prefect_overhead_benchmark_measures_both_variants() -> None:
    runs, summary = main([])
    assert [r.variant for r in runs].count("prefect") == [r.variant for r in runs].count("direct")
    assert all(r.loop_s > 0 and r.steps == 6 for r in runs)
    assert summary["loop_ratio"] > 0 and summary["fixed_s"] > 0
