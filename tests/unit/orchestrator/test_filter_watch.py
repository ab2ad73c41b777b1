"""Groups the filters drop whole: a line with the count, and a stop, not a batch never filled."""

from __future__ import annotations

import logging

import pytest

from engine.orchestrator.filter_watch import (
    FilteredOutError,
    FilterWatch,
    groups_in_a_row_limit,
)
from tests.unit.orchestrator.helpers import group


def test_groups_dropped_in_a_row_fail_in_one_line_naming_filter_envs_and_rewards() -> None:
    watch = FilterWatch(["difficulty"], limit=4, line_every_s=3600)
    for index in range(3):
        watch.dropped(group(index, [0.0, 0.0, 0.0]))
    with pytest.raises(FilteredOutError) as caught:
        watch.dropped(group(3, [1.0, 1.0, 1.0]))
    message = str(caught.value)
    assert message.startswith("orchestrator.filters (difficulty) dropped the last 4 groups whole")
    assert "(env: 4; their mean rewards 0.000 to 1.000)" in message
    assert "remove the filter" in message and "\n" not in message


def test_an_admitted_group_breaks_the_row() -> None:
    watch = FilterWatch(["difficulty"], limit=4, line_every_s=3600)
    for index in range(30):  # three dropped, one admitted, over and over: never four in a row
        if index % 4 == 3:
            watch.admitted()
        else:
            watch.dropped(group(index, [0.5, 0.5]))


def test_a_row_is_logged_from_a_batchs_worth_with_its_count_at_most_every_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = FilterWatch(["difficulty"], limit=64, line_every_s=0.0)  # batches of 4 groups
    with caplog.at_level(logging.WARNING, logger="engine.orchestrator.filter_watch"):
        for index in range(3):  # fewer than a batch's worth: a thinned batch, not a spin
            watch.dropped(group(index, [0.0, 0.0]))
        watch.admitted()
        for index in range(5):
            watch.dropped(group(index, [0.0, 0.0]))
    assert [record.getMessage() for record in caplog.records] == [
        f"the filters dropped the last {count} groups whole (env: {count}; mean rewards all "
        "0.000); the run stops at 64 in a row"
        for count in (4, 5)
    ]
    quiet = FilterWatch(["difficulty"], limit=64, line_every_s=3600)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.orchestrator.filter_watch"):
        for index in range(50):
            quiet.dropped(group(index, [0.0, 0.0]))
    assert caplog.records == []  # no line before the interval has passed since the start


def test_the_limit_is_sixteen_batches_of_groups_and_never_below_64() -> None:
    assert groups_in_a_row_limit(16) == 256  # the recipes' 128 samples in groups of 8
    assert groups_in_a_row_limit(2) == 64  # the debug config's 8 samples in groups of 4
    assert groups_in_a_row_limit(2.5) == 64 and groups_in_a_row_limit(4.5) == 72


def test_a_stage_stopped_by_its_filters_is_not_retried() -> None:
    from prefect.states import Failed

    from tasks.stages import _worth_retrying, rl_loop

    filtered = Failed(data=FilteredOutError("orchestrator.filters (difficulty) dropped ..."))
    assert not _worth_retrying(rl_loop, None, filtered)  # type: ignore[arg-type]
    assert _worth_retrying(rl_loop, None, Failed(data=RuntimeError("trainer exited with 1")))  # type: ignore[arg-type]
