"""`make bench` entry for the end-to-end RL benchmarks (tests/bench/e2e).

The async-level comparison always runs (it trains a short SFT checkpoint first unless
PRIMEFLOW_BENCH_SFT names one); the TRL comparison runs when PRIMEFLOW_BENCH_TRL_PYTHON names
the python of a virtual environment with TRL installed (never primeflow's own).
"""

from __future__ import annotations

import os

import pytest

from tests.bench.e2e import bench_async, bench_trl

SFT = os.environ.get("PRIMEFLOW_BENCH_SFT")
TRL_PYTHON = os.environ.get("PRIMEFLOW_BENCH_TRL_PYTHON")


@pytest.mark.timeout(3600)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to pin to")
def test_async_level_1_against_0(tmp_path) -> None:
    args = ["--steps", "8", "--workdir", str(tmp_path)]
    if SFT:
        args += ["--sft-checkpoint", SFT]
    else:
        args += ["--", "--sft.max-steps", "100"]
    result = bench_async.main(args)
    assert result["async1_over_async0_steps_per_s"] > 0
    assert all(v["steps"] == 8 for v in result["variants"])


@pytest.mark.timeout(3600)
@pytest.mark.skipif(not (SFT and TRL_PYTHON), reason="set PRIMEFLOW_BENCH_SFT and ..._TRL_PYTHON")
def test_time_to_reward_against_trl(tmp_path) -> None:
    assert SFT and TRL_PYTHON
    result = bench_trl.main(
        [
            "--sft-checkpoint",
            SFT,
            "--trl-python",
            TRL_PYTHON,
            "--target",
            "0.6",
            "--steps",
            "30",
            "--workdir",
            str(tmp_path),
        ]
    )
    assert result["trl"]["steps_per_s"] and result["primeflow"]["steps_per_s"]
