"""One training step's batch: groups in, stale groups and filtered samples out, until full.

The builder is the single place where samples are admitted to a step, so the async bound and
the filters hold for every shard however rollouts were scheduled. Groups are never split: a
stale group is dropped whole (so no rollout is trained without its group, nor a row of a split
rollout without the others), and the batch closes at the first group that takes it to
`batch_size` samples (or tokens).
"""

from __future__ import annotations

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
    #: What each fresh group offered gave the batch, in its unit (0: filtered out, or every
    #: rollout skipped): what sizes later launches (`engine.orchestrator.launch_sizing`).
    group_yields: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(sample.num_tokens for sample in self.samples)


#: What became of a group offered to a batch: some of its samples went in, it was too far behind
#: the weights that train on it, the filters dropped all of it, or it had no samples (every
#: rollout skipped).
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

    def short_of(self, later_batches: int = 0) -> int:
        """What (samples or tokens) this batch and `later_batches` more of its size lack."""
        return self._batch_size * (1 + later_batches) - self.size

    def add(self, group: Group) -> Admission:
        """Admit the group if it is fresh, minus what the filters drop; count the rest under
        the step."""
        before = self.size
        admission = self._admit(group)
        if admission != "stale":  # a surplus started too early, not what a group gives
            self.batch.group_yields.append(float(self.size - before))
        return admission

    def _admit(self, group: Group) -> Admission:
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
