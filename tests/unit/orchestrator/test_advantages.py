"""Advantages: group-relative baseline, std option, length shaping, custom functions."""

from __future__ import annotations

import math

import pytest

from engine.config.orchestrator import GroupRelativeAdvantageConfig
from engine.config.plugin import CustomPluginConfig
from engine.orchestrator.advantages import STD_EPS, build_advantage_fn, group_relative

PLUGINS = "tests.unit.orchestrator.custom_plugins"


def test_a_group_of_one_has_zero_advantage() -> None:
    assert group_relative([0.7], [10]) == [0.0]
    assert group_relative([0.7], [10], std_normalize=True) == [0.0]


def test_mean_baseline() -> None:
    assert group_relative([1.0, 0.0, 0.5, 0.5], [1, 1, 1, 1]) == [0.5, -0.5, 0.0, 0.0]
    advantages = group_relative([0.1, 0.1, 0.1], [3, 4, 5])
    assert all(abs(a) < 1e-12 for a in advantages)
    assert math.fsum(group_relative([0.3, 0.9, 0.2, 0.4], [1] * 4)) == pytest.approx(0, abs=1e-12)


def test_std_option_scales_to_unit_variance() -> None:
    advantages = group_relative([1.0, 0.0, 1.0, 0.0], [1] * 4, std_normalize=True)
    assert advantages == pytest.approx([1 / (0.5 + STD_EPS) * 0.5, -0.5 / (0.5 + STD_EPS)] * 2)
    assert group_relative([0.2, 0.2], [1, 2], std_normalize=True) == pytest.approx([0.0, 0.0])


def test_length_shaping_prefers_shorter_answers_among_equal_rewards() -> None:
    advantages = group_relative([1.0, 1.0], [10, 30], length_penalty=0.5, max_tokens=100)
    assert advantages == pytest.approx([0.05, -0.05])


def test_configured_functions() -> None:
    builtin = build_advantage_fn(GroupRelativeAdvantageConfig(std_normalize=False), 128)
    assert builtin([1.0, 0.0], [5, 5]) == [0.5, -0.5]
    custom = build_advantage_fn(
        CustomPluginConfig(import_path=f"{PLUGINS}:rank_advantage", kwargs={"scale": 2.0}), 128
    )
    assert custom([0.3, 0.9, 0.1], [1, 1, 1]) == [0.0, 2.0, -2.0]


def test_a_custom_function_must_return_one_finite_value_per_rollout() -> None:
    custom = build_advantage_fn(CustomPluginConfig(import_path=f"{PLUGINS}:wrong_length"), 128)
    with pytest.raises(ValueError, match="one finite float per rollout"):
        custom([0.0, 1.0], [1, 1])


def test_a_missing_plugin_fails_at_build_time_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"orchestrator.advantage.import_path: .* no attribute"):
        build_advantage_fn(CustomPluginConfig(import_path=f"{PLUGINS}:nope"), 128)
