"""arithmetic: small word problems with an exactly checkable integer answer.

Problems come from a few templates (add, take away, multiply) with small numbers, so the
answer is one short integer; the model writes it inside `<answer>` tags and scores 1 when it is
exactly right, 0 otherwise. Drawn deterministically; eval never shares a problem with train.
SFT rows (`sft_examples`) show one line of working before the answer (`12 + 7 = 19`): the
operands copied out of the words put the arithmetic fact beside the answer it decides.
"""

from __future__ import annotations

import random
import re
from typing import Any

import verifiers as vf

from engine.envs.chat import sft_conversation, single_turn_prompt
from engine.envs.words import NAMES, disjoint_splits

SYSTEM_PROMPT = "Solve the problem. Put only the final number in <answer> tags."
ITEMS = ("apple", "book", "coin", "cup", "egg", "pen", "shell", "stamp")
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


#: A problem: its question, its answer, and the one line of working that gives the answer.
Problem = tuple[str, int, str]


def _add(rng: random.Random) -> Problem:
    name, item, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(1, 20), rng.randint(1, 20)
    question = f"{name} has {a} {item}s and gets {b} more. How many {item}s now?"
    return question, a + b, f"{a} + {b} = {a + b}"


def _take(rng: random.Random) -> Problem:
    name, item, a = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 20)
    b = rng.randint(1, a)
    return (
        f"{name} has {a} {item}s and gives away {b}. How many are left?",
        a - b,
        f"{a} - {b} = {a - b}",
    )


def _times(rng: random.Random) -> Problem:
    name, item, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 9), rng.randint(2, 9)
    question = f"{name} buys {a} bags with {b} {item}s each. How many {item}s?"
    return question, a * b, f"{a} x {b} = {a * b}"


TEMPLATES = (_add, _take, _times)


def draw_problem(rng: random.Random) -> Problem:
    """One (question, answer, working) triple."""
    return rng.choice(TEMPLATES)(rng)


def format_answer(problem: Problem) -> str:
    """The gold reply to `problem` (what SFT teaches; it scores 1.0)."""
    _, answer, working = problem
    return f"{working}\n<answer>{answer}</answer>"


def parse_answer(reply: str) -> int | None:
    """The integer in the last `<answer>` tag, if any."""
    found = _ANSWER.findall(reply)
    return int(found[-1]) if found else None


def make_splits(num_train: int, num_eval: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """Disjoint (train, eval) problems: `seed` draws train; eval is the same for every seed."""
    return disjoint_splits(num_train, num_eval, seed, draw_problem, key=lambda problem: problem[0])


def sft_examples(
    num_examples: int, seed: int = 0, system_prompt: str = SYSTEM_PROMPT
) -> list[dict[str, Any]]:
    """Worked gold replies to train-split problems, for SFT warm-up."""
    train, _ = make_splits(num_examples, 0, seed)
    return [
        sft_conversation(single_turn_prompt(problem[0], system_prompt), format_answer(problem))
        for problem in train
    ]


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

    def rows(problems: list[Problem]) -> Dataset:
        # Rows carry their prompt already, so verifiers has no dataset `map` to run.
        return Dataset.from_list(
            [
                {"prompt": single_turn_prompt(question, system_prompt), "answer": str(answer)}
                for question, answer, _ in problems
            ]
        )

    def splits() -> tuple[list[Problem], list[Problem]]:
        return make_splits(num_train_examples, num_eval_examples, seed)

    return vf.SingleTurnEnv(
        dataset=lambda: rows(splits()[0]),
        eval_dataset=lambda: rows(splits()[1]),
        rubric=vf.Rubric(funcs=[exact_answer]),
        pass_threshold=1.0,
    )
