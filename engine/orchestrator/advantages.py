"""Advantages: how much better each rollout did than the others on the same task.

Group-relative (GRPO-style) advantages need no value model: the group's mean reward is the
baseline, so a group of one, or a group whose rewards are all equal, gets zero advantage and
teaches nothing. Length shaping subtracts a cost per completion token before the baseline, so
among equally rewarded answers the shorter ones win. A `custom` function replaces the whole
computation: `fn(rewards, lengths, **kwargs) -> advantages`, one float per rollout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from engine.config.orchestrator import AdvantageConfig, GroupRelativeAdvantageConfig

#: Added to the group std before dividing, so a near-constant group cannot blow up.
STD_EPS = 1e-6

AdvantageFn = Callable[[Sequence[float], Sequence[int]], list[float]]


def group_relative(
    rewards: Sequence[float],
    lengths: Sequence[int],
    *,
    std_normalize: bool = False,
    length_penalty: float = 0.0,
    max_tokens: int = 1,
) -> list[float]:
    """Shaped reward minus the group mean; divided by the group std when asked.

    The shaped reward is `reward - length_penalty * length / max_tokens`.
    """
    if len(rewards) != len(lengths):
        raise ValueError(f"{len(rewards)} rewards but {len(lengths)} lengths")
    if not rewards:
        return []
    shaped = [r - length_penalty * n / max_tokens for r, n in zip(rewards, lengths, strict=True)]
    mean = math.fsum(shaped) / len(shaped)
    advantages = [value - mean for value in shaped]
    if std_normalize:
        std = math.sqrt(math.fsum(a * a for a in advantages) / len(advantages))
        advantages = [a / (std + STD_EPS) for a in advantages]
    return advantages


def build_advantage_fn(config: AdvantageConfig, max_tokens: int) -> AdvantageFn:
    """The configured advantage function over one group's rewards and completion lengths."""
    if isinstance(config, GroupRelativeAdvantageConfig):

        def builtin(rewards: Sequence[float], lengths: Sequence[int]) -> list[float]:
            return group_relative(
                rewards,
                lengths,
                std_normalize=config.std_normalize,
                length_penalty=config.length_penalty,
                max_tokens=max_tokens,
            )

        return builtin
    custom = config.load("orchestrator.advantage")

    def checked(rewards: Sequence[float], lengths: Sequence[int]) -> list[float]:
        values = [float(v) for v in custom(list(rewards), list(lengths))]
        if len(values) != len(rewards) or not all(math.isfinite(v) for v in values):
            raise ValueError(
                f"custom advantage {config.import_path!r} must return one finite float per "
                f"rollout ({len(rewards)}), got {values!r:.200}"
            )
        return values

    return checked
