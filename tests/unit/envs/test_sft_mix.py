"""`sft.data.env = "sft-mix"`: SFT rows of several environments, each as it draws them alone."""

from __future__ import annotations

import pytest

from engine.envs import alphabet_sort, reverse_text
from engine.envs.sft_mix import sft_examples
from engine.trainer.sft_data import resolve_source


def test_the_mix_alternates_equal_shares_each_drawn_as_alone() -> None:
    rows = sft_examples(7, seed=3, envs=["reverse-text", "alphabet-sort"])
    assert rows[0::2] == reverse_text.sft_examples(4, seed=3)
    assert rows[1::2] == alphabet_sort.sft_examples(3, seed=3)
    assert resolve_source("sft-mix") is sft_examples  # the name configs use


SLOW_ENV = "tests.integration.orchestrator.slow_env"


@pytest.mark.parametrize(
    ("envs", "error"),
    [
        (["reverse-text"], "two environments or more"),
        # a multi-turn test environment with no sft_examples (arithmetic has them now)
        (["reverse-text", SLOW_ENV], f"'{SLOW_ENV}' makes no SFT data"),
        (["reverse-text", "no-such-env"], "'no-such-env' not found"),
    ],
)
def test_a_mix_that_cannot_be_made_names_why(envs: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        sft_examples(8, envs=envs)
