"""How many groups to start for the batches still open: enough that a filter's drops rarely
leave a batch short.

A batch is full at `batch_size` samples (or tokens), and a group gives it what the filters
and the async bound let through: all its samples, none (dropped as too easy or too hard,
stale) or more (a multi-turn rollout split into rows). Sized at the mean alone, a batch falls
short about half the time, and each shortfall costs a whole rollout's latency: the missing
group starts only once a dropped one has come back. On one H100, with the `difficulty` filter
dropping 1-3 of ~18 groups a batch, the batches that lost 2 or more took 0.8-0.9 s against
0.54 s for those that lost none, and the filter made the 150 RL steps 1.33× as long
(docs/benchmarks.md, "The paired reference on three servers").

So launches are sized at the mean and the spread of what each group gave the last
`YIELD_WINDOW` batches, with `MARGIN_SD` standard deviations of margin: N groups are started
where N·mean − MARGIN_SD·sd·√N reaches what is missing. Without filters (and single-turn)
every group gives the same, the spread is zero and N is what it always was: no surplus lands
further behind the async bound. A surplus group goes into the next batch, one version later.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Literal

from engine.orchestrator.batch import BatchBuilder, StepBatch

#: Closed batches whose groups size the launches: enough to smooth one batch's luck (~150
#: groups on the GPU recipe), few enough to follow a drop rate that climbs as the policy
#: learns (6 % to 40 % of groups over 150 steps of the GPU reference run).
YIELD_WINDOW = 8
#: Standard deviations of margin: a batch falls short about 2 % of the time.
MARGIN_SD = 2.0


def groups_for(missing: float, yields: Sequence[float]) -> float:
    """Groups that give `missing` (samples or tokens) with `MARGIN_SD` deviations of margin,
    each giving what one of `yields` gave; infinity when none gave anything (e.g. every group
    dropped so far: start as many as may be in flight)."""
    if missing <= 0:
        return 0
    mean = statistics.fmean(yields)
    if mean <= 0:
        return math.inf
    margin = MARGIN_SD * statistics.pstdev(yields, mean)
    # N·mean − margin·√N = missing, a quadratic in √N.
    root = (margin + math.sqrt(margin * margin + 4 * mean * missing)) / (2 * mean)
    return math.ceil(root * root - 1e-9)


class LaunchSizer:
    """What recent batches' groups gave, and from it the groups the open batches want."""

    def __init__(self, *, group_size: int, unit: Literal["samples", "tokens"]) -> None:
        self._group_size = group_size
        self._unit = unit
        self._recent: deque[list[float]] = deque(maxlen=YIELD_WINDOW)

    def closed(self, batch: StepBatch) -> None:
        self._recent.append(batch.group_yields)

    def groups_wanted(self, builder: BatchBuilder, later_batches: int = 0) -> float:
        """Groups to have in flight for `builder`'s batch and `later_batches` more of its
        size. A group of a sample batch counts once more as giving all its rollouts (before any
        landed that is the size, and a few groups dropped first do not make every later launch
        as many as may be in flight); a token batch with no group landed yet cannot be sized
        (infinity: as many as may be in flight)."""
        yields = [y for batch in self._recent for y in batch] + builder.batch.group_yields
        if self._unit == "samples":
            yields.append(float(self._group_size))  # a prior: the first groups dropped whole
        elif not yields:  # do not make every later launch as many as may be in flight
            return math.inf
        return groups_for(builder.short_of(later_batches), yields)
