"""arithmetic: small word problems with an exactly checkable integer answer.

Problems come from a few templates (add, take away, multiply) with small numbers, so the
answer is one short integer; the model writes it inside `<answer>` tags and scores 1 when it is
exactly right, 0 otherwise. Drawn deterministically; eval never shares a problem with train.
"""

from __future__ import annotations

import random
import re
from typing import Any

import verifiers as vf

from engine.envs.words import EVAL_RESERVE, EVAL_SEED, NAMES, distinct_draws

SYSTEM_PROMPT = "Solve the problem. Put only the final number in <answer> tags."
ITEMS = ("apple", "book", "coin", "cup", "egg", "pen", "shell", "stamp")
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def _add(rng: random.Random) -> tuple[str, int]:
    name, item, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(1, 20), rng.randint(1, 20)
    return f"{name} has {a} {item}s and gets {b} more. How many {item}s now?", a + b


def _take(rng: random.Random) -> tuple[str, int]:
    name, item, a = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 20)
    b = rng.randint(1, a)
    return f"{name} has {a} {item}s and gives away {b}. How many are left?", a - b


def _times(rng: random.Random) -> tuple[str, int]:
    name, item, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 9), rng.randint(2, 9)
    return f"{name} buys {a} bags with {b} {item}s each. How many {item}s?", a * b


TEMPLATES = (_add, _take, _times)


def draw_problem(rng: random.Random) -> tuple[str, int]:
    """One (question, answer) pair."""
    return rng.choice(TEMPLATES)(rng)


def parse_answer(reply: str) -> int | None:
    """The integer in the last `<answer>` tag, if any."""
    found = _ANSWER.findall(reply)
    return int(found[-1]) if found else None


def make_splits(num_train: int, num_eval: int, seed: int) -> tuple[list[tuple[str, int]], ...]:
    """Disjoint (train, eval) problems: `seed` draws train; eval is the same for every seed."""
    answers: dict[str, int] = {}

    def draw(rng: random.Random) -> str:
        question, answer = draw_problem(rng)
        answers[question] = answer
        return question

    reserved = distinct_draws(max(num_eval, EVAL_RESERVE), random.Random(EVAL_SEED), draw)
    eval_questions = reserved[:num_eval]
    train_questions = distinct_draws(num_train, random.Random(seed), draw, exclude=reserved)
    return (
        [(question, answers[question]) for question in train_questions],
        [(question, answers[question]) for question in eval_questions],
    )


def exact_answer(completion: Any, answer: str, **_: Any) -> float:
    """Reward: 1 when the tagged integer equals the answer."""
    replies = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    parsed = parse_answer(replies[-1]) if replies else None
    return float(parsed is not None and parsed == int(answer))


def load_environment(
    num_train_examples: int = 10_000,
    num_eval_examples: int = 512,
    seed: int = 0,
    system_prompt: str = SYSTEM_PROMPT,
) -> vf.Environment:
    """A single-turn verifiers environment over generated word problems."""
    from datasets import Dataset

    def rows(problems: list[tuple[str, int]]) -> Dataset:
        # Rows carry their prompt already, so verifiers has no dataset `map` to run.
        return Dataset.from_list(
            [
                {
                    "prompt": [
                        {"role": "system", "content": system_prompt},
                        {"role": "user", "content": question},
                    ],
                    "answer": str(answer),
                }
                for question, answer in problems
            ]
        )

    def splits() -> tuple[list[tuple[str, int]], ...]:
        return make_splits(num_train_examples, num_eval_examples, seed)

    return vf.SingleTurnEnv(
        dataset=lambda: rows(splits()[0]),
        eval_dataset=lambda: rows(splits()[1]),
        rubric=vf.Rubric(funcs=[exact_answer]),
        pass_threshold=1.0,
    )
