"""Launch sizing: groups enough to fill the open batches at what recent groups gave, with a
margin for the filters' drops when asked for, and exactly what is missing when every group
gives alike."""

from __future__ import annotations

import math
import statistics

from hypothesis import given
from hypothesis import strategies as st

from engine.orchestrator.launch_sizing import YIELD_WINDOW, LaunchSizer, groups_for
from tests.unit.orchestrator.helpers import difficulty_builder, group


def test_groups_that_all_give_alike_are_started_exactly_as_many_as_missing() -> None:
    for margin_sd in (0.0, 2.0):
        assert groups_for(128, [8.0] * 40, margin_sd) == 16
        assert groups_for(130, [8.0], margin_sd) == 17
        assert groups_for(0, [8.0], margin_sd) == 0 and groups_for(-8, [8.0], margin_sd) == 0
        assert groups_for(16, [0.0, 0.0], margin_sd) == math.inf  # nothing landed gave anything


def test_drops_are_made_up_at_the_mean_and_a_margin_adds_beyond_it() -> None:
    yields = [8.0] * 94 + [0.0] * 6  # 6 % of groups dropped, as early in the GPU reference
    assert groups_for(128, yields, 0.0) == math.ceil(128 / statistics.fmean(yields)) == 18
    assert groups_for(128, yields, 2.0) == 20


@given(
    missing=st.integers(1, 2_000),
    yields=st.lists(st.sampled_from([0.0, 4.0, 8.0, 12.0]), min_size=1, max_size=60),
    margin_sd=st.sampled_from([0.0, 1.0, 2.0]),
)
def test_the_margin_is_met_by_the_fewest_groups(
    missing: int, yields: list[float], margin_sd: float
) -> None:
    mean = statistics.fmean(yields)
    wanted = groups_for(missing, yields, margin_sd)
    if mean == 0:
        assert wanted == math.inf
        return
    margin = margin_sd * statistics.pstdev(yields)

    def enough(n: int) -> bool:
        return n * mean - margin * math.sqrt(n) >= missing - 1e-6

    assert isinstance(wanted, int) and enough(wanted) and not enough(wanted - 1)


def test_the_sizer_learns_from_recent_batches_only() -> None:
    sizer = LaunchSizer(group_size=4, unit="samples", margin_sd=2.0)
    assert sizer.groups_wanted(difficulty_builder(1, 16)) == 4  # before any group landed: 16 / 4
    assert sizer.groups_wanted(difficulty_builder(1, 16), later_batches=1) == 8
    for step in range(1, YIELD_WINDOW + 1):  # every other group dropped
        batch = difficulty_builder(step, 16)
        for gid in range(8):
            rewards = [1.0, 1.0, 1.0, 1.0] if gid % 2 else [1.0, 0.0, 1.0, 0.0]
            batch.add(group(gid, rewards, version=step - 1))
        sizer.closed(batch.batch)
    dropping = sizer.groups_wanted(difficulty_builder(9, 16))
    assert dropping > 8  # twice the groups for half the yield, and a margin
    for step in range(9, 9 + YIELD_WINDOW):  # nothing dropped any more: the drops are forgotten
        batch = difficulty_builder(step, 16)
        for gid in range(4):
            batch.add(group(gid, [1.0, 0.0, 1.0, 0.0], version=step - 1))
        sizer.closed(batch.batch)
    assert sizer.groups_wanted(difficulty_builder(17, 16)) == 4


def test_a_token_batch_is_unsized_until_a_group_landed() -> None:
    sizer = LaunchSizer(group_size=2, unit="tokens", margin_sd=0.0)
    tokens = difficulty_builder(1, 40, unit="tokens")
    assert sizer.groups_wanted(tokens) == math.inf
    tokens.add(group(0, [1.0, 0.0]))  # 8 tokens
    assert sizer.groups_wanted(tokens) == 4  # 32 more tokens
