"""The async bound: how far behind the trainer the policies behind a batch may be.

Policy version v is the weights after trainer step v (0: the starting weights); the trainer
makes version n from batch n. Rollouts for batch n start only while the pool serves a version
>= n - 1 - max_async_level (`may_sample_for`): with `max_async_level = 0` batch n is sampled
from version n - 1 exactly (synchronous, on-policy); with 1, the orchestrator may sample batch
n + 1 while the trainer works on batch n. The orchestrator starts only as many rollouts as
the batches up to `newest_batch_for(served)` still lack, not `max_concurrent` whatever they
lack: a surplus would land in later batches, more versions behind than the bound allows (with
256 in flight for 128-sample batches, half of every batch came two or three versions late, and
learning per step fell well below the on-policy run's; docs/benchmarks.md).

A rollout that outlives the batch it started for lands in a later batch: a multi-turn or tool
rollout, during which the pool may load newer weights between turns (every token records the
version that sampled it), or a long reply that shorter ones started on the next version
overtake (on an H100, 17 of 150 steps held a group one version past the bound). With
`max_async_level >= 1` it is kept while its oldest token is at most `max_off_policy_steps`
versions behind the weights that train on it (version n - 1 for batch n): the trainer's
importance ratio, taken against the log-probs of the very weights that sampled each token,
accounts for the lag (the in-flight weight updates of PipelineRL, prime-rl's
`max_off_policy_steps`). Dropping it, as this module once did, threw away most of a slow
environment's rollouts and starved it. The lag is counted from the trainer's weights, not from
the pool's: that is the lag the update sees, and `max_off_policy_steps = max_async_level` then
holds every batch to the async bound exactly (the filters' top-ups, sized with a margin, put
their surplus into the next batch: two versions behind at `max_async_level = 1`, in 117 of 150
steps of a GPU reference run). With `max_async_level = 0` a batch holds version n - 1 only,
since on-policy is the point of it.

A group is the unit: its advantages are relative to each other, so it is kept or dropped whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.orchestrator.samples import TrainSample

STALE_REASONS = ("stale/async_bound", "stale/off_policy")


def min_policy_version(step: int, max_async_level: int) -> int:
    """The oldest policy version batch `step` may use."""
    return max(0, step - 1 - max_async_level)


def may_sample_for(step: int, served_version: int, max_async_level: int) -> bool:
    """Whether what the pool serves now may go into batch `step` (else wait for the trainer)."""
    return served_version >= min_policy_version(step, max_async_level)


def newest_batch_for(served_version: int, max_async_level: int) -> int:
    """The newest batch that rollouts started on `served_version` are sampled for: the
    orchestrator starts no more than the batches up to it lack, so that none lands beyond."""
    return served_version + 1 + max_async_level


def stale_reason(
    version: int, *, step: int, max_async_level: int, max_off_policy_steps: int
) -> str | None:
    """Why a group whose oldest token is of policy `version` may not go into batch `step`."""
    if max_async_level == 0 and version < min_policy_version(step, 0):
        return "stale/async_bound"
    if step - 1 - version > max_off_policy_steps:
        return "stale/off_policy"
    return None


def stale_group(
    samples: Sequence[TrainSample],
    *,
    step: int,
    max_async_level: int,
    max_off_policy_steps: int,
) -> str | None:
    """Why the group of `samples` may not go into batch `step` (its oldest token decides)."""
    if not samples:
        return None
    return stale_reason(
        min(sample.policy_version for sample in samples),
        step=step,
        max_async_level=max_async_level,
        max_off_policy_steps=max_off_policy_steps,
    )
