"""alphabet-sort: a multi-turn task that keeps a growing sorted list across turns.

The first user turn gives a few names to sort; every later turn adds names and asks for the whole
list again. Each reply is scored against that turn's sorted list with a character-level
similarity, and the reward is the mean over the turns (a turn never reached scores 0), so every
turn carries credit. Names come from a fixed list, drawn deterministically; the eval split never
shares an example with the train split.
"""

from __future__ import annotations

import asyncio
import difflib
import random
import re
from typing import Any

import verifiers as vf

from engine.envs.words import EVAL_RESERVE, EVAL_SEED, NAMES, distinct_draws

FIRST_PROMPT = "Sort these names alphabetically, one per line, in <sorted> tags: {names}"
NEXT_PROMPT = "Add these names and give the whole sorted list again: {names}"
_ANSWER = re.compile(r"<sorted>(.*?)(?:</sorted>|$)", re.DOTALL)


def parse_sorted(reply: str) -> str | None:
    """The list inside the first `<sorted>` tag, one stripped name per line."""
    match = _ANSWER.search(reply)
    if match is None:
        return None
    return "\n".join(line.strip() for line in match.group(1).splitlines() if line.strip())


def gold_lists(turns: list[list[str]]) -> list[str]:
    """The expected answer of each turn: every name so far, sorted, one per line."""
    seen: list[str] = []
    golds = []
    for names in turns:
        seen.extend(names)
        golds.append("\n".join(sorted(seen)))
    return golds


def turn_similarities(replies: list[str], turns: list[list[str]]) -> list[float]:
    """Similarity of each turn's reply to its sorted list; turns without a reply score 0."""
    scores = []
    for index, gold in enumerate(gold_lists(turns)):
        answer = parse_sorted(replies[index]) if index < len(replies) else None
        if answer is None:
            scores.append(0.0)
        else:
            scores.append(difflib.SequenceMatcher(None, answer, gold, autojunk=False).ratio())
    return scores


def draw_example(
    rng: random.Random, num_turns: int, min_names: int, max_names: int
) -> list[list[str]]:
    """Names for each turn, all distinct within the example."""
    sizes = [rng.randint(min_names, max_names) for _ in range(num_turns)]
    names = rng.sample(NAMES, sum(sizes))
    turns, start = [], 0
    for size in sizes:
        turns.append(names[start : start + size])
        start += size
    return turns


def make_splits(
    num_train: int, num_eval: int, seed: int, num_turns: int, min_names: int, max_names: int
) -> tuple[list[list[list[str]]], list[list[list[str]]]]:
    """Disjoint (train, eval) examples: `seed` draws train; eval is the same for every seed."""

    def draw(rng: random.Random) -> str:
        return "|".join(
            ",".join(names) for names in draw_example(rng, num_turns, min_names, max_names)
        )

    def decode(key: str) -> list[list[str]]:
        return [names.split(",") for names in key.split("|")]

    reserved = distinct_draws(max(num_eval, EVAL_RESERVE), random.Random(EVAL_SEED), draw)
    eval_keys = reserved[:num_eval]
    train_keys = distinct_draws(num_train, random.Random(seed), draw, exclude=reserved)
    return [decode(key) for key in train_keys], [decode(key) for key in eval_keys]


def format_answer(gold: str) -> str:
    """A turn's gold reply (what SFT teaches and what scores 1.0)."""
    return f"<sorted>\n{gold}\n</sorted>"


def sft_examples(
    num_examples: int,
    seed: int = 0,
    num_turns: int = 2,
    min_names: int = 2,
    max_names: int = 3,
) -> list[dict[str, Any]]:
    """Whole conversations with every turn's gold reply, from the train split, for an SFT
    warm-up (each assistant turn is trained on)."""
    train, _ = make_splits(num_examples, 0, seed, num_turns, min_names, max_names)
    rows = []
    for turns in train:
        messages: list[dict[str, str]] = []
        for index, (names, gold) in enumerate(zip(turns, gold_lists(turns), strict=True)):
            prompt = FIRST_PROMPT if index == 0 else NEXT_PROMPT
            messages.append({"role": "user", "content": prompt.format(names=", ".join(names))})
            messages.append({"role": "assistant", "content": format_answer(gold)})
        rows.append({"messages": messages})
    return rows


def _replies(completion: Any) -> list[str]:
    return [
        message.get("content") or "" for message in completion if message.get("role") == "assistant"
    ]


class AlphabetSortEnv(vf.MultiTurnEnv):
    """Serves the next turn's names until the example's turns run out, each reply after
    `response_delay_s` (0 unless a benchmark stands in a slow tool with it)."""

    def __init__(self, *, response_delay_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.response_delay_s = response_delay_s

    async def env_response(
        self, messages: vf.Messages, state: vf.State, **kwargs: Any
    ) -> vf.Messages:
        if self.response_delay_s > 0:
            await asyncio.sleep(self.response_delay_s)
        turns = state["info"]["turns"]
        answered = len(_replies(messages))
        return [vf.UserMessage(content=NEXT_PROMPT.format(names=", ".join(turns[answered])))]


def _rubric(num_turns: int) -> vf.Rubric:
    def mean_similarity(completion: Any, info: dict[str, Any], **_: Any) -> float:
        scores = turn_similarities(_replies(completion), info["turns"])
        return sum(scores) / len(scores)

    rubric = vf.Rubric(funcs=[mean_similarity])
    for index in range(num_turns):

        def turn_metric(
            completion: Any, info: dict[str, Any], index: int = index, **_: Any
        ) -> float:
            return turn_similarities(_replies(completion), info["turns"])[index]

        turn_metric.__name__ = f"turn_{index + 1}_similarity"
        rubric.add_metric(turn_metric)
    return rubric


def load_environment(
    num_train_examples: int = 10_000,
    num_eval_examples: int = 512,
    num_turns: int = 2,
    min_names: int = 2,
    max_names: int = 3,
    seed: int = 0,
    response_delay_s: float = 0.0,
) -> vf.Environment:
    """A multi-turn verifiers environment over generated name lists. `response_delay_s`:
    seconds each environment reply waits, the latency of a slow tool (for benchmarks of
    long agentic rollouts: tests/bench/e2e/bench_agentic.py)."""
    from datasets import Dataset

    if num_turns < 1 or not 1 <= min_names <= max_names or num_turns * max_names > len(NAMES):
        raise ValueError("need num_turns >= 1, 1 <= min_names <= max_names, and enough names")
    if response_delay_s < 0:
        raise ValueError(f"response_delay_s must be >= 0 (got {response_delay_s})")

    def rows(examples: list[list[list[str]]]) -> Dataset:
        return Dataset.from_list(
            [
                {
                    "prompt": [
                        {"role": "user", "content": FIRST_PROMPT.format(names=", ".join(turns[0]))}
                    ],
                    "answer": gold_lists(turns)[-1],
                    "info": {"turns": turns},
                }
                for turns in examples
            ]
        )

    def splits() -> tuple[list[list[list[str]]], list[list[list[str]]]]:
        return make_splits(
            num_train_examples, num_eval_examples, seed, num_turns, min_names, max_names
        )

    return AlphabetSortEnv(
        dataset=lambda: rows(splits()[0]),
        eval_dataset=lambda: rows(splits()[1]),
        rubric=_rubric(num_turns),
        max_turns=num_turns,
        response_delay_s=response_delay_s,
    )
