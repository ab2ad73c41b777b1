"""What the trainer's ranks start with: `trainer.num_threads` as OMP_NUM_THREADS (nothing without
it), the GPUs as CUDA_VISIBLE_DEVICES, and OpenMP threads that sleep unless the caller says."""

from __future__ import annotations

import pytest

from engine.config import load_config
from engine.trainer.pool import rank_environment


@pytest.mark.parametrize(("flag", "expected"), [([], None), (["--trainer.num-threads", "1"], "1")])
def test_num_threads_sets_omp_num_threads(flag: list[str], expected: str | None) -> None:
    env = rank_environment(load_config(flag), {"PATH": "/usr/bin"})
    assert env.get("OMP_NUM_THREADS") == expected
    assert env["PATH"] == "/usr/bin"


def test_num_threads_overrides_the_callers() -> None:
    env = rank_environment(load_config(["--trainer.num-threads", "2"]), {"OMP_NUM_THREADS": "8"})
    assert env["OMP_NUM_THREADS"] == "2"


def test_gpu_ids_become_cuda_visible_devices() -> None:
    config = load_config(["--trainer.parallel.gpu-ids", "2", "3"])
    assert rank_environment(config, {})["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "CUDA_VISIBLE_DEVICES" not in rank_environment(load_config([]), {})


@pytest.mark.parametrize(
    ("parent", "expected"), [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE")]
)
def test_openmp_threads_sleep_unless_the_caller_says(parent: dict, expected: str) -> None:
    assert rank_environment(load_config([]), parent)["OMP_WAIT_POLICY"] == expected
