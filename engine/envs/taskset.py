"""verifiers v1 tasksets: tasks from a `vf.Taskset`, one chat turn each, scored by the task.

verifiers v1 plays tasks through harnesses (agent programs in sandboxes, reached through an
interception proxy). primeflow needs the exact sampled tokens and must run offline, so it plays
the single-turn chat case itself: the task's system prompt and prompt are rendered, one turn is
sampled, and the task's own `@vf.reward`/`@vf.metric` functions score a `Trace` of that turn
without a runtime. Tasksets that need a container, a custom `Env` (multi-agent, tools served by
the harness) or an infinite task stream are refused when they load, with the reason.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import verifiers.v1 as vf1
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers.v1.types import content_text
from verifiers.v1.utils.generic import concrete_type

from engine.config.orchestrator import SamplingConfig
from engine.envs.base import Environment, Rollout, Split, Task
from engine.envs.turns import PromptTooLongError, SamplerFailedError, TurnGenerator

#: v1 counts a task as solved at this reward unless a taskset says otherwise.
DEFAULT_PASS_THRESHOLD = 0.5


def exported(module: ModuleType, base: type) -> list[type]:
    """The subclasses of `base` a plugin module exports through `__all__`."""
    names = getattr(module, "__all__", None) or []
    return [
        obj
        for name in names
        if isinstance(obj := getattr(module, name, None), type)
        and issubclass(obj, base)
        and obj is not base
    ]


def prompt_messages(data: vf1.TaskData) -> list[dict[str, Any]]:
    """The task's opening messages as plain chat dicts (its system prompt first)."""
    if data.prompt is None:
        raise ValueError("task has no prompt (the user opens the conversation)")
    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages.extend(
            {"role": message.role, "content": content_text(message.content)}
            for message in data.prompt
        )
    return messages


def _message(chat: dict[str, Any]) -> Any:
    kinds = {"system": vf1.SystemMessage, "user": vf1.UserMessage}
    if chat["role"] not in kinds:
        raise ValueError(f"a v1 task prompt may hold system and user messages, not {chat['role']}")
    return kinds[chat["role"]](content=chat["content"])


def single_turn_trace(task: vf1.Task, messages: list[dict[str, Any]], reply: str) -> Trace:
    """A `Trace` of one sampled reply to `messages`, enough for the task's scoring hooks."""
    trace = Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        # A record of who played, as v1 wants one; the runtime is never started.
        agent=AgentInfo(config=vf1.AgentConfig(runtime=vf1.SubprocessConfig())),
    )
    parent = None
    for index, chat in enumerate(messages):
        trace.nodes.append(MessageNode(parent=parent, message=_message(chat)))
        parent = index
    trace.nodes.append(
        MessageNode(parent=parent, message=vf1.AssistantMessage(content=reply), sampled=True)
    )
    trace.stop("completed")
    trace.ok = True
    return trace


class TasksetEnvironment(Environment):
    """A v1 `Taskset` behind primeflow's `Environment` interface (single-turn chat tasks)."""

    def __init__(self, taskset: vf1.Taskset, name: str) -> None:
        super().__init__(name=name, pass_threshold=DEFAULT_PASS_THRESHOLD)
        if taskset.INFINITE:
            raise ValueError(f"taskset {name!r} is infinite; primeflow needs a finite taskset")
        task_type = type(taskset).task_type()
        if task_type.NEEDS_CONTAINER:
            raise ValueError(
                f"taskset {name!r} needs a container runtime; primeflow runs v1 tasks offline, "
                "without sandboxes"
            )
        self._tasks = [
            Task(env=name, example_id=index, prompt=prompt_messages(task.data), payload=task)
            for index, task in enumerate(taskset)
        ]

    @classmethod
    def load(
        cls, module: ModuleType, taskset_id: str, args: dict[str, Any], name: str
    ) -> TasksetEnvironment:
        """The taskset `module` exports, configured from `args` (its `TasksetConfig` fields)."""
        if exported(module, vf1.Env):
            raise ValueError(
                f"taskset {taskset_id!r} ships its own v1 Env (multi-agent or harness-driven); "
                "primeflow plays single-turn chat tasksets only"
            )
        (taskset_cls,) = exported(module, vf1.Taskset)
        config_cls = concrete_type(taskset_cls, vf1.TasksetConfig, origin=vf1.Taskset)
        config = (config_cls or vf1.TasksetConfig).model_validate({**args, "id": taskset_id})
        return cls(taskset_cls(config), name)

    def tasks(self, split: Split) -> Sequence[Task]:
        # v1 tasksets have no splits: a held-out set is a second entry whose args select it.
        return self._tasks

    async def run_group(
        self, task: Task, n: int, generator: TurnGenerator, sampling: SamplingConfig
    ) -> list[Rollout]:
        outcomes = await asyncio.gather(
            *(self._play(task, generator, sampling) for _ in range(n)), return_exceptions=True
        )
        rollouts = []
        for outcome in outcomes:
            if isinstance(outcome, Rollout):
                rollouts.append(outcome)
            elif isinstance(outcome, SamplerFailedError):
                raise outcome
            elif isinstance(outcome, PromptTooLongError):
                rollouts.append(self._empty(task, context_exhausted=True))
            elif isinstance(outcome, Exception):
                rollouts.append(self._empty(task, error=f"{type(outcome).__name__}: {outcome}"))
            else:
                raise outcome
        return rollouts

    def _empty(self, task: Task, **fields: Any) -> Rollout:
        return Rollout(env=self.name, example_id=task.example_id, turns=[], **fields)

    async def _play(
        self, task: Task, generator: TurnGenerator, sampling: SamplingConfig
    ) -> Rollout:
        turn = await generator.generate(task.prompt, sampling)
        rollout = Rollout(env=self.name, example_id=task.example_id, turns=[turn])
        v1_task: vf1.Task = task.payload
        trace = single_turn_trace(v1_task, task.prompt, turn.text)
        try:
            await v1_task.score(trace)
        except Exception as exc:  # task code: a failure skips this rollout
            rollout.error = f"scoring failed: {type(exc).__name__}: {exc}"
            return rollout
        metrics = {key: value for key, value in trace.metrics.items() if value is not None}
        for key, reward in trace.rewards.items():
            metrics[key] = reward.score if reward is not None else math.nan
        rollout.reward = trace.reward
        rollout.metrics = metrics
        return rollout
