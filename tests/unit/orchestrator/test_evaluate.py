"""pass@k and the evaluation summary."""

from __future__ import annotations

import math

import pytest

from engine.envs import Rollout, Turn
from engine.orchestrator.evaluate import pass_at_k, score, summarize


def test_pass_at_k_is_the_unbiased_estimate() -> None:
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)
    assert pass_at_k(3, 1, 3) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def _rollout(example: int, reward: float, **fields: object) -> Rollout:
    turns = [] if fields else [Turn((1,), (2, 3), (-0.1, -0.2), 0, "stop", "")]
    return Rollout(env="e", example_id=example, turns=turns, reward=reward, **fields)  # type: ignore[arg-type]


def test_summary_counts_unscorable_rollouts_as_failures() -> None:
    played = score(
        [
            _rollout(0, 1.0),
            _rollout(0, 0.2),
            _rollout(1, math.nan, error="boom"),
            _rollout(1, 0.6),
        ],
        threshold=0.5,
    )
    summary = summarize(played, k=2)
    assert summary["avg@2"] == pytest.approx((1.0 + 0.2 + 0.0 + 0.6) / 4)
    assert summary["pass@1"] == pytest.approx(0.5)
    assert summary["pass@2"] == 1.0
    assert summary["skipped"] == {"env_error": 1}
    assert summary["examples"] == 2 and summary["samples"] == 4
    assert summary["completion_len_mean"] == pytest.approx(1.5)
