"""Classic verifiers environments (`load_environment(**args) -> vf.Environment`).

Single-turn, multi-turn and tool environments all run through `vf.Environment.rollout` with a
`SamplerClient`, then the environment's rubric scores the group. Only the environment's own
rollout, stop conditions, environment responses and rubric are used; verifiers' evaluation
driver (progress bars, result files, hub uploads) is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import verifiers as vf

from engine.config.orchestrator import SamplingConfig
from engine.envs.base import Environment, Rollout, Split, Task
from engine.envs.chat import native_tool
from engine.envs.client import (
    SAMPLING_KEY,
    TURNS_KEY,
    SamplerClient,
    to_chat_message,
)
from engine.envs.reward_errors import reward_errors
from engine.envs.turns import SamplerFailedError, TurnGenerator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def no_signal_handlers() -> Iterator[None]:
    """Keep `vf.Environment.__init__` from installing SIGINT/SIGTERM handlers.

    verifiers installs process-wide handlers that call `exit(143)` on SIGTERM. Inside a
    primeflow process that would take shutdown away from its supervisor, and outside the main
    thread (a Prefect task runner) `signal.signal` raises. The handlers are registered through
    the module's `signal` name, so that name is swapped for a shim while environments load.
    """
    from verifiers.legacy.envs import environment

    real = environment.signal
    environment.signal = SimpleNamespace(
        signal=lambda *_: None,
        SIGINT=real.SIGINT,
        SIGTERM=real.SIGTERM,
        default_int_handler=real.default_int_handler,
    )
    try:
        yield
    finally:
        environment.signal = real


class _DatasetTasks(Sequence[Task]):
    """A verifiers dataset (Hugging Face `Dataset`) read row by row as `Task`s."""

    def __init__(self, env: str, dataset: Any) -> None:
        self._env = env
        self._dataset = dataset

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> Task:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        row = self._dataset[index]
        return Task(
            env=self._env,
            example_id=int(row["example_id"]),
            prompt=[to_chat_message(message) for message in row["prompt"]],
            payload=row,
        )


def _error_chain(error: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class ClassicEnvironment(Environment):
    """A `vf.Environment` behind primeflow's `Environment` interface."""

    def __init__(self, env: vf.Environment, name: str) -> None:
        super().__init__(name=name, pass_threshold=float(getattr(env, "pass_threshold", 0.5)))
        self.env = env

    def tasks(self, split: Split) -> Sequence[Task]:
        dataset = self.env.get_dataset() if split == "train" else self.env.get_eval_dataset()
        return _DatasetTasks(self.name, dataset)

    def prompt_tools(self, task: Task) -> list[dict[str, Any]] | None:
        tools = getattr(self.env, "tool_defs", None)
        return [native_tool(tool) for tool in tools] if tools else None

    async def run_group(
        self, task: Task, n: int, generator: TurnGenerator, sampling: SamplingConfig
    ) -> list[Rollout]:
        client = SamplerClient(generator)
        sampling_args = {SAMPLING_KEY: sampling}
        outcomes = await asyncio.gather(
            *(
                self.env.rollout(copy.deepcopy(task.payload), client, self.name, sampling_args)
                for _ in range(n)
            ),
            return_exceptions=True,
        )
        rollouts: list[Rollout] = []
        scorable: list[tuple[Rollout, vf.State]] = []
        for outcome in outcomes:
            rollout = Rollout(env=self.name, example_id=task.example_id, turns=[])
            rollouts.append(rollout)
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):
                    raise outcome
                rollout.error = _describe(outcome)
                continue
            rollout.turns = list(outcome.get(TURNS_KEY, []))
            rollout.context_exhausted = bool(outcome.get("prompt_too_long", False))
            error = outcome.get("error")
            for cause in _error_chain(error):
                if isinstance(cause, SamplerFailedError):
                    raise cause
            if error is not None:
                rollout.error = _describe(error)
            elif rollout.turns:
                scorable.append((rollout, outcome))
        await self._score([state for _, state in scorable], [r for r, _ in scorable])
        return rollouts

    async def _score(self, states: list[vf.State], rollouts: list[Rollout]) -> None:
        if not states:
            return
        rubric = self.env.rubric
        with reward_errors(rubric) as swallowed:
            try:
                if self.env.score_rollouts:
                    await rubric.score_group(states)
                else:
                    await rubric.dummy_score_group(states)
            except Exception as exc:  # the rubric is environment code: a failure skips the group
                swallowed.insert(0, _describe(exc))
        if swallowed:  # verifiers scores a raising reward function 0.0: a false signal, skip it
            logger.warning("env %s: scoring failed: %s", self.name, swallowed[0])
            for rollout in rollouts:
                rollout.error = f"scoring failed: {swallowed[0]}"
            return
        for rollout, state in zip(rollouts, states, strict=True):
            rollout.reward = float(state["reward"])
            rollout.metrics = {key: float(value) for key, value in (state["metrics"] or {}).items()}
            try:
                await rubric.cleanup(state)
            except Exception as exc:
                logger.warning("env %s: rubric cleanup failed: %s", self.name, _describe(exc))
