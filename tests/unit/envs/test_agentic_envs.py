"""The agentic built-ins (tool-math, corpus-search, wordle): their tools and rules, and that a
demonstration replayed as a rollout is the same token sequence SFT trains on, with the
environment's tokens (tool results, marks) masked out of the loss."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from engine.config.orchestrator import EnvConfig, SamplingConfig
from engine.envs import assemble, corpus_search, load_environment, tool_math, wordle
from engine.trainer.sft_data import tokenize_conversation

SAMPLING = SamplingConfig(max_tokens=128)
_ASSISTANT = re.compile(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", re.DOTALL)


def test_calc_computes_integer_arithmetic_and_runs_nothing_else() -> None:
    assert tool_math.calc("347 * 29 + 15") == str(347 * 29 + 15)
    assert tool_math.calc(" -3 * (2 - 5) ") == "9"
    for hostile in ("__import__('os').system('true')", "2 ** 10", "7 / 2", "x + 1", "1.5 * 2"):
        assert tool_math.calc(hostile) == "error: only integers, + - * and parentheses"
    assert tool_math.calc("99999999 * 99999999") == "error: result too large"
    assert tool_math.calc("1 + " * 20 + "1").startswith("error: longer than 64")
    assert tool_math.calc("(1 +").startswith("error: ")


def test_tool_math_problems_need_the_tool_and_their_expressions_give_the_answer() -> None:
    train, held_out = tool_math.make_splits(500, 50, seed=1)
    assert (train, held_out) == tool_math.make_splits(500, 50, seed=1)
    assert tool_math.make_splits(10, 50, seed=2)[1] == held_out
    assert not {q for q, _, _ in train} & {q for q, _, _ in held_out}
    for question, expression, answer in train:
        assert tool_math.calc(expression) == str(answer) and answer >= 0
        # The expression is the question's numbers, and always a product of two-digit ones or
        # more: arithmetic a tiny model cannot do in its head.
        assert sorted(re.findall(r"\d+", expression)) == sorted(re.findall(r"\d+", question))
        assert re.search(r"\d\d+ \* \d\d+", expression)


def test_corpus_search_finds_the_asked_town_first_and_splits_towns() -> None:
    pages = corpus_search.corpus()
    assert len({page.town for page in pages}) == len(pages) == 160
    for page in pages:
        found = corpus_search.search(f"Who is the mayor of {page.town}?").splitlines()
        assert found[0] == page.title and len(found) == corpus_search.TOP_K
        assert corpus_search.read(page.title) == page.text
    assert corpus_search.search("zzz") == "no pages found"
    assert corpus_search.read("Nowhere").startswith("no page titled")
    train, held_out = corpus_search.make_splits(360, 120, seed=0)
    assert not {p.town for _, p, _ in train} & {p.town for _, p, _ in held_out}
    assert all(answer in page.text for _, page, answer in train + held_out)
    with pytest.raises(ValueError, match="360 train and 120 held-out"):
        corpus_search.make_splits(361, 10, seed=0)


def test_a_larger_corpus_starts_with_the_default_one_and_its_tools_search_it() -> None:
    default, larger = corpus_search.corpus(), corpus_search.corpus(len(corpus_search.MIDDLES))
    assert larger[: len(default)] == default  # every measurement's corpus, unchanged
    assert len({page.town for page in larger}) == len(larger) == 8 * 160
    search, read = corpus_search.tools(len(corpus_search.MIDDLES))
    for page in larger[::37]:
        assert search(f"What is {page.town} known for?").splitlines()[0] == page.title
        assert read(page.title) == page.text
    assert corpus_search.read(larger[-1].title).startswith("no page titled")  # not in 160
    train, held_out = corpus_search.make_splits(2880, 960, seed=0, middles=8)
    assert not {p.town for _, p, _ in train} & {p.town for _, p, _ in held_out}
    rows = corpus_search.sft_examples(4, middles=8)
    assert rows[0]["tools"] == corpus_search.sft_examples(4)[0]["tools"]  # same schemas
    with pytest.raises(ValueError, match="1 to 8 middle syllables"):
        corpus_search.corpus(9)


def test_wordle_marks_follow_the_game_with_repeated_letters() -> None:
    assert wordle.marks("bank", "bark") == "BA.K"
    assert wordle.marks("ball", "lamb") == "bAl."  # one l elsewhere, the second l absent
    assert wordle.marks("loop", "pool") == "lOOp"
    assert wordle.marks("tool", "tool") == "TOOL"
    game = (("bank", "bark", "dark"), "bark")
    assert wordle.consistent(game[0], [("bank", wordle.marks("bank", "bark"))]) == ["bark"]
    assert wordle.feedback("dark", game) == "dark: .ARK"
    assert wordle.feedback("park", game) == "park is not one of the words."
    assert wordle.feedback(None, game).startswith("No guess found")
    assert wordle.score(["bank", "bark"], "bark", 4) == 0.75
    assert wordle.score(["bank", None], "bark", 4) == 0.0


def test_wordle_games_are_disjoint_and_hold_their_secret() -> None:
    train, held_out = wordle.make_splits(300, 40, seed=0, num_candidates=6)
    assert not set(train) & set(held_out)
    for candidates, secret in train:
        assert secret in candidates and len(set(candidates)) == 6
        assert all(len(word) == 4 for word in candidates)


def _replay(row_text: str) -> Any:
    """A policy that writes the demonstration's assistant turns in order, one per model call."""
    replies = _ASSISTANT.findall(row_text)

    def reply(prompt: str) -> str:
        return replies[prompt.count("<|im_start|>assistant\n") - 1]

    return reply


