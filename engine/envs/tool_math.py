"""tool-math: word problems with numbers too big for mental arithmetic, and a calculator tool.

Each problem needs one expression of two or three operands (`347 * 29 + 15`), which the model
writes out of the words into a `calc` call, then it copies the tool's result into `<answer>`
tags. The reward is 1 when the tagged integer is exactly right. The skill RL can add is the
translation from words to the expression; the tool does the arithmetic. `calc` is a sandbox:
it walks the expression's syntax tree and computes only integer `+ - *` and parentheses, so a
policy's call can never run code. Drawn deterministically; eval never shares a problem with
train. SFT rows (`sft_examples`) are whole tool conversations: call, result, answer.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable
from typing import Any

import verifiers as vf

from engine.envs.arithmetic import exact_answer
from engine.envs.chat import single_turn_prompt, tool_call, tool_result, tool_schemas
from engine.envs.words import NAMES, disjoint_splits

SYSTEM_PROMPT = "Use the calc tool for the arithmetic, then give the number in <answer> tags."
ITEMS = ("jar", "bag", "seed", "nail", "tile", "cup")
#: The most characters `calc` reads, and the largest magnitude it computes.
MAX_EXPRESSION = 64
MAX_VALUE = 10**12
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
                {"prompt": single_turn_prompt(question, system_prompt), "answer": str(answer)}
                for question, _, answer in problems
            ]
        )

    def splits() -> tuple[list[Problem], list[Problem]]:
        return make_splits(num_train_examples, num_eval_examples, seed)

    return vf.ToolEnv(
        tools=[calc],
        dataset=lambda: rows(splits()[0]),
        eval_dataset=lambda: rows(splits()[1]),
        rubric=vf.Rubric(funcs=[exact_answer]),
        max_turns=max_turns,
        pass_threshold=1.0,
    )
