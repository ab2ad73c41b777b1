"""Rollouts that could not be trained on: a few lines that say why, and a stop when an
environment's draws are almost all skipped for one reason.

A skipped rollout is drawn again, so an environment whose every prompt is too long for
`seq_len` (or whose code always raises) would be drawn forever: the orchestrator spun for ten
minutes and 280,000 warning lines without committing a step. `SkipWatch` looks at each
environment's last `WINDOW` rollouts and fails the run, in one line naming the environment,
the reason, an example and what to change, once `FAILING_SHARE` of them were skipped for the
same reason; meanwhile it logs one line per environment and reason with a count, at most every
`LINE_EVERY_S` seconds and when a step is committed, instead of one per rollout.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from engine.orchestrator.samples import Group

logger = logging.getLogger(__name__)

#: Rollouts of one environment the verdict looks at.
WINDOW = 64
#: Share of them skipped for one reason that fails the run.
FAILING_SHARE = 0.9
#: Longest time between two lines of skip counts while skips go on.
LINE_EVERY_S = 30.0

#: What to change, by reason.
HINTS = {
    "prompt_too_long": "its prompts (with system prompt and tools) do not fit the context: raise "
    "seq_len, or shorten the prompts",
    "env_error": "its environment code raises",
    "empty_completion": "the model sampled nothing for it (max_tokens, stop strings?)",
    "nan_reward": "its reward is not a number",
}


class EnvironmentSkippedError(RuntimeError):
    """Almost every rollout of one environment was skipped for one reason: nothing trains."""


@dataclass
class SkipWatch:
    """Skips per environment: counted for the log, and judged over the last `window` rollouts."""

    window: int = WINDOW
    failing_share: float = FAILING_SHARE
    line_every_s: float = LINE_EVERY_S
    _recent: dict[str, deque[str | None]] = field(default_factory=dict)
    _unsaid: Counter[tuple[str, str]] = field(default_factory=Counter)
    _example: dict[tuple[str, str], str] = field(default_factory=dict)
    _said_at: float = field(default=-math.inf)

    def record(self, group: Group) -> None:
        """Count `group`'s skips; raise `EnvironmentSkippedError` if its environment is failing."""
        recent = self._recent.setdefault(group.env, deque(maxlen=self.window))
        skipped = sum(group.skipped.values())
        recent.extend([None] * max(0, group.rollouts - skipped))
        for reason, count in group.skipped.items():
            recent.extend([reason] * count)
            self._unsaid[group.env, reason] += count
            if reason in group.skip_examples:
                self._example.setdefault((group.env, reason), group.skip_examples[reason])
        if skipped:
            self._judge(group.env, recent)
            if time.monotonic() - self._said_at >= self.line_every_s:
                self.say()

    def _judge(self, env: str, recent: deque[str | None]) -> None:
        if len(recent) < self.window:
            return
        counts = Counter(reason for reason in recent if reason is not None)
        if not counts:
            return
        reason, count = counts.most_common(1)[0]
        if count < self.failing_share * len(recent):
            return
        example = self._example.get((env, reason))
        raise EnvironmentSkippedError(
            f"environment {env!r}: {count} of its last {len(recent)} rollouts were skipped "
            f"({reason}{': ' + example if example else ''}); {HINTS.get(reason, reason)}"
        )

    def say(self) -> None:
        """Log the skips counted since the last line: one line per environment and reason."""
        self._said_at = time.monotonic()
        for (env, reason), count in sorted(self._unsaid.items()):
            example = self._example.get((env, reason))
            logger.warning(
                "skipped %d rollout%s of %s (%s)%s",
                count,
                "" if count == 1 else "s",
                env,
                reason,
                f", e.g. {example}" if example else "",
            )
        self._unsaid.clear()
