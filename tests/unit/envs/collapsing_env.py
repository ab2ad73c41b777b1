"""A verifiers environment for tests whose reward collapses: its first four scored rollouts
earn 0, 1, 0, 1, every later one 0, as a policy that broke its output format after a few steps.

Loaded by id (`tests.unit.envs.collapsing_env`): the orchestrator's first batch has a learning
signal, every later one has none at a lower reward (`engine.orchestrator.signal_watch`).
"""

from __future__ import annotations

import itertools
from typing import Any

import verifiers as vf
from datasets import Dataset

#: Rollouts whose reward still differs, counted from the environment's load.
SIGNAL_ROLLOUTS = 4


def load_environment(num_examples: int = 16) -> vf.Environment:
    scored = itertools.count()

    def collapsing(completion: Any, **_: Any) -> float:
        index = next(scored)
        return float(index % 2) if index < SIGNAL_ROLLOUTS else 0.0

    rows = [{"question": f"Say {word}.", "answer": word} for word in ("yes", "no") * num_examples]
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows),
        rubric=vf.Rubric(funcs=[collapsing]),
    )
