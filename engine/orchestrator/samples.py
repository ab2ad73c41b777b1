"""Played groups → training samples: skip what cannot be trained on, score, split, count.

A rollout is skipped, with its reason counted (and one example per reason kept for the log),
when its environment failed, its prompt did not fit the context, the model sampled nothing, or
its reward is not a finite number. The rest get
group-relative advantages (computed over the group's usable rollouts) and become one sample per
token sequence — several when a chat template rewrote history mid-conversation.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.envs import Rollout, TokenSequence, assemble
from engine.orchestrator.advantages import AdvantageFn

logger = logging.getLogger(__name__)

SKIP_REASONS = ("env_error", "prompt_too_long", "empty_completion", "nan_reward")


@dataclass
class TrainSample:
    """One row of a rollout shard, before the step number is known."""

    env: str
    example_id: int
    group_id: int
    sequence: TokenSequence
    reward: float
    advantage: float
    temperature: float
    metrics: dict[str, float]
    #: The whole rollout's sampled tokens (all its sequences), for length metrics.
    rollout_tokens: int
    #: The rollout this row is part of (unique in the run: group id × group size + its index
    #: in the group), the row's index in it, and how many rows it has (several when a chat
    #: template rewrote history): a rollout's rows are kept or dropped together.
    rollout_id: int = 0
    row_index: int = 0
    rollout_rows: int = 1

    @property
    def policy_version(self) -> int:
        return self.sequence.policy_version

    @property
    def policy_lineage(self) -> str:
        return self.sequence.policy_lineage

    @property
    def is_truncated(self) -> bool:
        return self.sequence.is_truncated

    @property
    def num_tokens(self) -> int:
        return len(self.sequence.token_ids)


@dataclass
class Group:
    """The usable samples of one task's group, and what became of the rest."""

    env: str
    group_id: int
    samples: list[TrainSample]
    skipped: Counter[str] = field(default_factory=Counter)
    #: One skipped rollout per reason, described for the log (`engine.orchestrator.skips`).
    skip_examples: dict[str, str] = field(default_factory=dict)
    #: Extra sequences made by splitting rollouts whose history a template rewrote.
    splits: int = 0
    rollouts: int = 0


def skip_reason(rollout: Rollout) -> str | None:
    """Why a rollout cannot be trained on, or None."""
    if rollout.error is not None:
        return "env_error"
    if not rollout.turns:
        return "prompt_too_long" if rollout.context_exhausted else "empty_completion"
    if not any(turn.completion_ids for turn in rollout.turns):
        return "empty_completion"
    if not math.isfinite(rollout.reward):
        return "nan_reward"
    return None


def build_group(
    rollouts: Sequence[Rollout],
    *,
    group_id: int,
    temperature: float,
    advantage_fn: AdvantageFn,
    truncated_reward: float | None = None,
) -> Group:
    """Training samples of one played group, with skips and splits counted.

    `truncated_reward`: the reward a rollout that never ended (cut at `max_tokens` or by the
    context) counts with in the advantages, instead of its environment's (None: the
    environment's). An environment that scores the first answer in a reply leaves what comes
    after it free, so nothing rewards ending the reply; a policy under RL then drifts off its
    end-of-turn token, pads every reply with text to `max_tokens`, and that text creeps into the
    answers (the CPU demo's RL collapsed to reward 0 that way: docs/benchmarks.md). The
    sample's `reward` stays the environment's.
    """
    env = rollouts[0].env if rollouts else ""
    group = Group(env=env, group_id=group_id, samples=[], rollouts=len(rollouts))
    usable: list[tuple[int, Rollout, list[TokenSequence]]] = []
    for index, rollout in enumerate(rollouts):
        reason = skip_reason(rollout)
        if reason is not None:
            group.skipped[reason] += 1
            detail = f": {rollout.error}" if rollout.error else ""
            group.skip_examples.setdefault(reason, f"example {rollout.example_id}{detail}")
            continue
        sequences = assemble(rollout.turns)
        if rollout.context_exhausted:  # the conversation was cut off by the context, not ended
            sequences[-1] = dataclasses.replace(sequences[-1], is_truncated=True)
        usable.append((index, rollout, sequences))
    lengths = [sum(s.sampled_tokens for s in sequences) for _, _, sequences in usable]
    scored = [
        truncated_reward
        if truncated_reward is not None and sequences[-1].is_truncated
        else rollout.reward
        for _, rollout, sequences in usable
    ]
    advantages = advantage_fn(scored, lengths)
    for (index, rollout, sequences), advantage, length in zip(
        usable, advantages, lengths, strict=True
    ):
        if len(sequences) > 1:
            group.splits += len(sequences) - 1
            logger.warning(
                "%s example %d: the chat template rewrote earlier turns; the rollout was split "
                "into %d sequences",
                rollout.env,
                rollout.example_id,
                len(sequences),
            )
        group.samples.extend(
            TrainSample(
                env=rollout.env,
                example_id=rollout.example_id,
                group_id=group_id,
                sequence=sequence,
                reward=rollout.reward,
                advantage=advantage,
                temperature=temperature,
                metrics=rollout.metrics,
                rollout_tokens=length,
                rollout_id=group_id * len(rollouts) + index,
                row_index=row,
                rollout_rows=len(sequences),
            )
            for row, sequence in enumerate(sequences)
        )
    return group
