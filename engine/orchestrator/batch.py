"""One training step's batch: groups in, stale groups and filtered samples out, until full.

The builder is the single place where samples are admitted to a step, so the async bound and
the filters hold for every shard however rollouts were scheduled. Groups are never split: a
stale group is dropped whole (so no rollout is trained without its group, nor a row of a split
rollout without the others), and the batch closes at the first group that takes it to
`batch_size` samples (or tokens).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from engine.orchestrator.async_bound import STALE_REASONS, stale_group
from engine.orchestrator.filters import Filter, apply_filters
from engine.orchestrator.samples import SKIP_REASONS, Group, TrainSample


@dataclass
class StepBatch:
    """What a step trains on, and the counts of everything that was left out."""

    step: int
    samples: list[TrainSample] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    #: Rewards of every fresh sample by environment, before filters: what the policy earned.
    rewards: dict[str, list[float]] = field(default_factory=dict)
    #: Sampled tokens of every group that arrived, and of those dropped as stale, by env.
    sampled_tokens: Counter[str] = field(default_factory=Counter)
    stale_tokens: Counter[str] = field(default_factory=Counter)

    @property
    def num_tokens(self) -> int:
        return sum(sample.num_tokens for sample in self.samples)


@dataclass(frozen=True)
class BatchYield:
    """What a committed batch's samples held and its rollouts gave: sizes later launches."""

    tokens_per_sample: float
    samples_per_rollout: float

    @classmethod
    def of(cls, batch: StepBatch) -> BatchYield | None:
        """`batch`'s yield (None for a batch without samples or rollouts)."""
        rollouts = batch.counts["rollouts"]
        if not batch.samples or not rollouts:
            return None
        samples = len(batch.samples)
        return cls(batch.num_tokens / samples, samples / rollouts)


#: What became of a group offered to a batch: some of its samples went in, it was too far behind
#: the served policy, the filters dropped all of it, or it had no samples (every rollout skipped).
Admission = Literal["admitted", "stale", "filtered", "empty"]


class BatchBuilder:
    """Admits groups into batch `step` until it holds `batch_size` samples or tokens."""

    def __init__(
        self,
        step: int,
        *,
        batch_size: int,
        unit: Literal["samples", "tokens"],
        filters: Sequence[Filter],
        max_async_level: int,
        max_off_policy_steps: int,
    ) -> None:
        self.batch = StepBatch(step)
        zeros = [f"skipped/{reason}" for reason in SKIP_REASONS] + list(STALE_REASONS)
        for flt in filters:
            zeros += [f"filter/{flt.name}/dropped_samples", f"filter/{flt.name}/dropped_groups"]
        self.batch.counts.update(dict.fromkeys(zeros, 0))
        self._batch_size = batch_size
        self._unit = unit
        self._filters = filters
        self._max_async_level = max_async_level
        self._max_off_policy_steps = max_off_policy_steps

    @property
    def size(self) -> int:
        return len(self.batch.samples) if self._unit == "samples" else self.batch.num_tokens

    @property
    def full(self) -> bool:
        return self.size >= self._batch_size

    def rollouts_short(self, last: BatchYield | None, later_batches: int = 0) -> float:
        """About how many more rollouts fill the batch and `later_batches` more of its size,
        at what the last batch (`last`) got from each: a token budget is sized at this batch's
        mean sample, else at the last one's, else it cannot be told (infinity); filters and
        stale groups thin the yield, multi-turn splits raise it."""
        missing: float = self._batch_size * (1 + later_batches) - self.size
        if self._unit == "tokens":
            sizing = BatchYield.of(self.batch) or last
            if sizing is None:
                return math.inf
            missing /= sizing.tokens_per_sample
        return math.ceil(missing / (last.samples_per_rollout if last is not None else 1.0))

    def add(self, group: Group, served_version: int) -> Admission:
        """Admit the group if it is fresh, minus what the filters drop; count the rest under
        the step."""
        counts = self.batch.counts
        counts["groups"] += 1
        counts["rollouts"] += group.rollouts
        counts["splits"] += group.splits
        counts.update({f"skipped/{reason}": n for reason, n in group.skipped.items()})
        tokens = sum(sample.sequence.sampled_tokens for sample in group.samples)
        self.batch.sampled_tokens[group.env] += tokens
        stale = stale_group(
            group.samples,
            step=self.batch.step,
            served_version=served_version,
            max_async_level=self._max_async_level,
            max_off_policy_steps=self._max_off_policy_steps,
        )
        if stale is not None:
            counts[stale] += len(group.samples)
            self.batch.stale_tokens[group.env] += tokens
            return "stale"
        if not group.samples:
            return "empty"
        self.batch.rewards.setdefault(group.env, []).extend(s.reward for s in group.samples)
        kept, filtered = apply_filters([group.samples], self._filters)
        counts.update(filtered)
        for samples in kept:
            self.batch.samples.extend(samples)
        return "admitted" if kept else "filtered"
