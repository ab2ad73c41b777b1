"""Played groups → samples: skipped rollouts counted by reason, splits, advantages, batches."""

from __future__ import annotations

import dataclasses
import math

from engine.envs import Rollout, Turn
from engine.orchestrator.advantages import group_relative
from engine.orchestrator.batch import BatchBuilder
from engine.orchestrator.samples import Group, build_group
from tests.unit.orchestrator.helpers import difficulty_builder, group


def turn(prompt: tuple[int, ...], completion: tuple[int, ...], version: int = 0) -> Turn:
    return Turn(prompt, completion, tuple(-0.1 for _ in completion), version, "stop", "")


def rollout(reward: float, turns: list[Turn], **fields: object) -> Rollout:
    return Rollout(env="e", example_id=7, turns=turns, reward=reward, **fields)  # type: ignore[arg-type]


def advantages(rewards: list[float], lengths: list[int]) -> list[float]:
    return group_relative(rewards, lengths)


def test_unusable_rollouts_are_skipped_and_counted_by_reason() -> None:
    good = [turn((1, 2), (3, 4))]
    played = [
        rollout(1.0, good),
        rollout(0.0, good),
        rollout(math.nan, good),
        rollout(math.nan, [], error="RuntimeError: boom"),
        rollout(math.nan, [], context_exhausted=True),
        rollout(0.5, [turn((1, 2), ())]),
    ]
    built = build_group(played, group_id=3, temperature=0.7, advantage_fn=advantages)
    assert built.skipped == {
        "nan_reward": 1,
        "env_error": 1,
        "prompt_too_long": 1,
        "empty_completion": 1,
    }
    assert [(s.reward, s.advantage) for s in built.samples] == [(1.0, 0.5), (0.0, -0.5)]
    assert {(s.group_id, s.temperature, s.example_id) for s in built.samples} == {(3, 0.7, 7)}
    assert built.rollouts == 6


def test_a_split_rollout_becomes_several_samples_sharing_its_advantage() -> None:
    rewritten = [turn((1, 2), (3,), version=4), turn((1, 9, 3, 5), (6,), version=5)]
    built = build_group(
        [rollout(1.0, rewritten), rollout(0.0, [turn((1, 2), (3,))])],
        group_id=0,
        temperature=1.0,
        advantage_fn=advantages,
    )
    assert built.splits == 1
    assert [(s.sequence.token_ids, s.advantage, s.policy_version) for s in built.samples] == [
        ([1, 2, 3], 0.5, 4),
        ([1, 9, 3, 5, 6], 0.5, 5),
        ([1, 2, 3], -0.5, 0),
    ]
    assert built.samples[0].rollout_tokens == 2


def test_a_conversation_cut_off_by_the_context_is_truncated() -> None:
    cut = rollout(0.5, [turn((1, 2), (3,))], context_exhausted=True)
    built = build_group([cut], group_id=0, temperature=1.0, advantage_fn=advantages)
    assert [s.is_truncated for s in built.samples] == [True]


def test_a_reply_that_never_ended_counts_with_the_truncated_reward() -> None:
    """Cut at max_tokens (finish reason `length`) or by the context: scored as
    `truncated_reward` in the advantages, while the sample keeps its environment's reward."""
    ended = rollout(0.8, [turn((1, 2), (3, 4))])
    cut = rollout(0.8, [dataclasses.replace(turn((1, 2), (3, 4)), finish_reason="length")])
    context = rollout(0.8, [turn((1, 2), (3,))], context_exhausted=True)
    played = [ended, cut, context]
    kept = build_group(played, group_id=0, temperature=1.0, advantage_fn=advantages)
    assert [round(s.advantage, 9) for s in kept.samples] == [0.0, 0.0, 0.0]  # no signal
    shaped = build_group(
        played, group_id=0, temperature=1.0, advantage_fn=advantages, truncated_reward=0.0
    )
    assert [s.is_truncated for s in shaped.samples] == [False, True, True]
    assert [round(s.advantage, 6) for s in shaped.samples] == [0.533333, -0.266667, -0.266667]
    assert [s.reward for s in shaped.samples] == [0.8, 0.8, 0.8]


def test_batches_close_on_whole_groups_and_count_what_they_left_out() -> None:
    builder = difficulty_builder(3, 4, max_off_policy_steps=1)
    behind = group(0, [1.0, 0.0, 0.0], version=0)
    assert builder.add(behind) == "stale"  # 2 behind
    assert builder.add(group(1, [0.5, 0.5, 0.5], version=1)) == "filtered"
    assert builder.add(group(2, [1.0, 0.0, 0.0], version=1)) == "admitted"
    assert not builder.full
    assert builder.add(group(3, [0.0, 1.0, 1.0], version=2)) == "admitted"
    assert builder.add(Group("env", 4, [])) == "empty"  # every rollout skipped
    assert builder.full and len(builder.batch.samples) == 6
    counts = builder.batch.counts
    assert counts["stale/off_policy"] == 3 and counts["stale/async_bound"] == 0
    assert counts["filter/difficulty/dropped_groups"] == 1
    assert counts["groups"] == 5 and counts["skipped/env_error"] == 0
    # Of the 4 groups' 24 sampled tokens, the stale group's 6 were thrown away.
    assert builder.batch.sampled_tokens == {"env": 24} and builder.batch.stale_tokens == {"env": 6}


def test_a_group_is_stale_by_its_oldest_token_and_dropped_whole() -> None:
    builder = BatchBuilder(
        5, batch_size=8, unit="samples", filters=[], max_async_level=1, max_off_policy_steps=2
    )
    late = group(0, [1.0, 0.0, 0.5])
    for member, version in zip(late.samples, (4, 1, 4), strict=True):
        member.sequence = dataclasses.replace(member.sequence, policy_version=version)
    assert builder.add(late) == "stale"  # one rollout 3 behind: the group goes
    assert builder.batch.samples == [] and builder.batch.counts["stale/off_policy"] == 3
    # A group that started for an earlier batch is late, not stale, while within the cap.
    assert builder.add(group(1, [1.0, 0.0], version=2)) == "admitted"


def test_token_batches_count_tokens() -> None:
    builder = BatchBuilder(
        1, batch_size=10, unit="tokens", filters=[], max_async_level=1, max_off_policy_steps=1
    )
    builder.add(group(0, [1.0, 0.0]))  # two samples of 4 tokens
    assert builder.size == 8 and not builder.full
    builder.add(group(1, [1.0]))
    assert builder.full


def test_what_a_batch_lacks_and_what_each_fresh_group_gave_it() -> None:
    samples = difficulty_builder(3, 8, max_off_policy_steps=0)
    assert samples.short_of() == 8 and samples.short_of(later_batches=2) == 24
    samples.add(group(0, [1.0, 0.0], version=0))  # stale: a surplus, not counted
    samples.add(group(1, [1.0, 0.0, 0.5], version=2))
    samples.add(group(2, [0.5, 0.5], version=2))  # filtered out
    samples.add(Group("env", 3, []))  # every rollout skipped
    assert samples.batch.group_yields == [3.0, 0.0, 0.0]
    assert samples.short_of() == 5
    tokens = BatchBuilder(
        1, batch_size=40, unit="tokens", filters=[], max_async_level=0, max_off_policy_steps=1
    )
    tokens.add(group(0, [1.0, 0.0]))  # two samples of 4 tokens
    assert tokens.batch.group_yields == [8.0] and tokens.short_of() == 32
