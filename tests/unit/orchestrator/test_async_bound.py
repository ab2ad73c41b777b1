"""The async bound under random trainer, reload and rollout timings (a discrete-event model).

The model drives the orchestrator's own decisions — `may_sample_for` gates new rollouts,
`newest_batch_for` caps how many start, and `BatchBuilder` admits finished groups — against a
trainer that turns batch n into policy n after a random time, a pool that serves each checkpoint
after a random reload delay, and rollouts of random length stamped with the policy served when
they started. Whatever the timings: every rollout started under the bound of the batch being
built then (and, synchronous, only the previous policy trains each batch), no batch holds a
group further behind the weights that train on it than `max_off_policy_steps`, every stale
sample is dropped and counted, none is lost. And when rollouts take equally long, every batch
is sampled within the bound: no surplus started for later batches lands further behind."""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config.orchestrator import DifficultyFilterConfig
from engine.orchestrator.async_bound import (
    may_sample_for,
    min_policy_version,
    newest_batch_for,
    stale_reason,
)
from engine.orchestrator.batch import BatchBuilder, StepBatch
from engine.orchestrator.filters import build_filters
from engine.orchestrator.launch_sizing import LaunchSizer
from engine.orchestrator.samples import Group
from tests.unit.orchestrator.helpers import group

durations = st.lists(st.floats(0.01, 10.0), min_size=1, max_size=20)


def simulate(
    *,
    steps: int,
    max_async_level: int,
    max_off_policy_steps: int,
    concurrency: int,
    group_size: int,
    groups_per_batch: int,
    rollout_times: list[float],
    train_times: list[float],
    reload_times: list[float],
    dropped: Callable[[int], bool] | None = None,
    margin_sd: float = 0.0,
) -> tuple[list[StepBatch], list[tuple[int, int, int, int]], int, int, float]:
    """Run the model; returns batches, (step, version, served, launched for) per admitted
    sample, made, pending and the time the last batch closed. With `dropped`, the groups it
    picks (by group id) score alike, and the `difficulty` filter drops them; `margin_sd` is
    the launches' margin for that (`orchestrator.launch_margin_sd`)."""
    events: list[tuple[float, int, str, int]] = []
    order = itertools.count()
    rollout_time, train_time, reload_time = (
        itertools.cycle(times) for times in (rollout_times, train_times, reload_times)
    )
    now, served, in_flight, group_ids = 0.0, 0, 0, itertools.count()
    trainer_free_at = 0.0
    step = 1
    versions: dict[int, int] = {}
    launched_for: dict[int, int] = {}
    pending: list[Group] = []
    batches: list[StepBatch] = []
    admissions: list[tuple[int, int, int, int]] = []
    made = 0

    sizer = LaunchSizer(group_size=group_size, unit="samples", margin_sd=margin_sd)

    def builder(for_step: int) -> BatchBuilder:
        return BatchBuilder(
            for_step,
            batch_size=group_size * groups_per_batch,
            unit="samples",
            filters=build_filters([DifficultyFilterConfig()] if dropped else []),
            max_async_level=max_async_level,
            max_off_policy_steps=max_off_policy_steps,
        )

    current = builder(step)
    for _ in range(100_000):
        # Place finished groups; close and hand over full batches.
        while pending and step <= steps:
            finished = pending.pop(0)
            admissions += [
                (step, s.policy_version, served, launched_for[finished.group_id])
                for s in finished.samples
            ]
            current.add(finished)
            if current.full:
                batches.append(current.batch)
                sizer.closed(current.batch)
                trainer_free_at = max(trainer_free_at, now) + next(train_time)
                heapq.heappush(events, (trainer_free_at, next(order), "checkpoint", step))
                step += 1
                current = builder(step)
        if step > steps:
            break
        # Start rollouts while the pool's policy may go into the batch being built, as many as
        # the batches it may go into still lack (at least one group, as the loop does).
        later = max(0, newest_batch_for(served, max_async_level) - step)
        wanted = sizer.groups_wanted(current, later)
        while may_sample_for(step, served, max_async_level) and (
            in_flight == 0 or (in_flight < concurrency and in_flight < wanted)
        ):
            gid = next(group_ids)
            versions[gid], launched_for[gid] = served, step
            in_flight += 1
            heapq.heappush(events, (now + next(rollout_time), next(order), "group", gid))
        now, _, kind, value = heapq.heappop(events)  # the model never runs dry: assert below
        if kind == "group":
            in_flight -= 1
            made += group_size
            alike = dropped is not None and dropped(value)
            rewards = [0.0 if alike else float(i + 1) for i in range(group_size)]
            pending.append(group(value, rewards, versions[value]))
        elif kind == "checkpoint":
            heapq.heappush(events, (now + next(reload_time), next(order), "served", value))
        else:
            served = max(served, value)
    else:
        raise AssertionError("the model stopped making progress")
    leftover = sum(len(g.samples) for g in pending)
    return batches, admissions, made, leftover, now


