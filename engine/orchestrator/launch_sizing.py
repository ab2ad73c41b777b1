"""How many groups to start for the batches still open, and with what margin for the groups
a filter drops.

A batch is full at `batch_size` samples (or tokens), and a group gives it what the filters
and the async bound let through: all its samples, none (dropped as too easy or too hard,
stale) or more (a multi-turn rollout split into rows). Launches are sized at the mean of what
each group gave the last `YIELD_WINDOW` batches: N groups are started where N·mean reaches what
is missing. Without filters (and single-turn) every group gives the same and N is exact.

With a filter, a batch sized at the mean falls short about half the time, and each shortfall
costs a whole rollout's latency: the missing group starts only once a dropped one has come
back. On one H100, with the `difficulty` filter dropping 1-3 of ~18 groups a batch, the batches
that lost 2 or more took 0.8-0.9 s against 0.54 s for those that lost none. A margin of
`margin_sd` standard deviations of that yield (`orchestrator.launch_margin_sd`: N·mean −
margin_sd·sd·√N reaches what is missing) makes that rare, but its surplus goes into the next
batch, two versions behind the trainer instead of one. In the loop's discrete-event model
(`tests/unit/orchestrator/test_async_bound.py`), with 10-30 % of groups dropped, 60 batches took
1.07-1.15x the time of none dropped, and 1.02-1.03x with 2 SD of margin, which raised the share
of samples two versions behind from 8-13 % to 22-36 %. On the GPU two of the three runs with
that margin fell hard once, where none of four without it did (docs/benchmarks.md): the
margin is off by default. The surplus is not dropped instead: the late groups are the long
rollouts, and training only the quick ones would bias the policy to short replies.
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


def groups_for(missing: float, yields: Sequence[float], margin_sd: float) -> float:
    """Groups that give `missing` (samples or tokens) with `margin_sd` deviations of margin,
    each giving what one of `yields` gave; infinity when none gave anything (e.g. every group
    dropped so far: start as many as may be in flight)."""
    if missing <= 0:
        return 0
    mean = statistics.fmean(yields)
    if mean <= 0:
        return math.inf
    margin = margin_sd * statistics.pstdev(yields, mean)
    # N·mean − margin·√N = missing, a quadratic in √N.
    root = (margin + math.sqrt(margin * margin + 4 * mean * missing)) / (2 * mean)
    return math.ceil(root * root - 1e-9)


class LaunchSizer:
    """What recent batches' groups gave, and from it the groups the open batches want."""

    def __init__(
        self, *, group_size: int, unit: Literal["samples", "tokens"], margin_sd: float
    ) -> None:
        self._group_size = group_size
        self._unit = unit
        self._margin_sd = margin_sd
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
        return groups_for(builder.short_of(later_batches), yields, self._margin_sd)
