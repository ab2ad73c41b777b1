"""reverse-text: reverse a short text character by character.

The model answers inside `<reversed_text>` tags; the reward is the character-level
`difflib.SequenceMatcher` ratio between the tagged answer and the reversed text, so partly
right answers earn partial credit (a smooth signal a small model can climb). Texts are 2-4 words
from a fixed list, drawn deterministically; the eval split never shares a text with the train
split.
"""

from __future__ import annotations

import difflib
import random
import re
from typing import Any

import verifiers as vf

from engine.envs.chat import sft_conversation, single_turn_prompt
from engine.envs.words import EVAL_RESERVE, EVAL_SEED, distinct_draws, phrase

SYSTEM_PROMPT = "Reverse the text character by character. Put your answer in <reversed_text> tags."
_ANSWER = re.compile(r"<reversed_text>(.*?)(?:</reversed_text>|$)", re.DOTALL)


def format_answer(text: str) -> str:
    """The gold completion for `text` (what SFT teaches and what scores 1.0)."""
    return f"<reversed_text>{text[::-1]}</reversed_text>"


def parse_answer(completion: str) -> str | None:
    """The text inside the first `<reversed_text>` tag (an unclosed tag runs to the end)."""
    match = _ANSWER.search(completion)
    return match.group(1).strip() if match else None


def similarity(answer: str | None, reversed_text: str) -> float:
    """Character-level similarity in [0, 1]; a missing answer scores 0."""
    if answer is None:
        return 0.0
    return difflib.SequenceMatcher(None, answer, reversed_text, autojunk=False).ratio()


def make_splits(
    num_train: int, num_eval: int, seed: int, min_words: int = 2, max_words: int = 4
) -> tuple[list[str], list[str]]:
    """Disjoint (train, eval) texts: `seed` draws train; eval is the same for every seed."""

    def draw(rng: random.Random) -> str:
        return phrase(rng, min_words, max_words)

    reserved = distinct_draws(max(num_eval, EVAL_RESERVE), random.Random(EVAL_SEED), draw)
    eval_texts = reserved[:num_eval]
    train_texts = distinct_draws(num_train, random.Random(seed), draw, exclude=reserved)
    return train_texts, eval_texts


def _last_reply(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    replies = [
        message.get("content") or "" for message in completion if message.get("role") == "assistant"
    ]
    return replies[-1] if replies else ""


def reversed_similarity(completion: Any, answer: str, **_: Any) -> float:
    """Reward: similarity of the tagged answer to the reversed text."""
    return similarity(parse_answer(_last_reply(completion)), answer)


def prompt_messages(text: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """The chat prompt for `text`."""
    return single_turn_prompt(text, system_prompt)


def sft_examples(
    num_examples: int,
    seed: int = 0,
    min_words: int = 2,
    max_words: int = 4,
    system_prompt: str = SYSTEM_PROMPT,
) -> list[dict[str, Any]]:
    """Chat conversations with the gold answer, from the train split, for SFT warm-up."""
    texts, _ = make_splits(num_examples, 0, seed, min_words, max_words)
    return [
        sft_conversation(prompt_messages(text, system_prompt), format_answer(text))
        for text in texts
    ]


def load_environment(
    num_train_examples: int = 10_000,
    num_eval_examples: int = 512,
    min_words: int = 2,
    max_words: int = 4,
    seed: int = 0,
    system_prompt: str = SYSTEM_PROMPT,
) -> vf.Environment:
    """A single-turn verifiers environment over generated texts."""
    from datasets import Dataset

    def rows(texts: list[str]) -> Dataset:
        # Rows carry their prompt already, so verifiers has no dataset `map` to run.
        return Dataset.from_list(
            [
                {"prompt": prompt_messages(text, system_prompt), "answer": text[::-1]}
                for text in texts
            ]
        )

    def splits() -> tuple[list[str], list[str]]:
        return make_splits(num_train_examples, num_eval_examples, seed, min_words, max_words)

    return vf.SingleTurnEnv(
        dataset=lambda: rows(splits()[0]),
        eval_dataset=lambda: rows(splits()[1]),
        rubric=vf.Rubric(funcs=[reversed_similarity]),
    )
