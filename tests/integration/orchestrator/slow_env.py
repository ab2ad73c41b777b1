"""A slow multi-turn environment for the mixing tests: alphabet-sort whose every environment
turn takes `delay_s` (a tool call, a sandbox, a simulator), so each rollout spans several
trainer steps. Loaded by id (`tests.integration.orchestrator.slow_env`) like any package."""

from __future__ import annotations

import asyncio
from typing import Any

import verifiers as vf

from engine.envs import alphabet_sort


class SlowAlphabetSortEnv(alphabet_sort.AlphabetSortEnv):
    def __init__(self, delay_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delay_s = delay_s

    async def env_response(
        self, messages: vf.Messages, state: vf.State, **kwargs: Any
    ) -> vf.Messages:
        await asyncio.sleep(self.delay_s)
        return await super().env_response(messages, state, **kwargs)


def load_environment(delay_s: float = 1.0, num_turns: int = 3) -> vf.Environment:
    fast = alphabet_sort.load_environment(num_train_examples=64, num_turns=num_turns)
    return SlowAlphabetSortEnv(
        delay_s,
        dataset=fast.get_dataset(),
        eval_dataset=fast.get_eval_dataset(),
        rubric=fast.rubric,
        max_turns=num_turns,
    )
