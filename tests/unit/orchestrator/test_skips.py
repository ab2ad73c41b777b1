"""Skipped rollouts: one log line per reason with a count, and a stop instead of a spin."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from engine.orchestrator.samples import Group
from engine.orchestrator.skips import EnvironmentSkippedError, SkipWatch


def played(env: str, rollouts: int, **skipped: int) -> Group:
    examples = {reason: "example 7: boom" for reason in skipped}
    return Group(env, 0, [], Counter(skipped), skip_examples=examples, rollouts=rollouts)


def test_an_environment_that_only_skips_fails_in_one_line_naming_reason_and_fix() -> None:
    watch = SkipWatch(window=16, line_every_s=3600)
    for _ in range(3):
        watch.record(played("calc", 4, prompt_too_long=4))  # 12 of 16: not judged yet
    with pytest.raises(EnvironmentSkippedError) as caught:
        watch.record(played("calc", 4, prompt_too_long=4))
    message = str(caught.value)
    assert message.startswith("environment 'calc': 16 of its last 16 rollouts were skipped")
    assert "(prompt_too_long: example 7: boom)" in message and "raise seq_len" in message
    assert "\n" not in message


def test_occasional_skips_and_other_environments_go_on() -> None:
    watch = SkipWatch(window=16, line_every_s=3600)
    for _ in range(20):
        watch.record(played("mixed", 4, env_error=3))  # 75 %: below the 90 % that fails
        watch.record(played("fine", 4))


def test_skips_are_logged_as_one_line_per_reason_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = SkipWatch(window=1000, line_every_s=3600)
    with caplog.at_level(logging.WARNING, logger="engine.orchestrator.skips"):
        watch.record(played("calc", 4, prompt_too_long=4))  # the first line comes at once
        for _ in range(50):
            watch.record(played("calc", 4, prompt_too_long=2, env_error=1))
        watch.say()  # as a committed step does
        watch.say()  # nothing new: no line
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "skipped 4 rollouts of calc (prompt_too_long), e.g. example 7: boom",
        "skipped 50 rollouts of calc (env_error), e.g. example 7: boom",
        "skipped 100 rollouts of calc (prompt_too_long), e.g. example 7: boom",
    ]
