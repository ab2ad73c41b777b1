"""Which loaded adapter versions a swap rolls back (`engine.inference.adapters.superseded`)."""

from __future__ import annotations

from pathlib import Path

from engine.inference.adapters import Served, publisher_of, superseded


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


def test_a_resumed_trainer_s_version_rolls_back_what_a_dead_one_published_past_its_checkpoint() -> (
    None
):
    dead, resumed = ("dead", 0), ("resumed", 3)  # (lineage_id, the step it resumed from)
    loaded = [Served("r@v3-a", 3, Path("a"), dead), Served("r@v4-b", 4, Path("b"), dead)]
    # The trainer resumed from checkpoint 3 and published up to 8 before this swap: the dead
    # one's 4 goes, its 3 (the checkpoint's own version, which the resumed one took over) stays.
    assert [s.name for s in superseded(loaded, "r@v8-c", 8, resumed)] == ["r@v4-b"]
    # The resumed trainer's own versions move forward as any lineage's.
    own = [loaded[0], Served("r@v7-d", 7, Path("d"), resumed)]
    assert superseded(own, "r@v8-c", 8, resumed) == []


def test_a_version_names_the_trainer_start_that_published_it() -> None:
    assert publisher_of({"uid": "u", "lineage_id": "abc", "lineage": 3}) == ("abc", 3)
    assert publisher_of({"uid": "u"}) is None  # a resume checkpoint, a bare adapter
