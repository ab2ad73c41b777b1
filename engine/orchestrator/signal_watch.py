"""A run whose reward collapsed: a stop with what happened, instead of steps that teach nothing.

When every group of a batch scored alike, no sample has an advantage, the trainer skips its
update (a zero gradient), and the step only costs time. That is how a collapsed policy looks:
on the GPU model at too high a learning rate, tool-math's calls degenerated within 16 steps
(reward 0.26 to 0.000, every rollout unparsable) and the run then sampled and skipped 84 more
steps. `SignalWatch` fails the run once `max_steps` steps in a row had no signal while the
reward has fallen well below the best step's (`fell`), naming the steps, the reward then and
now, and what to change. Steps without signal near the run's best reward (a solved task, a
policy that samples one answer per prompt, a task that never paid anything) are logged, not
failed: the run goes on as configured. A resumed run replays its
last committed steps first (`RESUME_WINDOW`), so a run that collapsed fails again at its next
step without signal instead of counting afresh from the collapsed reward.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from engine.orchestrator.step_metrics import ZERO_GROUP_FRACTION

logger = logging.getLogger(__name__)

#: A fall from the best step's reward that counts as a collapse: this share of the best, and
#: at least `FALL_MIN` (a converged policy's batches differ by their prompts, not by this).
FALL_SHARE = 0.25
FALL_MIN = 0.05
#: Committed steps a resumed run replays: one object read each, so not the whole history.
RESUME_WINDOW = 200


class RewardCollapsedError(RuntimeError):
    """Steps in a row without any advantage, far below the run's best reward: nothing trains."""


def fell(reward: float, best: float) -> bool:
    """Whether `reward` is a collapse from `best`, not a batch of harder prompts."""
    return reward < best - max(FALL_MIN, FALL_SHARE * abs(best))


@dataclass
class SignalWatch:
    """Counts committed steps in a row whose every group had zero advantage."""

    max_steps: int | None
    _quiet: int = 0
    _best: float = -math.inf
    _best_step: int = 0

    def replay(self, lines: list[dict[str, Any]]) -> None:
        """Count the orchestrator's metric lines of steps committed before a resume."""
        for line in lines:  # a line written before these metrics existed counts as a signal
            zero, reward = line.get(ZERO_GROUP_FRACTION, 0.0), line.get("reward/mean")
            self._count(line["step"], zero, reward if reward is not None else -math.inf)

    def _count(self, step: int, zero_group_fraction: float, reward: float) -> None:
        if reward > self._best:
            self._best, self._best_step = reward, step
        self._quiet = self._quiet + 1 if zero_group_fraction >= 1.0 else 0

    def record(self, step: int, zero_group_fraction: float, reward: float) -> None:
        """Judge committed step `step`; raise `RewardCollapsedError` if the run collapsed."""
        self._count(step, zero_group_fraction, reward)
        if self.max_steps is None or self._quiet < self.max_steps:
            return
        first = step - self._quiet + 1
        if fell(reward, self._best):
            raise RewardCollapsedError(
                f"no learning signal for {self._quiet} steps ({first}-{step}): every group's "
                f"rollouts scored alike, reward {reward:.3f} against {self._best:.3f} at step "
                f"{self._best_step}, so the policy collapsed: start RL again with a lower "
                "trainer.optim.lr (orchestrator.max_steps_without_signal sets this limit; "
                "null turns it off)"
            )
        if self._quiet % self.max_steps == 0:
            logger.warning(
                "no learning signal for %d steps (%d-%d): every group's rollouts scored alike "
                "at reward %.3f (the run's best: %.3f): %s; the trainer skips these updates",
                self._quiet,
                first,
                step,
                reward,
                self._best,
                _why_alike(self._best),
            )


def _why_alike(best: float) -> str:
    """What ties every group near the run's best reward."""
    if best <= 0:
        return (
            "the policy has never earned a reward on these prompts, so RL cannot start (more "
            "or longer SFT, or a reward that credits part of the task)"
        )
    return "a solved task, or a policy that samples one answer per prompt"
