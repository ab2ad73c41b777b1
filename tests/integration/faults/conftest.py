"""Fault-injection tests: a real run on the tiny stack, a fault injected while it works, then the
run's invariants checked on what it left in storage and in the process table.

They share the session's vLLM server and Prefect server (`tests/integration/conftest.py`) and
reuse the orchestrator tests' fixtures: `pool` (put back on the base weights after each test),
`tiny_model` (the weights the server serves) and `make_config`. Helpers are in `helpers.py`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from engine.config import PrimeflowConfig
from engine.config.orchestrator import EnvConfig
from tests.integration.faults.helpers import leftover_processes
from tests.integration.orchestrator.conftest import (  # noqa: F401  (shared fixtures)
    make_config,
    pool,
    tiny_model,
)


@pytest.fixture
def rl_config(
    make_config: Callable[..., PrimeflowConfig],  # noqa: F811  (the fixture imported above)
) -> Callable[..., PrimeflowConfig]:
    """A short RL run (reverse-text, async level 1) whose every checkpoint is kept, so a test can
    check each step 1..N after the fault."""

    def make(max_steps: int = 4, **sections: Any) -> PrimeflowConfig:
        trainer = {
            "checkpoint": {"interval": 1, "keep_last": None},
            "num_threads": 1,  # two cores: the other one serves vLLM
            "rollout_timeout_s": 300.0,
            **sections.pop("trainer", {}),
        }
        orchestrator = {
            "envs": [EnvConfig(id="reverse-text", args={"num_train_examples": 64})],
            "max_async_level": 1,
            "policy_timeout_s": 300.0,
            # One group in flight: steps follow each other instead of finishing together, so a
            # fault thread that strikes after step 1 meets a run with steps still to make.
            "max_concurrent": 4,
            **sections.pop("orchestrator", {}),
        }
        return make_config(
            max_steps=max_steps, trainer=trainer, orchestrator=orchestrator, **sections
        )

    return make


@pytest.fixture
def leftovers() -> Callable[..., list[str]]:
    """`leftovers(*groups)`: processes this test started that are still alive, outside the
    process `groups` named. The session's servers (vLLM, Prefect, storage), started before the
    test, are not counted."""
    before = {os.getpgid(child.pid) for child in psutil.Process().children(recursive=True)}
    return lambda *groups: leftover_processes(before | set(groups))
