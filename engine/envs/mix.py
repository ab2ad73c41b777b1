"""Which task comes next: a seeded order per environment, environments mixed by ratio.

Both are deterministic for a seed, so a resumed or repeated run draws the same tasks in the
same order.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from engine.config.orchestrator import SamplingConfig
from engine.envs.base import Environment, Task


def pick_by_ratio(counts: Sequence[int], ratios: Sequence[float]) -> int:
    """Index of the entry furthest below its share after one more draw.

    Deterministic and exact over time: after `t` draws every entry has been picked
    `t * ratio / sum(ratios)` times give or take one (never two), ties going to the lower index.
    """
    total = sum(counts) + 1
    weight = sum(ratios)
    deficits = [total * ratio / weight - count for count, ratio in zip(counts, ratios, strict=True)]
    return max(range(len(deficits)), key=lambda index: (deficits[index], -index))


class TaskStream:
    """An endless walk over tasks: a fresh seeded permutation every epoch."""

    def __init__(self, tasks: Sequence[Task], seed: int) -> None:
        if not tasks:
            raise ValueError("an environment split with no tasks cannot be sampled")
        self._tasks = tasks
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self.epoch = -1

    def next(self) -> Task:
        if not self._order:
            self._order = list(range(len(self._tasks)))
            self._rng.shuffle(self._order)
            self._order.reverse()  # pop() from the end walks the permutation in order
            self.epoch += 1
        return self._tasks[self._order.pop()]


@dataclass(frozen=True)
class MixEntry:
    """One environment of a mix, with its share and its sampling settings."""

    env: Environment
    ratio: float
    sampling: SamplingConfig


class EnvMix:
    """Draws (environment, task) pairs, environments in proportion to their ratio.

    By default the proportion is of draws. A caller that knows better passes `landed`: per
    environment, the groups that trained or are on their way. A group dropped (stale,
    filtered out, failed) then no longer counts, so its environment is drawn again: the mix
    holds in what trains, not merely in what was tried. Each environment's task order is its
    own seeded stream, so `counts` (draws per environment) is all a resume needs.
    """

    def __init__(self, entries: Sequence[MixEntry], seed: int) -> None:
        if not entries:
            raise ValueError("a mix needs at least one environment")
        self.entries = list(entries)
        self._streams = [
            TaskStream(entry.env.tasks("train"), seed=seed + index)
            for index, entry in enumerate(self.entries)
        ]
        self.counts = [0] * len(self.entries)

    @property
    def ratios(self) -> list[float]:
        return [entry.ratio for entry in self.entries]

    def next(self, landed: Sequence[int] | None = None) -> tuple[int, MixEntry, Task]:
        """The next draw: (environment index, its entry, its task)."""
        index = pick_by_ratio(self.counts if landed is None else landed, self.ratios)
        self.counts[index] += 1
        return index, self.entries[index], self._streams[index].next()

    def skip(self, counts: Sequence[int]) -> None:
        """Advance every environment's stream by its `counts` draws (a resume)."""
        if len(counts) != len(self.entries):
            raise ValueError(f"{len(counts)} draw counts for {len(self.entries)} environments")
        for index, count in enumerate(counts):
            for _ in range(count):
                self._streams[index].next()
            self.counts[index] += count
