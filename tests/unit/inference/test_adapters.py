"""Which loaded adapter versions a swap rolls back (`engine.inference.adapters.superseded`)."""

from __future__ import annotations

from pathlib import Path

from engine.inference.adapters import Served, superseded


def served(*names: str) -> list[Served]:
    """Loaded versions named `<run>@v<version>-<uid>`, oldest first."""
    return [Served(name, int(name.split("@v")[1].split("-")[0]), Path(name)) for name in names]


def test_moving_forward_rolls_nothing_back() -> None:
    assert superseded(served("r@v1-a", "r@v2-b"), "r@v3-c", 3) == []


def test_going_back_to_a_held_version_rolls_back_every_later_one() -> None:
    loaded = served("r@v20-a", "r@v21-b", "r@v22-c")
    assert [s.name for s in superseded(loaded, "r@v20-a", 20)] == ["r@v21-b", "r@v22-c"]


def test_a_version_published_again_under_its_number_replaces_the_old_one() -> None:
    loaded = served("r@v20-a", "r@v21-b")
    assert [s.name for s in superseded(loaded, "r@v21-x", 21)] == ["r@v21-b"]
    assert superseded(loaded, "r@v21-b", 21) == []  # the same one again: nothing to drop