def _demonstrated_reward(module: Any, row: dict[str, Any], payload: dict[str, Any]) -> float:
    """What the demonstration earns: the answer (1), or a wordle game by its guesses."""
    if module is not wordle:
        return 1.0
    replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
    guesses = [wordle.parse_guess(reply) for reply in replies]
    candidates = tuple(payload["info"]["candidates"])
    return wordle.game_reward(guesses, candidates, payload["answer"], 4)


@pytest.mark.parametrize(
    ("env_id", "module", "args"),
    [
        ("tool-math", tool_math, {"num_train_examples": 6}),
        ("corpus-search", corpus_search, {"num_train_examples": 6}),
        ("corpus-search", corpus_search, {"num_train_examples": 6, "middles": 8}),
        ("wordle", wordle, {"num_train_examples": 6}),
    ],
)
def test_a_demonstration_replayed_is_the_rollout_sft_trains_on(
    env_id: str, module: Any, args: dict[str, Any], hf_tokenizer: Any, policy: Any, generator: Any
) -> None:
    env = load_environment(EnvConfig(id=env_id, args=args))
    sft_args = {key: value for key, value in args.items() if key != "num_train_examples"}
    rows = module.sft_examples(num_examples=6, **sft_args)
    for index, row in enumerate(rows):
        sft_ids, sft_mask = tokenize_conversation(
            hf_tokenizer, row["messages"], f"row {index}", row.get("tools")
        )
        oracle = policy(_replay(hf_tokenizer.decode(sft_ids)))
        task = env.tasks("train")[index]
        (rollout,) = asyncio.run(env.run_group(task, 1, generator(oracle, 2048), SAMPLING))
        assert rollout.error is None
        assert rollout.reward == _demonstrated_reward(module, row, task.payload)
        (sequence,) = assemble(rollout.turns)  # one sequence: nothing re-rendered
        # SFT's rendering ends with the template's newline after the last turn's end token.
        assert sequence.token_ids == sft_ids[:-1]
        newline = hf_tokenizer.convert_tokens_to_ids("\n")
        for position, (trained, demonstrated) in enumerate(
            zip(sequence.loss_mask, sft_mask, strict=False)
        ):
            # RL trains what the model sampled; SFT also the newline closing each of its turns.
            assert trained == demonstrated or (demonstrated and sft_ids[position] == newline)
        environment_text = hf_tokenizer.decode(
            [t for t, m in zip(sequence.token_ids, sequence.loss_mask, strict=True) if not m]
        )
        for message in row["messages"]:
            if message["role"] in ("tool", "user"):
                assert message["content"] in environment_text  # masked, never trained


def _calling(expression: str, answer: str) -> list[dict[str, Any]]:
    """A tool-math completion: one `calc` call of `expression`, then `answer` in tags."""
    call = {"id": "call_0", "name": "calc", "arguments": f'{{"expression": "{expression}"}}'}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": tool_math.calc(expression), "tool_call_id": "call_0"},
        {"role": "assistant", "content": f"<answer>{answer}</answer>"},
    ]


