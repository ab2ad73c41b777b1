"""Task order: seeded epochs per environment, environments mixed exactly by ratio."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from engine.config.orchestrator import EnvConfig, SamplingConfig
from engine.envs import EnvMix, MixEntry, Task, load_environment
from engine.envs.mix import TaskStream, pick_by_ratio


@given(
    ratios=st.lists(st.floats(0.05, 20), min_size=1, max_size=5),
    draws=st.integers(1, 300),
)
def test_picks_stay_close_to_each_share_at_every_draw(ratios: list[float], draws: int) -> None:
    counts = [0] * len(ratios)
    for made in range(1, draws + 1):
        counts[pick_by_ratio(counts, ratios)] += 1
        for count, ratio in zip(counts, ratios, strict=True):
            assert abs(count - made * ratio / sum(ratios)) < 2


def _tasks(n: int) -> list[Task]:
    return [Task(env="e", example_id=i, prompt=[], payload=None) for i in range(n)]


def test_each_epoch_is_a_seeded_permutation() -> None:
    stream = TaskStream(_tasks(5), seed=1)
    epochs = [[stream.next().example_id for _ in range(5)] for _ in range(3)]
    assert all(sorted(epoch) == list(range(5)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) > 1
    again = TaskStream(_tasks(5), seed=1)
    assert [again.next().example_id for _ in range(15)] == [i for e in epochs for i in e]
    assert stream.epoch == 2


def test_mix_draws_environments_by_ratio_with_their_sampling() -> None:
    small = {"num_train_examples": 6, "num_eval_examples": 2}
    hot, cold = SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.5)
    mix = EnvMix(
        [
            MixEntry(load_environment(EnvConfig(id="reverse-text", args=small)), 3.0, hot),
            MixEntry(load_environment(EnvConfig(id="arithmetic", args=small)), 1.0, cold),
        ],
        seed=0,
    )
    drawn = [mix.next()[1:] for _ in range(40)]
    assert Counter(task.env for _, task in drawn) == {"reverse-text": 30, "arithmetic": 10}
    assert all(entry.env.name == task.env for entry, task in drawn)
    assert {entry.sampling.temperature for entry, task in drawn if task.env == "arithmetic"} == {
        0.5
    }
    # Given what landed (trained or on its way), the environment behind its share is drawn,
    # however often it was drawn before: its dropped groups are made up for.
    assert mix.next(landed=[30, 2])[0] == 1
    # A resume advances each task stream by its own draws: the same tasks come next.
    again = EnvMix(mix.entries, seed=0)
    again.skip(mix.counts)
    assert again.next(landed=[0, 1])[2] == mix.next(landed=[0, 1])[2]
    assert again.counts == mix.counts
