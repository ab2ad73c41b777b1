"""The environment interface the orchestrator and evaluation see.

Every environment — built-in, a classic verifiers package, a verifiers v1 taskset — is wrapped
in an `Environment`: tasks by split, and `run_group` that plays one task `n` times against the
inference pool and scores the results. Nothing outside `engine.envs` touches verifiers types.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.config.orchestrator import SamplingConfig
from engine.envs.turns import Turn, TurnGenerator

Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Task:
    """One example of an environment: what a group of rollouts starts from."""

    env: str
    example_id: int
    #: The prompt as chat messages (plain dicts), for inspection and reports.
    prompt: list[dict[str, Any]]
    #: The environment's own row; only its `Environment` reads it.
    payload: Any = field(repr=False, compare=False)


@dataclass
class Rollout:
    """One played episode: the model turns with their exact tokens, and its score."""

    env: str
    example_id: int
    turns: list[Turn]
    reward: float = math.nan
    metrics: dict[str, float] = field(default_factory=dict)
    #: Why the episode failed (an environment exception or a scoring failure); None when fine.
    error: str | None = None
    #: The conversation outgrew the context (on the first turn: nothing was sampled at all).
    context_exhausted: bool = False

    @property
    def is_truncated(self) -> bool:
        """Cut short by `max_tokens` or by the context, rather than finished by the model."""
        return self.context_exhausted or bool(self.turns and self.turns[-1].is_truncated)


class Environment(ABC):
    """Tasks by split, and groups of scored rollouts for one task."""

    def __init__(self, name: str, pass_threshold: float) -> None:
        self.name = name
        #: Reward at or above which a rollout counts as solved (pass@k).
        self.pass_threshold = pass_threshold

    @abstractmethod
    def tasks(self, split: Split) -> Sequence[Task]:
        """The split's tasks in a fixed order (the same on every call and every machine)."""

    def prompt_tools(self, task: Task) -> list[dict[str, Any]] | None:
        """The tool schemas the chat template renders into `task`'s first prompt (None: no
        tools): what, beside the messages, takes room in the context."""
        return None

    @abstractmethod
    async def run_group(
        self, task: Task, n: int, generator: TurnGenerator, sampling: SamplingConfig
    ) -> list[Rollout]:
        """Play `task` `n` times and score the rollouts together (group rewards see all `n`).

        A rollout whose environment code raised comes back with `error` set; the others are
        still scored. Failures of the inference pool itself propagate.
        """
