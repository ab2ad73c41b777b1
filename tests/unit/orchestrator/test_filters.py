"""Filters: zero-advantage, online difficulty, custom — each counted."""

from __future__ import annotations

import pytest

from engine.config.orchestrator import DifficultyFilterConfig, ZeroAdvantageFilterConfig
from engine.config.plugin import CustomPluginConfig
from engine.orchestrator.filters import apply_filters, build_filters
from tests.unit.orchestrator.helpers import group, sample


def _groups() -> list[list]:
    return [
        group(0, [1.0, 0.0, 0.5]).samples,  # varied: advantages 0.5, -0.5, 0
        group(1, [0.3, 0.3]).samples,  # all equal: zero advantage
        group(2, [1.0]).samples,  # a group of one
    ]


def test_zero_advantage_drops_samples_without_gradient() -> None:
    kept, counts = apply_filters(_groups(), build_filters([ZeroAdvantageFilterConfig()]))
    assert [[s.reward for s in g] for g in kept] == [[1.0, 0.0]]
    assert counts == {
        "filter/zero_advantage/dropped_samples": 4,
        "filter/zero_advantage/dropped_groups": 2,
    }


def test_difficulty_drops_whole_groups_with_equal_rewards() -> None:
    kept, counts = apply_filters(_groups(), build_filters([DifficultyFilterConfig()]))
    assert [len(g) for g in kept] == [3]
    assert counts == {
        "filter/difficulty/dropped_samples": 3,
        "filter/difficulty/dropped_groups": 2,
    }


def test_filters_apply_in_order_and_custom_ones_take_kwargs() -> None:
    custom = CustomPluginConfig(
        import_path="tests.unit.orchestrator.custom_plugins:no_truncated",
        kwargs={"max_reward": 0.6},
    )
    filters = build_filters([DifficultyFilterConfig(), custom])
    kept, counts = apply_filters(_groups(), filters)
    assert [[s.reward for s in g] for g in kept] == [[0.0, 0.5]]
    assert counts["filter/no_truncated/dropped_samples"] == 1
    assert counts["filter/no_truncated/dropped_groups"] == 0


def test_a_filter_must_flag_every_sample() -> None:
    bad = CustomPluginConfig(import_path="tests.unit.orchestrator.custom_plugins:keep_first")
    with pytest.raises(ValueError, match="returned 1 flags for 2 samples"):
        apply_filters([[sample(), sample()]], build_filters([bad]))
