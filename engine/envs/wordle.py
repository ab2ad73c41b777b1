"""wordle: a multi-turn guessing game with feedback on every guess.

The secret is one of a few four-letter words listed in the prompt. After each guess the
environment answers with Wordle's marks, one character per letter: the letter in capitals where
it is in the right place, in small letters where the secret has it elsewhere, `.` where the
secret does not have it (`bank` against `bark`: `BA.K`). The game ends when the secret is
guessed or the turns run out; a win on guess g of `max_turns` scores `(max_turns - g + 1) /
max_turns`, so RL is paid for guesses that narrow the candidates fastest. A loss earns at most
half a last-guess win, for the share of its guesses that every earlier mark allowed (legal,
informed play): with a loss worth 0 the models here, whose guesses were rarely words of the
list, lost every game of a group alike and RL had nothing to compare (issue 31). The
demonstrations (`sft_examples`) play a candidate consistent with every mark so far, chosen at
random: a legal but not a clever player, which leaves RL the choice of guess to improve.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from typing import Any

import verifiers as vf

from engine.envs.words import WORDS, disjoint_splits

RULES = (
    "Find the secret word. It is one of: {candidates}. After each guess you see it marked: "
    "a capital where the letter is right, a small letter where it is elsewhere in the word, "
    ". where the word lacks it. Reply with one guess in <guess> tags."
)
FOUR_LETTER = tuple(word for word in WORDS if len(word) == 4)
_GUESS = re.compile(r"<guess>\s*([a-z]+)\s*</guess>")

#: A game: the candidates in the order the prompt lists them, and the secret among them.
Game = tuple[tuple[str, ...], str]


def marks(guess: str, secret: str) -> str:
    """Wordle's feedback for `guess` against `secret` (same length). A letter the guess repeats
    is marked elsewhere only as often as the secret holds it beyond its exact matches."""
    left = Counter(s for g, s in zip(guess, secret, strict=True) if g != s)
    out = []
    for g, s in zip(guess, secret, strict=True):
        if g == s:
            out.append(g.upper())
        elif left[g] > 0:
            left[g] -= 1
            out.append(g)
        else:
            out.append(".")
    return "".join(out)


def consistent(candidates: tuple[str, ...], history: list[tuple[str, str]]) -> list[str]:
    """The candidates that every (guess, marks) so far allows, in the prompt's order."""
    return [
        word for word in candidates if all(marks(guess, word) == seen for guess, seen in history)
    ]


def parse_guess(reply: str) -> str | None:
    """The word in the first `<guess>` tag, if any."""
    match = _GUESS.search(reply)
    return match.group(1) if match else None


def draw_game(rng: random.Random, num_candidates: int) -> Game:
    """Candidates that share letters with the secret (so marks tell them apart gradually)."""
    secret = rng.choice(FOUR_LETTER)
    related = [w for w in FOUR_LETTER if w != secret and len(set(w) & set(secret)) >= 2]
    others = rng.sample(related, min(len(related), num_candidates - 1))
    rest = [w for w in FOUR_LETTER if w != secret and w not in others]
    others += rng.sample(rest, num_candidates - 1 - len(others))
    candidates = [secret, *others]
    rng.shuffle(candidates)
    return tuple(candidates), secret


def make_splits(
    num_train: int, num_eval: int, seed: int, num_candidates: int
) -> tuple[list[Game], list[Game]]:
    """Disjoint (train, eval) games: `seed` draws train; eval is the same for every seed."""
    return disjoint_splits(
        num_train,
        num_eval,
        seed,
        lambda rng: draw_game(rng, num_candidates),
        key=lambda game: f"{','.join(game[0])}:{game[1]}",
    )


def game_prompt(game: Game) -> list[dict[str, str]]:
    return [{"role": "user", "content": RULES.format(candidates=", ".join(game[0]))}]


def feedback(guess: str | None, game: Game) -> str:
    """The environment's reply to one model turn."""
    candidates, secret = game
    if guess is None:
        return "No guess found: reply with <guess>word</guess>."
    if guess not in candidates:
        return f"{guess} is not one of the words."
    return f"{guess}: {marks(guess, secret)}"


def _guesses(completion: Any) -> list[str | None]:
    return [
        parse_guess(message.get("content") or "")
        for message in completion
        if message.get("role") == "assistant"
    ]


def score(guesses: list[str | None], secret: str, max_turns: int) -> float:
    """`(max_turns - g + 1) / max_turns` for a win on guess g, else 0."""
    if secret not in guesses:
        return 0.0
    return (max_turns - guesses.index(secret)) / max_turns


