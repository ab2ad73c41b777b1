"""tool-math: word problems with numbers too big for mental arithmetic, and a calculator tool.

Each problem needs one expression of two or three operands (`347 * 29 + 15`), which the model
writes out of the words into a `calc` call, then it copies the tool's result into `<answer>`
tags. The reward is 1 when the tagged integer is exactly right; a wrong answer earns up to
`OPERAND_CREDIT` for the share of the problem's numbers its best `calc` call holds
(`exact_answer` is logged beside it). The skill RL can add is copying the numbers out of the
words into the call; the tool does the arithmetic. With an all-or-nothing reward a model that
got no problem exact after SFT left RL no signal (issue 31); a credit by the expression's
character similarity paid ~0.25 for the call's shape alone (`dddd - dd * dd`), which SFT
already teaches, so the digits that matter moved it little. `calc` is a sandbox: it walks the
expression's syntax tree and computes only integer `+ - *` and parentheses, so a policy's call
can never run code. Drawn deterministically; eval never shares a problem with train. SFT rows
(`sft_examples`) are whole tool conversations: call, result, answer.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import verifiers as vf

from engine.envs.arithmetic import exact_answer
from engine.envs.chat import (
    called_arguments,
    single_turn_prompt,
    tool_call,
    tool_result,
    tool_schemas,
)
from engine.envs.words import NAMES, disjoint_splits

SYSTEM_PROMPT = "Use the calc tool for the arithmetic, then give the number in <answer> tags."
ITEMS = ("jar", "bag", "seed", "nail", "tile", "cup")
#: The most characters `calc` reads, and the largest magnitude it computes.
MAX_EXPRESSION = 64
MAX_VALUE = 10**12
#: The most a wrong answer earns: this times the share of the problem's numbers in its best call.
OPERAND_CREDIT = 0.5
_NUMBER = re.compile(r"\d+")
_OPERATORS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        result = _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
        if abs(result) > MAX_VALUE:
            raise ValueError("result too large")
        return result
    raise ValueError("only integers, + - * and parentheses")


def calc(expression: str) -> str:
    """Evaluate integer arithmetic with + - * and parentheses.

    Args:
        expression: e.g. "347 * 29"
    """
    if len(expression) > MAX_EXPRESSION:
        return f"error: longer than {MAX_EXPRESSION} characters"
    try:
        return str(_value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as exc:
        return f"error: {exc.msg if isinstance(exc, SyntaxError) else exc}"


#: A problem: its question, the expression that answers it, and the answer.
Problem = tuple[str, str, int]


def _crates(rng: random.Random) -> Problem:
    item, a, b = rng.choice(ITEMS), rng.randint(101, 999), rng.randint(11, 99)
    return f"A crate holds {a} {item}s. How many {item}s are in {b} crates?", f"{a} * {b}", a * b


def _bought(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(11, 99), rng.randint(101, 999), rng.randint(11, 99)
    question = f"{name} buys {a} {item}s at {b} coins each and pays {c} coins more. Total?"
    return question, f"{a} * {b} + {c}", a * b + c


def _spent(rng: random.Random) -> Problem:
    name, a, b = rng.choice(NAMES), rng.randint(11, 99), rng.randint(11, 99)
    c = rng.randint(a * b + 1, a * b + 999)
    question = f"{name} has {c} coins and spends {a} coins a day for {b} days. How many are left?"
    return question, f"{c} - {a} * {b}", c - a * b


TEMPLATES = (_crates, _bought, _spent)


def draw_problem(rng: random.Random) -> Problem:
    """One (question, expression, answer) triple."""
    return rng.choice(TEMPLATES)(rng)


def make_splits(num_train: int, num_eval: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """Disjoint (train, eval) problems: `seed` draws train; eval is the same for every seed."""
    return disjoint_splits(num_train, num_eval, seed, draw_problem, key=lambda problem: problem[0])


def sft_examples(
    num_examples: int, seed: int = 0, system_prompt: str = SYSTEM_PROMPT
) -> list[dict[str, Any]]:
    """Gold tool conversations on train-split problems: the `calc` call with the problem's
    expression, its result, and the answer."""
    train, _ = make_splits(num_examples, 0, seed)
    tools = tool_schemas([calc])
    return [
        {
            "messages": [
                *single_turn_prompt(question, system_prompt),
                tool_call("call_0", "calc", expression=expression),
                tool_result("call_0", calc(expression)),
                {"role": "assistant", "content": f"<answer>{answer}</answer>"},
            ],
            "tools": tools,
        }
        for question, expression, answer in train
    ]


def operand_share(called: str, expression: str) -> float:
    """The share of `expression`'s numbers that `called` holds, counted with multiplicity and
    over the larger of the two counts, so a call padded with extra numbers earns no more."""
    have, want = Counter(_NUMBER.findall(called)), Counter(_NUMBER.findall(expression))
    larger = max(sum(have.values()), sum(want.values()))
    return sum((have & want).values()) / larger if larger else 0.0


def answer_or_operands(completion: Any, answer: str, info: dict[str, Any], **_: Any) -> float:
    """1 for the exact answer, else `OPERAND_CREDIT` × the best `calc` call's `operand_share`
    (0 without a call)."""
    if exact_answer(completion, answer):
        return 1.0
    called = called_arguments(completion, "calc", "expression")
    return OPERAND_CREDIT * max(
        (operand_share(expression, info["expression"]) for expression in called), default=0.0
    )


def load_environment(
    num_train_examples: int = 10_000,
    num_eval_examples: int = 512,
    seed: int = 0,
    max_turns: int = 3,
    system_prompt: str = SYSTEM_PROMPT,
) -> vf.Environment:
    """A verifiers tool environment over generated problems, with `calc` as its one tool."""
    from datasets import Dataset

    def rows(problems: list[Problem]) -> Dataset:
        return Dataset.from_list(
            [
                {
                    "prompt": single_turn_prompt(question, system_prompt),
                    "answer": str(answer),
                    "info": {"expression": expression},
                }
                for question, expression, answer in problems
            ]
        )

    def splits() -> tuple[list[Problem], list[Problem]]:
        return make_splits(num_train_examples, num_eval_examples, seed)

    rubric = vf.Rubric(funcs=[answer_or_operands])
    rubric.add_metric(exact_answer)
    return vf.ToolEnv(
        tools=[calc],
        dataset=lambda: rows(splits()[0]),
        eval_dataset=lambda: rows(splits()[1]),
        rubric=rubric,
        max_turns=max_turns,
        pass_threshold=1.0,
    )
