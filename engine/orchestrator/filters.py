"""Filters: drop samples that would only add noise or cost to a training step.

A filter looks at one group's samples and says which to keep. `zero_advantage` drops samples
with no advantage (no gradient, only compute); `difficulty` drops whole groups whose rewards are
all equal (the task was too easy or too hard for the policy right now: online difficulty
filtering); a `custom` filter is `fn(samples, **kwargs) -> list[bool]`. A rollout split into
several rows (a chat template rewrote its history) is kept or dropped whole: dropping one of
its rows drops the others. Each filter counts the samples and groups it dropped, and those
counts are step metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.config.orchestrator import (
    DifficultyFilterConfig,
    FilterConfig,
    ZeroAdvantageFilterConfig,
)
from engine.orchestrator.samples import TrainSample

#: Advantages this close to zero are zero: a mean of equal floats can miss them by an ulp.
ZERO_TOLERANCE = 1e-9

KeepFn = Callable[[Sequence[TrainSample]], list[bool]]


def zero_advantage(samples: Sequence[TrainSample]) -> list[bool]:
    return [abs(sample.advantage) > ZERO_TOLERANCE for sample in samples]


def difficulty(samples: Sequence[TrainSample]) -> list[bool]:
    rewards = [sample.reward for sample in samples]
    varied = bool(rewards) and max(rewards) - min(rewards) > ZERO_TOLERANCE
    return [varied] * len(samples)


@dataclass(frozen=True)
class Filter:
    name: str
    keep: KeepFn


def build_filters(configs: Sequence[FilterConfig]) -> list[Filter]:
    """The configured filters, in order; `custom` ones are imported now."""
    filters = []
    for index, config in enumerate(configs):
        if isinstance(config, ZeroAdvantageFilterConfig):
            filters.append(Filter("zero_advantage", zero_advantage))
        elif isinstance(config, DifficultyFilterConfig):
            filters.append(Filter("difficulty", difficulty))
        else:
            name = config.import_path.rpartition(":")[2]
            filters.append(Filter(name, config.load(f"orchestrator.filters[{index}]")))
    return filters


def apply_filters(
    groups: Sequence[list[TrainSample]], filters: Sequence[Filter]
) -> tuple[list[list[TrainSample]], Counter[str]]:
    """The groups' kept samples (empty groups removed) and `filter/<name>/...` drop counts."""
    counts: Counter[str] = Counter()
    kept_groups = []
    for samples in groups:
        kept = list(samples)
        for flt in filters:
            if not kept:
                break
            mask = flt.keep(kept)
            if len(mask) != len(kept):
                raise ValueError(
                    f"filter {flt.name!r} returned {len(mask)} flags for {len(kept)} samples"
                )
            # A rollout's rows go together: one row dropped drops the rollout.
            dropped = {s.rollout_id for s, keep in zip(kept, mask, strict=True) if not keep}
            survivors = [sample for sample in kept if sample.rollout_id not in dropped]
            counts[f"filter/{flt.name}/dropped_samples"] += len(kept) - len(survivors)
            counts[f"filter/{flt.name}/dropped_groups"] += int(not survivors)
            kept = survivors
        if kept:
            kept_groups.append(kept)
    return kept_groups, counts
