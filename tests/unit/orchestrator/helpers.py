"""Small builders for orchestrator unit tests."""

from __future__ import annotations

from engine.envs import TokenSequence
from engine.orchestrator.samples import Group, TrainSample


def sample(
    *,
    group_id: int = 0,
    reward: float = 0.0,
    advantage: float = 0.0,
    version: int = 0,
    completion: int = 2,
) -> TrainSample:
    sequence = TokenSequence(
        token_ids=[1, 2] + [3] * completion,
        loss_mask=[False, False] + [True] * completion,
        logprobs=[0.0, 0.0] + [-0.5] * completion,
        prompt_len=2,
        policy_version=version,
        num_turns=1,
        is_truncated=False,
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
    )


def group(group_id: int, rewards: list[float], version: int = 0) -> Group:
    mean = sum(rewards) / len(rewards)
    samples = [
        sample(group_id=group_id, reward=r, advantage=r - mean, version=version) for r in rewards
    ]
    return Group(env="env", group_id=group_id, samples=samples, rollouts=len(rewards))
