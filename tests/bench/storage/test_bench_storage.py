"""`make bench` entry: runs the storage benchmark (file:// and a moto S3 server) and prints it."""

from __future__ import annotations

from tests.bench.storage.bench_storage import main


def test_storage_benchmark_measures_every_case() -> None:
    cases = main([])
    measured = {(case.backend, case.name) for case in cases}
    expected = {
        (backend, name)
        for backend in ("file", "s3")
        for name in ("shard write", "shard read", "checkpoint write", "checkpoint fetch")
    }
    assert measured == expected
    assert all(case.layer_mb_s > 0 and case.raw_mb_s > 0 for case in cases)
