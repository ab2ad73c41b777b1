"""The built-in environments: deterministic disjoint splits, exact rewards, SFT data, oracles."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from typing import Any

import pytest

from engine.config.orchestrator import EnvConfig, SamplingConfig
from engine.envs import (
    alphabet_sort,
    arithmetic,
    assemble,
    load_environment,
    reverse_text,
)
from engine.models.char_tokenizer import CHARACTERS
from tests.unit.envs.conftest import last_user_text

SAMPLING = SamplingConfig(max_tokens=128)


def test_reverse_text_splits_are_deterministic_disjoint_and_eval_is_fixed() -> None:
    train, held_out = reverse_text.make_splits(500, 50, seed=3)
    assert (train, held_out) == reverse_text.make_splits(500, 50, seed=3)
    assert reverse_text.make_splits(20, 50, seed=3)[1] == held_out
    other_train, other_held_out = reverse_text.make_splits(500, 50, seed=4)
    assert other_held_out == held_out and other_train != train
    assert not set(other_train) & set(held_out)
    assert len(set(train)) == 500 and not set(train) & set(held_out)
    assert all(set(text) <= set(CHARACTERS) and 5 <= len(text) <= 40 for text in train)


def test_reverse_text_reward_is_character_similarity_inside_the_tags() -> None:
    assert reverse_text.reversed_similarity("<reversed_text>olleh</reversed_text>", "olleh") == 1.0
    assert reverse_text.reversed_similarity("<reversed_text>olleh", "olleh") == 1.0
    partial = reverse_text.reversed_similarity("<reversed_text>ollxh</reversed_text>", "olleh")
    assert partial == 0.8
    assert reverse_text.reversed_similarity("olleh", "olleh") == 0.0


def test_reverse_text_sft_examples_are_gold_answers_on_the_train_split() -> None:
    rows = reverse_text.sft_examples(num_examples=3000, seed=7)
    train, _ = reverse_text.make_splits(3000, 0, seed=7)
    assert [row["messages"][1]["content"] for row in rows] == train
    _, held_out = reverse_text.make_splits(0, 1024, seed=0)
    assert not set(train) & set(held_out)
    for row in rows:
        system, user, assistant = row["messages"]
        assert system == {"role": "system", "content": reverse_text.SYSTEM_PROMPT}
        assert reverse_text.reversed_similarity(assistant["content"], user["content"][::-1]) == 1


def test_reverse_text_sft_rows_leave_verifiers_message_model_unloaded() -> None:
    """The SFT trainer builds these rows at its start: verifiers' message model (~3 s to import
    on the 2-core machine) is for the rollouts, not for rows without tools."""
    code = (
        "import sys\n"
        "from engine.envs.reverse_text import sft_examples\n"
        "assert sft_examples(4)\n"
        "print(sorted(m for m in sys.modules if m.startswith('verifiers.')))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "verifiers.legacy.types" not in loaded, loaded


def test_alphabet_sort_rewards_each_turn_against_the_growing_sorted_list() -> None:
    turns = [["Zoe", "Al"], ["Max"]]
    assert alphabet_sort.gold_lists(turns) == ["Al\nZoe", "Al\nMax\nZoe"]
    right = ["<sorted>\nAl\nZoe\n</sorted>", "<sorted>Al\nMax\nZoe</sorted>"]
    assert alphabet_sort.turn_similarities(right, turns) == [1.0, 1.0]
    assert alphabet_sort.turn_similarities(right[:1], turns) == [1.0, 0.0]
    assert alphabet_sort.turn_similarities(["Al Zoe", right[1]], turns) == [0.0, 1.0]


def test_alphabet_sort_sft_examples_are_whole_gold_conversations_on_the_train_split() -> None:
    rows = alphabet_sort.sft_examples(num_examples=50, seed=3, num_turns=3)
    train, held_out = alphabet_sort.make_splits(50, 20, 3, num_turns=3, min_names=2, max_names=3)
    for row, turns in zip(rows, train, strict=True):
        messages = row["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * 3
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert alphabet_sort.turn_similarities(replies, turns) == [1.0, 1.0, 1.0]
        assert all(", ".join(names) in messages[2 * i]["content"] for i, names in enumerate(turns))
    assert not {str(t) for t in train} & {str(t) for t in held_out}


def test_alphabet_sort_examples_use_distinct_names_and_disjoint_splits() -> None:
    train, held_out = alphabet_sort.make_splits(200, 20, 0, num_turns=3, min_names=2, max_names=3)
    assert not {str(e) for e in train} & {str(e) for e in held_out}
    for example in train:
        names = [name for turn in example for name in turn]
        assert len(example) == 3 and len(set(names)) == len(names)
        assert all(2 <= len(turn) <= 3 for turn in example)


def test_arithmetic_answers_are_exact() -> None:
    train, held_out = arithmetic.make_splits(300, 30, seed=0)
    assert not {q for q, _, _ in train} & {q for q, _, _ in held_out}
    for question, answer, working in train:
        numbers = [int(n) for n in re.findall(r"\d+", question)]
        if "more" in question:
            assert answer == numbers[0] + numbers[1]
        elif "left" in question:
            assert answer == numbers[0] - numbers[1]
        else:
            assert answer == numbers[0] * numbers[1]
        assert [int(n) for n in re.findall(r"\d+", working)] == [*numbers, answer]
    assert arithmetic.exact_answer([{"role": "assistant", "content": "<answer>12</answer>"}], "12")
    assert not arithmetic.exact_answer([{"role": "assistant", "content": "12"}], "12")


def test_arithmetic_sft_examples_are_worked_gold_answers_on_the_train_split() -> None:
    rows = arithmetic.sft_examples(num_examples=400, seed=5)
    train, held_out = arithmetic.make_splits(400, 512, seed=5)
    assert [row["messages"][1]["content"] for row in rows] == [q for q, _, _ in train]
    assert not {q for q, _, _ in train} & {q for q, _, _ in held_out}
    for row, (_, answer, working) in zip(rows, train, strict=True):
        system, _, reply = row["messages"]
        assert system == {"role": "system", "content": arithmetic.SYSTEM_PROMPT}
        assert reply["content"].startswith(working + "\n")
        assert arithmetic.exact_answer([reply], str(answer)) == 1.0


def test_reverse_text_oracle_scores_one(policy: Any, generator: Any) -> None:
    env = load_environment(EnvConfig(id="reverse-text", args={"num_train_examples": 4}))
    oracle = policy(lambda prompt: reverse_text.format_answer(last_user_text(prompt)))
    rollouts = asyncio.run(env.run_group(env.tasks("train")[2], 4, generator(oracle), SAMPLING))
    assert [r.reward for r in rollouts] == [1.0] * 4


def _sorting_oracle(prompt: str) -> str:
    names = []
    for line in re.findall(r"(?:tags|again): ([^<]*)<\|im_end\|>", prompt):
        names += line.split(", ")
    return "<sorted>\n" + "\n".join(sorted(names)) + "\n</sorted>"


def test_alphabet_sort_oracle_scores_one_over_three_turns_in_one_sequence(
    hf_tokenizer: Any, policy: Any, generator: Any
) -> None:
    env = load_environment(
        EnvConfig(id="alphabet-sort", args={"num_train_examples": 4, "num_turns": 3})
    )
    task = env.tasks("train")[0]
    (rollout,) = asyncio.run(env.run_group(task, 1, generator(policy(_sorting_oracle)), SAMPLING))
    assert rollout.reward == 1.0
    assert [rollout.metrics[f"turn_{i}_similarity"] for i in (1, 2, 3)] == [1.0, 1.0, 1.0]
    (sequence,) = assemble(rollout.turns)
    assert sequence.num_turns == 3
    text = hf_tokenizer.decode(sequence.token_ids)
    assert text.count("<|im_start|>assistant\n<sorted>") == 3
    assert text.count("<|im_start|>user\n") == 3


def test_alphabet_sort_replies_after_its_tool_latency() -> None:
    """`response_delay_s` stands in a slow tool: the next turn's names come no sooner."""
    env = alphabet_sort.load_environment(num_train_examples=4, num_turns=3, response_delay_s=0.2)
    turns = [["Al", "Zoe"], ["Max"], ["Bo"]]
    messages = [{"role": "user", "content": "sort"}, {"role": "assistant", "content": "x"}]
    started = time.monotonic()
    (reply,) = asyncio.run(env.env_response(messages, {"info": {"turns": turns}}))
    assert time.monotonic() - started >= 0.2
    assert "Max" in reply["content"]
    with pytest.raises(ValueError, match="response_delay_s must be >= 0"):
        alphabet_sort.load_environment(response_delay_s=-1)