@settings(max_examples=150, deadline=None)
@given(
    steps=st.integers(1, 8),
    max_async_level=st.integers(0, 3),
    max_off_policy_steps=st.integers(0, 5),
    concurrency=st.integers(1, 6),
    group_size=st.integers(1, 3),
    groups_per_batch=st.integers(1, 4),
    rollout_times=durations,
    train_times=durations,
    reload_times=durations,
)
def test_no_batch_uses_a_policy_older_than_allowed_and_stale_samples_are_counted(
    steps: int,
    max_async_level: int,
    max_off_policy_steps: int,
    concurrency: int,
    group_size: int,
    groups_per_batch: int,
    rollout_times: list[float],
    train_times: list[float],
    reload_times: list[float],
) -> None:
    batches, admissions, made, leftover, _ = simulate(
        steps=steps,
        max_async_level=max_async_level,
        max_off_policy_steps=max_off_policy_steps,
        concurrency=concurrency,
        group_size=group_size,
        groups_per_batch=groups_per_batch,
        rollout_times=rollout_times,
        train_times=train_times,
        reload_times=reload_times,
    )
    assert [b.step for b in batches] == list(range(1, steps + 1))
    for batch in batches:
        assert len(batch.samples) >= group_size * groups_per_batch
        if max_async_level == 0:
            assert {s.policy_version for s in batch.samples} == {batch.step - 1}
    for _, version, _, launched in admissions:  # no rollout started ahead of the bound
        assert version >= min_policy_version(launched, max_async_level)
    expected = Counter(
        reason
        for step, version, served, _ in admissions
        if (
            reason := stale_reason(
                version,
                step=step,
                max_async_level=max_async_level,
                max_off_policy_steps=max_off_policy_steps,
            )
        )
    )
    counted = Counter()
    for batch in batches:
        counted.update({k: v for k, v in batch.counts.items() if k.startswith("stale/") and v})
    assert counted == expected
    used = sum(len(batch.samples) for batch in batches)
    in_open_batch = made - used - sum(expected.values()) - leftover
    assert in_open_batch >= 0  # admitted to the step after the last one, never lost
    for batch in batches:  # the lag the update sees: behind the weights that train on it
        for sample in batch.samples:
            assert batch.step - 1 - sample.policy_version <= max_off_policy_steps


def test_the_bound_itself() -> None:
    assert [min_policy_version(n, 1) for n in (1, 2, 3, 10)] == [0, 0, 1, 8]
    assert [min_policy_version(n, 0) for n in (1, 2, 3)] == [0, 1, 2]
    assert may_sample_for(3, 1, 1) and not may_sample_for(3, 0, 1)
    kwargs = {"step": 5, "max_async_level": 1}
    assert stale_reason(3, **kwargs, max_off_policy_steps=8) is None
    # Asynchronous: a group that started under its bound is late, not stale, within the cap.
    assert stale_reason(2, **kwargs, max_off_policy_steps=8) is None
    assert stale_reason(3, **kwargs, max_off_policy_steps=0) == "stale/off_policy"
    synchronous = {**kwargs, "max_async_level": 0}
    assert stale_reason(4, **synchronous, max_off_policy_steps=8) is None
    assert stale_reason(3, **synchronous, max_off_policy_steps=8) == "stale/async_bound"


