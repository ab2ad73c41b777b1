"""Groups the filters drop whole, many in a row: a stop that says why, not a batch that never fills.

A filter that drops every group leaves each batch short forever. The `difficulty` filter on a
policy that scores alike on every sample of every prompt (RL from a base model that never earns
a reward, say) drew 7,888 rollouts of the debug config in 9.5 minutes without a line of output
or a step. `FilterWatch` counts the groups dropped whole since a group was last admitted. Once a
batch's worth were dropped in a row it logs that count, at most every `LINE_EVERY_S` seconds (a
run that only thins its batches says nothing), and it fails the run once `limit` groups in a row
were dropped, naming the filters, the environments and the rewards those groups had. A filter
that only thins the batches never gets near the limit: at the GPU recipe's 17 % of groups
without signal, 256 in a row has a chance of about 10^-197.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.orchestrator.samples import Group

logger = logging.getLogger(__name__)

#: Batches' worth of groups dropped in a row that fail the run, and the fewest groups that do.
BATCHES_IN_A_ROW = 16
MIN_GROUPS = 64
#: Longest time between two lines of the count while groups are dropped in a row.
LINE_EVERY_S = 30.0


class FilteredOutError(RuntimeError):
    """The filters dropped every group for many batches in a row: no step can fill."""


def groups_in_a_row_limit(groups_per_batch: float) -> int:
    """Groups dropped in a row that fail the run, for batches of `groups_per_batch` groups."""
    return max(MIN_GROUPS, math.ceil(BATCHES_IN_A_ROW * groups_per_batch))


@dataclass
class FilterWatch:
    """Groups dropped whole in a row by the filters named `filters`; fails past `limit`."""

    filters: Sequence[str]
    limit: int
    line_every_s: float = LINE_EVERY_S
    _in_row: int = 0
    _envs: Counter[str] = field(default_factory=Counter)
    _low: float = math.inf
    _high: float = -math.inf
    _said_at: float = field(default_factory=time.monotonic)

    def admitted(self) -> None:
        """A group went into a batch: the row is broken."""
        self._in_row = 0
        self._envs.clear()
        self._low, self._high = math.inf, -math.inf

    def dropped(self, group: Group) -> None:
        """The filters dropped all of `group`; raise `FilteredOutError` at the limit."""
        self._in_row += 1
        self._envs[group.env] += 1
        rewards = [sample.reward for sample in group.samples]
        mean = sum(rewards) / len(rewards)
        self._low, self._high = min(self._low, mean), max(self._high, mean)
        if self._in_row >= self.limit:
            raise FilteredOutError(
                f"orchestrator.filters ({', '.join(self.filters)}) dropped the last "
                f"{self._in_row} groups whole ({self._where()}; their mean rewards "
                f"{self._rewards()}), so no step can fill. For the built-in filters the policy "
                "scores alike on every sample of its prompts: start RL from a checkpoint the "
                "task rewards in part (an SFT warm-up), or remove the filter"
            )
        if self._in_row >= self.limit // BATCHES_IN_A_ROW and (
            time.monotonic() - self._said_at >= self.line_every_s
        ):
            self._said_at = time.monotonic()
            logger.warning(
                "the filters dropped the last %d groups whole (%s; mean rewards %s); the run "
                "stops at %d in a row",
                self._in_row,
                self._where(),
                self._rewards(),
                self.limit,
            )

    def _where(self) -> str:
        return ", ".join(f"{env}: {count}" for env, count in self._envs.most_common())

    def _rewards(self) -> str:
        if self._low == self._high:
            return f"all {self._low:.3f}"
        return f"{self._low:.3f} to {self._high:.3f}"
