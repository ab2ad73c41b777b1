"""`make bench` entry: runs the trainer benchmark on a GPU machine and prints its table."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the trainer benchmark needs a GPU")
def test_trainer_benchmark_runs_and_prints_ratios() -> None:
    command = [sys.executable, "-m", "tests.bench.trainer.bench_trainer"]
    assert subprocess.run(command).returncode == 0
