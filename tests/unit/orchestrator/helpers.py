"""Small builders for orchestrator unit tests."""

from __future__ import annotations

import itertools

from engine.config.orchestrator import DifficultyFilterConfig
from engine.envs import TokenSequence
from engine.orchestrator.batch import BatchBuilder
from engine.orchestrator.filters import build_filters
from engine.orchestrator.samples import Group, TrainSample

#: Each sample is a rollout of its own unless a test says otherwise.
_rollout_ids = itertools.count()


def sample(
    *,
    group_id: int = 0,
    reward: float = 0.0,
    advantage: float = 0.0,
    version: int = 0,
    completion: int = 2,
    rollout_id: int | None = None,
) -> TrainSample:
    sequence = TokenSequence(
        token_ids=[1, 2] + [3] * completion,
        loss_mask=[False, False] + [True] * completion,
        logprobs=[0.0, 0.0] + [-0.5] * completion,
        prompt_len=2,
        policy_version=version,
        num_turns=1,
        is_truncated=False,
        token_versions=[-1, -1] + [version] * completion,
    )
    return TrainSample(
        env="env",
        example_id=group_id,
        group_id=group_id,
        sequence=sequence,
        reward=reward,
        advantage=advantage,
        temperature=1.0,
        metrics={},
        rollout_tokens=completion,
        rollout_id=next(_rollout_ids) if rollout_id is None else rollout_id,
    )


def group(group_id: int, rewards: list[float], version: int = 0) -> Group:
    mean = sum(rewards) / len(rewards)
    samples = [
        sample(group_id=group_id, reward=r, advantage=r - mean, version=version) for r in rewards
    ]
    return Group(env="env", group_id=group_id, samples=samples, rollouts=len(rewards))


def difficulty_builder(
    step: int, batch_size: int, *, unit: str = "samples", max_off_policy_steps: int = 8
) -> BatchBuilder:
    """Batch `step` of `batch_size` with the `difficulty` filter, one step of asynchrony."""
    return BatchBuilder(
        step,
        batch_size=batch_size,
        unit=unit,  # type: ignore[arg-type]
        filters=build_filters([DifficultyFilterConfig()]),
        max_async_level=1,
        max_off_policy_steps=max_off_policy_steps,
    )
