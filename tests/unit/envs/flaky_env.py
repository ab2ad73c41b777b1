"""A classic verifiers environment for tests: echo the prompt; some tasks raise.

Loaded by id (`tests.unit.envs.flaky_env`) like any installed environment package. Tasks whose
example id is in `fail_on` raise from `setup_state`, as buggy environment code would.
"""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset


class FlakyEcho(vf.SingleTurnEnv):
    def __init__(self, fail_on: list[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_on = set(fail_on)

    async def setup_state(self, state: vf.State) -> vf.State:
        if state["example_id"] in self.fail_on:
            raise RuntimeError(f"environment bug on example {state['example_id']}")
        return state


def echoed(completion: Any, answer: str, **_: Any) -> float:
    return float(completion[-1]["content"] == answer)


def load_environment(num_examples: int = 4, fail_on: tuple[int, ...] = ()) -> vf.Environment:
    rows = [{"question": f"say {i}", "answer": f"say {i}"} for i in range(num_examples)]
    return FlakyEcho(
        fail_on=list(fail_on),
        dataset=Dataset.from_list(rows),
        rubric=vf.Rubric(funcs=[echoed]),
    )
