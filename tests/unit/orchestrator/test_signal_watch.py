"""`SignalWatch`: steps without any advantage fail the run only below the run's best reward."""

from __future__ import annotations

import logging

import pytest

from engine.orchestrator.signal_watch import RewardCollapsedError, SignalWatch


def test_steps_without_signal_below_the_best_reward_fail_the_run_in_one_line() -> None:
    watch = SignalWatch(max_steps=3)
    for step, reward in enumerate([0.25, 0.27, 0.22], start=1):
        watch.record(step, 0.0, reward)
    watch.record(4, 1.0, 0.0)
    watch.record(5, 1.0, 0.0)
    with pytest.raises(RewardCollapsedError) as caught:
        watch.record(6, 1.0, 0.0)
    message = str(caught.value)
    assert message.startswith("no learning signal for 3 steps (4-6): ")
    assert "reward 0.000 against 0.270 at step 2" in message
    assert "lower trainer.optim.lr" in message and "\n" not in message


def test_a_step_with_signal_restarts_the_count() -> None:
    watch = SignalWatch(max_steps=2)
    watch.record(1, 0.5, 0.3)
    watch.record(2, 1.0, 0.0)
    watch.record(3, 0.9, 0.1)  # one group still taught something
    watch.record(4, 1.0, 0.0)
    with pytest.raises(RewardCollapsedError, match=r"\(4-5\)"):
        watch.record(5, 1.0, 0.0)


def test_steps_without_signal_near_the_best_reward_are_logged_not_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    solved, never_paid, one_answer = (SignalWatch(max_steps=2) for _ in range(3))
    with caplog.at_level(logging.WARNING):
        for step, converged in zip(range(1, 6), [0.97, 0.90, 0.93, 0.88, 0.95], strict=True):
            solved.record(step, 1.0, 1.0)
            never_paid.record(step, 1.0, 0.0)
            # One answer per prompt: batches differ by which prompts it gets wrong
            one_answer.record(step, 1.0, converged)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6  # each watch at steps 2 and 4
    assert lines[0].startswith("no learning signal for 2 steps (1-2)")
    assert "(the run's best: 1.000): a solved task" in lines[0]
    assert "(the run's best: 0.000): the policy has never earned a reward" in lines[1]


def test_none_never_fails() -> None:
    watch = SignalWatch(max_steps=None)
    watch.record(1, 0.0, 0.9)
    for step in range(2, 100):
        watch.record(step, 1.0, 0.0)


def test_a_resumed_run_that_had_collapsed_fails_at_its_next_step_without_signal() -> None:
    committed = [
        {"step": 1, "advantage/zero_group_fraction": 0.0, "reward/mean": 0.26},
        *({"step": s, "advantage/zero_group_fraction": 1.0, "reward/mean": 0.0} for s in (2, 3)),
    ]
    watch = SignalWatch(max_steps=3)
    watch.replay(committed)  # replaying never raises: those steps are done
    with pytest.raises(RewardCollapsedError, match=r"\(2-4\).*against 0\.260 at step 1"):
        watch.record(4, 1.0, 0.0)


def test_a_collapsed_stage_is_not_retried_a_failed_one_is() -> None:
    from prefect.states import Failed

    from tasks.stages import _worth_retrying, rl_loop

    collapsed = Failed(data=RewardCollapsedError("no learning signal for 20 steps"))
    crashed = Failed(data=RuntimeError("trainer exited with 1"))
    assert not _worth_retrying(rl_loop, None, collapsed)  # type: ignore[arg-type]
    assert _worth_retrying(rl_loop, None, crashed)  # type: ignore[arg-type]