@settings(max_examples=100, deadline=None)
@given(
    steps=st.integers(1, 8),
    max_async_level=st.integers(0, 3),
    concurrency=st.integers(1, 12),
    group_size=st.integers(1, 3),
    groups_per_batch=st.integers(1, 4),
    rollout_time=st.floats(0.01, 10.0),
    train_times=durations,
    reload_times=durations,
)
def test_rollouts_of_equal_length_are_all_sampled_within_the_async_bound(
    steps: int,
    max_async_level: int,
    concurrency: int,
    group_size: int,
    groups_per_batch: int,
    rollout_time: float,
    train_times: list[float],
    reload_times: list[float],
) -> None:
    """More in flight than a batch (`max_concurrent` above the batch size) once started a
    surplus on an old version that landed batches later, beyond the bound."""
    batches, admissions, _, _, _ = simulate(
        steps=steps,
        max_async_level=max_async_level,
        max_off_policy_steps=100,
        concurrency=concurrency,
        group_size=group_size,
        groups_per_batch=groups_per_batch,
        rollout_times=[rollout_time],
        train_times=train_times,
        reload_times=reload_times,
    )
    assert [b.step for b in batches] == list(range(1, steps + 1))
    for step, version, _, _ in admissions:
        assert version >= min_policy_version(step, max_async_level), (step, version)


def test_a_launch_margin_trades_time_for_samples_two_versions_behind() -> None:
    """The `difficulty` filter dropping one group in ten, or three, at random, in the async
    loop (a trainer step and a reload that take 0.3 and 1.0 of a mean rollout), 60 batches of
    16 groups. Rollouts of one length: launched at the mean yield, the drops cost 7-15 % of the
    time (each batch left a group short waits a whole rollout for it), and with 2 SD of margin
    the loop keeps within 3 % of no drops. Rollouts of 0.5-1.5: the margin takes 0.86-0.93x the
    time at the mean. Either way its surplus trains in the next batch, so the share of trained
    samples two versions behind the trainer grows (8-13 % to 22-36 %, and 11-17 % to 25-39 %),
    and no length is favoured: the groups trained took as long, on average, as those started.
    Dropping the surplus instead (tried, not kept) left no sample two versions behind but gave
    back most of the time (0.95-0.98x) and trained the quicker rollouts (0.90-0.94x the mean
    duration): a bias to short replies."""

    def run(
        drop_rate: float, seed: int, margin_sd: float, durations: list[float]
    ) -> tuple[float, float]:
        draws = random.Random(seed)
        dropped = {gid for gid in range(40_000) if draws.random() < drop_rate}
        batches, _, _, _, ended = simulate(
            steps=60,
            max_async_level=1,
            max_off_policy_steps=8,
            concurrency=1_000,
            group_size=8,
            groups_per_batch=16,
            rollout_times=durations,
            train_times=[0.3],
            reload_times=[1.0],
            dropped=dropped.__contains__,
            margin_sd=margin_sd,
        )
        behind = [b.step - 1 - s.policy_version for b in batches for s in b.samples]
        trained = {s.group_id for b in batches for s in b.samples}
        started = [g for g in range(max(trained) + 1) if g not in dropped]
        took = [durations[g % len(durations)] for g in trained]
        assert statistics.fmean(took) == pytest.approx(
            statistics.fmean(durations[g % len(durations)] for g in started), rel=0.01
        ), (drop_rate, seed, margin_sd)
        return ended, sum(lag >= 2 for lag in behind) / len(behind)

    lengths = random.Random(2)
    varied = [lengths.uniform(0.5, 1.5) for _ in range(997)]
    undropped, _ = run(0.0, 0, 0.0, [1.0])
    for drop_rate in (0.1, 0.3):
        for seed in (0, 1):
            at_mean, at_mean_behind = run(drop_rate, seed, 0.0, [1.0])
            margin, margin_behind = run(drop_rate, seed, 2.0, [1.0])
            assert margin <= 1.05 * undropped < at_mean, (drop_rate, seed)
            assert margin_behind > 1.5 * at_mean_behind, (drop_rate, seed)
            at_mean, at_mean_behind = run(drop_rate, seed, 0.0, varied)
            margin, margin_behind = run(drop_rate, seed, 2.0, varied)
            assert margin < 0.94 * at_mean, (drop_rate, seed)
            assert margin_behind > 1.5 * at_mean_behind, (drop_rate, seed)
