"""A classic verifiers environment whose reward function misbehaves, for the bad-input tests.

Loaded by id (`tests.unit.reliability.bad_reward_env`) like any installed environment package.
`reward="raise"` makes the reward function raise, as buggy environment code would;
`reward="nan"` makes it return NaN, as a division by an empty count would.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import verifiers as vf
from datasets import Dataset


def load_environment(reward: Literal["raise", "nan"] = "raise") -> vf.Environment:
    def broken(completion: Any, answer: str, **_: Any) -> float:
        if reward == "raise":
            raise ZeroDivisionError("reward of an empty answer")
        return math.nan

    rows = [{"question": f"say {i}", "answer": f"say {i}"} for i in range(2)]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[broken]))
