"""Plugins named by `import_path` in the orchestrator tests."""

from __future__ import annotations

from collections.abc import Sequence

from engine.orchestrator.samples import TrainSample


def rank_advantage(rewards: list[float], lengths: list[int], scale: float = 1.0) -> list[float]:
    """Centred ranks: the best rollout gets the most credit whatever the reward scale."""
    order = sorted(range(len(rewards)), key=lambda i: rewards[i])
    ranks = [0.0] * len(rewards)
    for rank, index in enumerate(order):
        ranks[index] = scale * (rank - (len(rewards) - 1) / 2)
    return ranks


def wrong_length(rewards: list[float], lengths: list[int]) -> list[float]:
    return [0.0]


def no_truncated(samples: Sequence[TrainSample], max_reward: float = 1.0) -> list[bool]:
    return [s.reward <= max_reward and not s.is_truncated for s in samples]


def keep_first(samples: Sequence[TrainSample]) -> list[bool]:
    return [True]