def consistent_share(guesses: list[str | None], candidates: tuple[str, ...], secret: str) -> float:
    """Of the guesses, the share that every earlier mark allowed (0 without a guess)."""
    history: list[tuple[str, str]] = []
    allowed = 0
    for guess in guesses:
        allowed += guess in consistent(candidates, history)
        if guess is not None and guess in candidates:
            history.append((guess, marks(guess, secret)))
    return allowed / len(guesses) if guesses else 0.0


def game_reward(
    guesses: list[str | None], candidates: tuple[str, ...], secret: str, max_turns: int
) -> float:
    """`score` for a win; a loss, half a last-guess win times its `consistent_share`."""
    if secret in guesses:
        return score(guesses, secret, max_turns)
    return 0.5 / max_turns * consistent_share(guesses, candidates, secret)


def sft_examples(
    num_examples: int, seed: int = 0, num_candidates: int = 6, max_turns: int = 4
) -> list[dict[str, Any]]:
    """Whole games played by a random consistent player, from the train split (each guess is
    trained on; the marks are the environment's)."""
    train, _ = make_splits(num_examples, 0, seed, num_candidates)
    rng = random.Random(seed)
    rows = []
    for game in train:
        messages: list[dict[str, str]] = game_prompt(game)
        history: list[tuple[str, str]] = []
        for _ in range(max_turns):
            guess = rng.choice(consistent(game[0], history))
            messages.append({"role": "assistant", "content": f"<guess>{guess}</guess>"})
            if guess == game[1]:
                break
            history.append((guess, marks(guess, game[1])))
            messages.append({"role": "user", "content": feedback(guess, game)})
        rows.append({"messages": messages})
    return rows


class WordleEnv(vf.MultiTurnEnv):
    """Marks each guess until the secret is found or the turns run out."""

    @vf.stop
    async def solved(self, state: vf.State) -> bool:
        if not state["trajectory"]:
            return False
        reply = state["trajectory"][-1]["completion"][-1]
        secret: str = state["info"]["secret"]
        return parse_guess(reply.get("content") or "") == secret

    async def env_response(
        self, messages: vf.Messages, state: vf.State, **kwargs: Any
    ) -> vf.Messages:
        info = state["info"]
        guess = parse_guess(messages[-1].get("content") or "")
        text = feedback(guess, (tuple(info["candidates"]), info["secret"]))
        return [vf.UserMessage(content=text)]


def load_environment(
    num_train_examples: int = 10_000,
    num_eval_examples: int = 512,
    num_candidates: int = 6,
    max_turns: int = 4,
    seed: int = 0,
) -> vf.Environment:
    """A multi-turn verifiers environment over generated games."""
    from datasets import Dataset

    if not 2 <= num_candidates <= 20 or max_turns < 1:
        raise ValueError("need 2 <= num_candidates <= 20 and max_turns >= 1")

    def rows(games: list[Game]) -> Dataset:
        return Dataset.from_list(
            [
                {
                    "prompt": game_prompt(game),
                    "answer": game[1],
                    "info": {"candidates": list(game[0]), "secret": game[1]},
                }
                for game in games
            ]
        )

    def splits() -> tuple[list[Game], list[Game]]:
        return make_splits(num_train_examples, num_eval_examples, seed, num_candidates)

    def played(completion: Any, answer: str, info: dict[str, Any], **_: Any) -> float:
        return game_reward(_guesses(completion), tuple(info["candidates"]), answer, max_turns)

    def won(completion: Any, answer: str, **_: Any) -> float:
        return score(_guesses(completion), answer, max_turns)

    def solved(completion: Any, answer: str, **_: Any) -> float:
        return float(answer in _guesses(completion))

    def guesses(completion: Any, **_: Any) -> float:
        return float(len(_guesses(completion)))

    def legal_share(completion: Any, answer: str, info: dict[str, Any], **_: Any) -> float:
        """Of the guesses, the share that every earlier mark allowed (legal, informed play)."""
        return consistent_share(_guesses(completion), tuple(info["candidates"]), answer)

    rubric = vf.Rubric(funcs=[played])
    for metric in (won, solved, guesses, legal_share):
        rubric.add_metric(metric)
    return WordleEnv(
        dataset=lambda: rows(splits()[0]),
        eval_dataset=lambda: rows(splits()[1]),
        rubric=rubric,
        max_turns=max_turns,
        pass_threshold=1.0 / max_turns,
    )
