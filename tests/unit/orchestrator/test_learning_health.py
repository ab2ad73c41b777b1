"""What says whether RL can learn: advantage health per batch, and when online evals are due."""

from __future__ import annotations

import pytest

from engine.orchestrator.online_eval import flat_numbers, is_due
from engine.orchestrator.step_metrics import advantage_health
from tests.unit.orchestrator.helpers import group, sample


def test_advantage_health_counts_dead_groups_and_signal_tokens() -> None:
    varied = group(0, [0.2, 0.6]).samples  # advantages ∓0.2
    dead = group(1, [1.0, 1.0]).samples  # all equal: no advantage
    long = [sample(group_id=2, reward=r, advantage=a, completion=6) for r, a in ((0, -1), (1, 1))]
    health = advantage_health([*varied, *dead, *long])
    assert health["advantage/zero_group_fraction"] == pytest.approx(1 / 3)
    # Tokens: 2 + 2 (varied) + 2 + 2 (dead) + 6 + 6 (long) = 20, of which 16 carry a signal.
    assert health["advantage/nonzero_token_fraction"] == pytest.approx(16 / 20)
    assert health["advantage/group_reward_std"] == pytest.approx((0.2 + 0.0 + 0.5) / 3)
    assert advantage_health([])["advantage/zero_group_fraction"] == 0.0


def test_an_online_eval_is_due_at_version_0_and_once_per_interval() -> None:
    assert is_due(0, None, 10)
    assert not is_due(9, 0, 10)
    assert is_due(10, 0, 10) and is_due(11, 0, 10)  # a skipped multiple takes the next one
    assert not is_due(19, 11, 10)
    assert is_due(3, None, 10)  # a resumed run without lines evaluates what it serves


def test_flat_numbers_name_headline_and_per_environment_values() -> None:
    summary = {
        "name": "online",
        "step": 4,
        "k": 2,
        "avg@2": 0.5,
        "greedy/avg@1": 0.6,
        "envs": {"rev": {"avg@2": 0.5, "skipped": {}, "greedy": {"avg@1": 0.6, "samples": 3}}},
    }
    assert flat_numbers(summary) == {
        "eval/avg@2": 0.5,
        "eval/greedy/avg@1": 0.6,
        "eval/rev/avg@2": 0.5,
        "eval/rev/greedy/avg@1": 0.6,
        "eval/rev/greedy/samples": 3.0,
    }
