"""A classic verifiers tool environment for tests: arithmetic with a calculator tool.

Loaded by id (`tests.unit.envs.calc_env`). The tiny model's chat template renders the tool's
schema into the system turn, so every prompt is a few hundred tokens long: with a short
`seq_len` none fits, the case that once made the orchestrator spin (issue 31).
"""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of integers, + - * and parentheses.

    Args:
        expression: The expression, e.g. "(2 + 3) * 4".
    """
    if not set(expression) <= set("0123456789+-*() "):
        return "error: only integers, + - * and parentheses"
    return str(eval(expression, {"__builtins__": {}}))


def answered(completion: Any, answer: str, **_: Any) -> float:
    return float(str(completion[-1].get("content", "")).strip() == answer)


def load_environment(num_examples: int = 8) -> vf.Environment:
    rows = [
        {"question": f"What is {i} * {i + 3} + {2 * i}?", "answer": str(i * (i + 3) + 2 * i)}
        for i in range(num_examples)
    ]
    return vf.ToolEnv(
        tools=[calculate],
        dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows),
        rubric=vf.Rubric(funcs=[answered]),
        max_turns=3,
    )
