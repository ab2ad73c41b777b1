"""Identical concurrent turns become one request for n samples; each caller gets its own share."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine.config.orchestrator import EnvConfig, SamplingConfig
from engine.envs.coalescing import CoalescingSampler
from engine.envs.loader import load_environment

SAMPLING = SamplingConfig(temperature=1.0, max_tokens=8)


@dataclass(frozen=True)
class Labelled:
    """A sample that says which request and which of its n it was."""

    request: int
    index: int
    completion_ids: tuple[int, ...] = (1,)
    logprobs: tuple[float, ...] = (-0.5,)
    text: str = "x"
    finish_reason: str = "stop"
    policy_version: int = 0
    policy_lineage: str = ""


@dataclass
class Server:
    """Answers each request with n labelled samples after a pause, or fails when told to."""

    fail: bool = False
    pause_s: float = 0.01
    requests: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    cancelled: int = 0

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, *, n: int = 1
    ) -> list[Labelled]:
        number = len(self.requests)
        self.requests.append((tuple(prompt_ids), n))
        try:
            await asyncio.sleep(self.pause_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail:
            raise ConnectionError("server gone")
        return [Labelled(number, i) for i in range(n)]


def test_a_groups_calls_in_one_turn_become_one_request_and_each_gets_its_own_samples() -> None:
    server = Server()
    sampler = CoalescingSampler(server)

    async def group() -> list[Sequence[Any]]:
        return await asyncio.gather(
            *(sampler.generate([5, 6, 7], SAMPLING, n=n) for n in (1, 2, 1, 1))
        )

    shares = asyncio.run(group())
    assert server.requests == [((5, 6, 7), 5)]
    assert [[(s.request, s.index) for s in share] for share in shares] == [
        [(0, 0)],
        [(0, 1), (0, 2)],
        [(0, 3)],
        [(0, 4)],
    ]


def test_other_prompts_other_sampling_and_later_turns_go_alone() -> None:
    server = Server()
    sampler = CoalescingSampler(server)
    greedy = SAMPLING.model_copy(update={"temperature": 0.0})

    async def calls() -> None:
        await asyncio.gather(
            sampler.generate([1], SAMPLING),
            sampler.generate([2], SAMPLING),
            sampler.generate([1], greedy),
        )
        await sampler.generate([1], SAMPLING)  # a later turn, after the merged ones answered

    asyncio.run(calls())
    assert sorted(server.requests) == [((1,), 1), ((1,), 1), ((1,), 1), ((2,), 1)]


def test_a_failed_request_fails_every_caller_that_shared_it() -> None:
    sampler = CoalescingSampler(Server(fail=True))

    async def group() -> list[Any]:
        calls = (sampler.generate([3], SAMPLING) for _ in range(3))
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(group())
    assert [type(o) for o in outcomes] == [ConnectionError] * 3


def test_a_cancelled_caller_leaves_the_others_served_and_the_last_one_cancels_the_request() -> None:
    server = Server(pause_s=0.2)
    sampler = CoalescingSampler(server)

    async def scenario() -> tuple[Sequence[Any], bool]:
        first = asyncio.ensure_future(sampler.generate([4], SAMPLING))
        second = asyncio.ensure_future(sampler.generate([4], SAMPLING))
        await asyncio.sleep(0.05)
        first.cancel()
        kept = await second  # still answered, after its partner gave up
        alone = [asyncio.ensure_future(sampler.generate([9], SAMPLING)) for _ in range(2)]
        await asyncio.sleep(0.05)
        for call in alone:
            call.cancel()
        await asyncio.gather(*alone, return_exceptions=True)
        await asyncio.sleep(0)
        return kept, first.cancelled()

    kept, first_cancelled = asyncio.run(scenario())
    assert first_cancelled and [(s.request, s.index) for s in kept] == [(0, 1)]
    assert server.requests == [((4,), 2), ((9,), 2)]
    assert server.cancelled == 1  # only the request nobody waited for any more


@pytest.mark.parametrize("env_id", ["reverse-text", "alphabet-sort"])
def test_a_group_of_rollouts_asks_the_server_once_for_its_first_turn(
    env_id: str, policy, generator
) -> None:
    """Through the real environments (single- and multi-turn): the group's first turns share
    one request; alphabet-sort's later turns, which differ per rollout, go alone."""
    scripted = policy(lambda prompt: "<sorted_names>Ann</sorted_names>")
    env = load_environment(EnvConfig(id=env_id, args={"num_train_examples": 4}))
    task = env.tasks("train")[0]
    rollouts = asyncio.run(env.run_group(task, 8, generator(scripted), SAMPLING))
    assert len(rollouts) == 8 and all(r.turns for r in rollouts)
    first_prompt = rollouts[0].turns[0].prompt_ids
    firsts = [req for req in scripted.requests if tuple(req[0]) == tuple(first_prompt)]
    assert len(firsts) == 1
    assert all(r.turns[0].prompt_ids == first_prompt for r in rollouts)
