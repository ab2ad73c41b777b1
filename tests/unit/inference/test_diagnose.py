"""A failed start is reported as one line naming its cause, from real vLLM log lines."""

from __future__ import annotations

import signal

import pytest

from engine.inference.diagnose import failure_cause

PORT_IN_USE = """\
(APIServer pid=13003) INFO 11-30 10:33:01 [entry.py:139] Starting vLLM server
(APIServer pid=13003) Traceback (most recent call last):
(APIServer pid=13003) OSError: [Errno 98] Address already in use
"""
MISSING_MODEL = """\
(APIServer pid=12816) huggingface_hub.errors.HFValidationError: Repo id must be in the form \
'repo_name' or 'namespace/repo_name': '/models/nope'. Use `repo_type` argument if needed.
(APIServer pid=12816) The above exception was the direct cause of the following exception:
(APIServer pid=12816) OSError: Repo id must be in the form 'repo_name' or 'namespace/repo_name': \
'/models/nope'. Use `repo_type` argument if needed.
"""
CPU_OOM = """\
ERROR 11-30 10:31:14 [multiproc_executor.py:944] WorkerProc failed to start.
ERROR 11-30 10:31:14 [multiproc_executor.py:944] ValueError: Available memory on node 0 \
(7.44/10.09 GiB) on startup is less than desired CPU memory utilization (0.92, 9.28 GiB).
(APIServer pid=7337) RuntimeError: Engine core initialization failed. See root cause above.
"""
GPU_OOM = "(EngineCore pid=1) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"


@pytest.mark.parametrize(
    ("log", "cause", "detail"),
    [
        (PORT_IN_USE, "port already in use", "Address already in use"),
        (MISSING_MODEL, "model not found", "/models/nope"),
        (CPU_OOM, "out of memory", "Available memory on node 0"),
        (GPU_OOM, "out of memory", "CUDA out of memory"),
    ],
)
def test_known_causes_are_named(log: str, cause: str, detail: str) -> None:
    line = failure_cause(log, returncode=1)
    assert line.startswith(f"{cause}: ")
    assert detail in line
    assert "\n" not in line
    assert "pid=" not in line  # vLLM's process prefix is stripped


def test_sigkill_without_a_logged_cause_points_at_the_oom_killer() -> None:
    line = failure_cause("INFO loading weights\n", returncode=-signal.SIGKILL)
    assert "SIGKILL" in line and "out-of-memory" in line


def test_otherwise_the_last_error_line() -> None:
    log = "INFO start\nValueError: first\nINFO more\nRuntimeError: the real one\nINFO bye\n"
    assert failure_cause(log, returncode=1) == "RuntimeError: the real one"


def test_no_log_at_all() -> None:
    assert failure_cause("", returncode=2) == "exited with status 2 and wrote no log"