def test_tool_math_credits_a_wrong_answer_by_the_numbers_its_call_copied() -> None:
    reward = tool_math.answer_or_operands
    info = {"expression": "381 * 24"}
    assert reward(_calling("381 * 24", "9144"), "9144", info) == 1.0
    right_call = reward(_calling("381 * 24", "9000"), "9144", info)
    one_number = reward(_calling("381 * 42", "16002"), "9144", info)
    same_shape = reward(_calling("729 * 86", "62694"), "9144", info)
    padded = reward(_calling("381 * 24 + 24 * 381", "1"), "9144", info)
    assert right_call == tool_math.OPERAND_CREDIT  # the tool was asked right, copied wrong
    assert one_number == tool_math.OPERAND_CREDIT / 2
    assert same_shape == 0.0  # the call's shape alone, which SFT teaches, earns nothing
    assert padded == tool_math.OPERAND_CREDIT / 2  # extra numbers do not pay
    no_call = [{"role": "assistant", "content": "<answer>9000</answer>"}]
    assert reward(no_call, "9144", info) == 0.0
    malformed = _calling("381 * 24", "9000")
    malformed[0]["tool_calls"][0]["arguments"] = "not json"
    assert reward(malformed, "9144", info) == 0.0


def test_a_tool_math_rollout_with_a_miscopied_operand_earns_partial_credit(
    policy: Any, generator: Any
) -> None:
    env = load_environment(EnvConfig(id="tool-math", args={"num_train_examples": 1}))
    task = env.tasks("train")[0]
    _, expression, answer = tool_math.make_splits(1, 0, seed=0)[0][0]
    first = expression.split()[0]
    miscopied = expression.replace(first, str(int(first) + 1), 1)
    call = json.dumps({"name": "calc", "arguments": {"expression": miscopied}})

    def reply(prompt: str) -> str:
        first_turn = prompt.count("<|im_start|>assistant\n") == 1
        return f"<tool_call>{call}</tool_call>" if first_turn else "<answer>1</answer>"

    (rollout,) = asyncio.run(env.run_group(task, 1, generator(policy(reply), 2048), SAMPLING))
    assert rollout.error is None and answer != 1
    expected = tool_math.OPERAND_CREDIT * (1 - 1 / len(expression.split()[::2]))
    assert rollout.reward == pytest.approx(expected) and 0.0 < expected < 0.5


def test_corpus_search_credits_reading_the_page_or_a_slip_in_copying_not_a_guess() -> None:
    def answering(text: str, *reads: str) -> list[dict[str, Any]]:
        calls = [
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"call_{i}", "name": "read", "arguments": json.dumps({"title": title})}
            ]}
            for i, title in enumerate(reads)
        ]  # fmt: skip
        return [*calls, {"role": "assistant", "content": text}]

    reward = corpus_search.near_fact
    info = {"title": "Ambrook (north)"}
    assert reward(answering("<answer>Mayor Ada Vale</answer>"), "mayor ada vale", info) == 1.0
    slip = reward(answering("<answer>mayor ada vole</answer>"), "mayor ada vale", info)
    assert corpus_search.NEAR_CREDIT > slip > corpus_search.NEAR_CREDIT * corpus_search.READ_SHARE
    # A short string that shares letters with the fact earned ~0.14 and RL learnt to answer it
    assert reward(answering("<answer>oan</answer>"), "good", info) == 0.0
    read_right = reward(answering("<answer>oan</answer>", "Ambrook (north) "), "good", info)
    # The right town read with the region half-copied from the search's answer earns a part
    read_near = reward(answering("<answer>oan</answer>", "Ambrook (south)"), "good", info)
    read_other = reward(answering("<answer>oan</answer>", "Belford (south)"), "good", info)
    assert read_right == corpus_search.NEAR_CREDIT * corpus_search.READ_SHARE
    assert read_right > read_near > read_other == 0.0
    best_of_two = answering("<answer>oan</answer>", "Belford (south)", "Ambrook (nort)")
    assert read_right > reward(best_of_two, "good", info) > read_near
    assert reward(answering("mayor ada vale"), "mayor ada vale", info) == 0.0  # untagged
    assert corpus_search.exact_fact(answering("<answer>mayor ada vole</answer>"), "x") == 0.0


def test_a_lost_wordle_game_earns_less_than_any_win_and_more_for_legal_guesses() -> None:
    candidates = ("bank", "bark", "cork", "fork", "wink", "tank")
    assert wordle.game_reward(["cork", "tank"], candidates, "tank", 2) == 0.5  # last-guess win
    informed = wordle.game_reward(["cork", "bank"], candidates, "tank", 2)  # both allowed
    off_list = wordle.game_reward(["cork", "zzzz"], candidates, "tank", 2)
    assert (informed, off_list) == (0.25, 0.125)
    assert wordle.game_reward([None, None], candidates, "tank", 2) == 0.0
