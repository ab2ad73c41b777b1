"""The async bound: how far behind the trainer the policies behind a batch may be.

Policy version v is the weights after trainer step v (0: the starting weights); the trainer
makes version n from batch n. Batch n may use any policy version >= n - 1 - max_async_level:
with `max_async_level = 0` batch n is sampled from version n - 1 exactly (synchronous,
on-policy); with 1, the orchestrator may sample batch n + 1 while the trainer works on batch n.
Every sample carries the oldest version behind any of its tokens; a sample is stale, and
dropped, when that version is below the batch's bound, or more than `max_off_policy_steps`
behind the version the pool serves when the batch is assembled.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TypeVar

from engine.orchestrator.samples import TrainSample

Item = TypeVar("Item", bound=TrainSample)
STALE_REASONS = ("stale/async_bound", "stale/off_policy")


def min_policy_version(step: int, max_async_level: int) -> int:
    """The oldest policy version batch `step` may use."""
    return max(0, step - 1 - max_async_level)


def may_sample_for(step: int, served_version: int, max_async_level: int) -> bool:
    """Whether what the pool serves now may go into batch `step` (else wait for the trainer)."""
    return served_version >= min_policy_version(step, max_async_level)


def stale_reason(
    version: int,
    *,
    step: int,
    served_version: int,
    max_async_level: int,
    max_off_policy_steps: int,
) -> str | None:
    """Why a sample of policy `version` may not go into batch `step`, or None."""
    if version < min_policy_version(step, max_async_level):
        return "stale/async_bound"
    if served_version - version > max_off_policy_steps:
        return "stale/off_policy"
    return None


def drop_stale(
    samples: Sequence[Item],
    *,
    step: int,
    served_version: int,
    max_async_level: int,
    max_off_policy_steps: int,
) -> tuple[list[Item], Counter[str]]:
    """The samples fresh enough for batch `step`, and the stale ones counted by reason."""
    fresh: list[Item] = []
    dropped: Counter[str] = Counter()
    for sample in samples:
        reason = stale_reason(
            sample.policy_version,
            step=step,
            served_version=served_version,
            max_async_level=max_async_level,
            max_off_policy_steps=max_off_policy_steps,
        )
        if reason is None:
            fresh.append(sample)
        else:
            dropped[reason] += 1
    return fresh, dropped
