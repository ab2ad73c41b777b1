"""corpus-search: questions answered from a small local corpus through search and read tools,
in the style of wiki-search, with no network.

The corpus is generated: one page per town, titled `Town (region)`, each saying which river
the town lies on, who its mayor is and what it is known for; 160 towns, or `middles` × 160
with middle syllables in their names. A question names the town and
asks one fact. `search(query)` ranks the pages by how many of the query's words they hold
(a local inverted index) and returns the best titles; `read(title)` returns a page, by its
exact title, so the model must search before it can read, then answer in `<answer>` tags.
The reward is 1 for the exact fact; another answer earns up to `NEAR_CREDIT`: its character
similarity to the fact where that is at least `NEAR_MIN` (a slip in copying), or up to
`READ_SHARE` of it for reading the town's page, whichever is more (`exact_fact` is logged beside
it). The reading credit grows from 0 at a title `NEAR_MIN` alike to the page's to all of it at
the exact title: the 76M model after SFT searches the right town and then reads a title it
half-copied from the search's answer (`Norley (coast)` for `Norley (hills)`), so an exact-title
credit left every group tied and RL with no signal (docs/benchmarks.md). An earlier credit
paid any answer its similarity: RL learnt to skip the tools and answer a short string that
shares a letter or two with most facts (`oan` for `good`: 0.14), a reward for no step of the
task; under `NEAR_MIN` a guess earns nothing. The corpus is
shared, the towns are split: eval asks about towns train never asks about. SFT rows
(`sft_examples`) are whole tool conversations: search, read, answer.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import verifiers as vf

from engine.envs.chat import (
    called_arguments,
    single_turn_prompt,
    tool_call,
    tool_result,
    tool_schemas,
)
from engine.envs.reverse_text import similarity
from engine.envs.words import EVAL_SEED, NAMES, WORDS

SYSTEM_PROMPT = "Search the pages, read one, then give the answer in <answer> tags."
REGIONS = ("north", "south", "east", "west", "coast", "hills")
_STARTS = (
    "Am", "Bel", "Cor", "Dun", "El", "Fen", "Gar", "Hol",
    "Kel", "Lor", "Mar", "Nor", "Pen", "Ros", "Tal", "Wen",
)  # fmt: skip
_ENDS = ("brook", "by", "ford", "ham", "ley", "mere", "ston", "wick", "dale", "combe")
#: Middle syllables: `middles` of them make `middles` × 160 towns. The first is none: one
#: middle is the corpus every measurement so far used; more leave fewer facts per name for a
#: policy to memorise in place of searching (160 towns held the 360 train questions' answers).
MIDDLES = ("", "ar", "en", "il", "o", "un", "es", "ath")
#: Titles `search` returns at most.
TOP_K = 3
#: The most an answer other than the fact earns.
NEAR_CREDIT = 0.5
#: The least character similarity to the fact that earns credit: a slip, not a guess.
NEAR_MIN = 0.6
#: What reading the page about the question's town by its exact title earns, as a share of
#: `NEAR_CREDIT`; a near title earns part of it (`near_fact`).
READ_SHARE = 0.5
_WORD = re.compile(r"[a-z]+")
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


@dataclass(frozen=True)
class Page:
    town: str
    region: str
    river: str
    mayor: str
    known_for: str

    @property
    def title(self) -> str:
        return f"{self.town} ({self.region})"

    @property
    def text(self) -> str:
        return (
            f"{self.town} lies on the {self.river} river. Its mayor is {self.mayor}. "
            f"It is known for its {self.known_for}."
        )


#: A question asks one field of a page: (template, field).
QUESTIONS = (
    ("Which river does {town} lie on?", "river"),
    ("Who is the mayor of {town}?", "mayor"),
    ("What is {town} known for?", "known_for"),
)


@cache
def corpus(middles: int = 1) -> tuple[Page, ...]:
    """Every town of the name parts once, with facts drawn from a fixed seed: the first
    `middles` of `MIDDLES`, in order, so a larger corpus starts with every smaller one."""
    if not 1 <= middles <= len(MIDDLES):
        raise ValueError(f"corpus-search has 1 to {len(MIDDLES)} middle syllables, not {middles}")
    rng = random.Random(7)
    return tuple(
        Page(
            town=start + middle + end,
            region=rng.choice(REGIONS),
            river=rng.choice(WORDS),
            mayor=rng.choice(NAMES),
            known_for=rng.choice(WORDS),
        )
        for middle in MIDDLES[:middles]
        for start in _STARTS
        for end in _ENDS
    )


@cache
def _index(middles: int) -> dict[str, set[int]]:
    """Word → the pages (by position in `corpus(middles)`) whose title or text holds it."""
    index: dict[str, set[int]] = defaultdict(set)
    for position, page in enumerate(corpus(middles)):
        for word in _WORD.findall(f"{page.title} {page.text}".lower()):
            index[word].add(position)
    return dict(index)


def tools(middles: int = 1) -> list[Callable[[str], str]]:
    """`search` and `read` over `corpus(middles)`: their names, arguments and docstrings are
    the tool schemas the model sees, the same for every corpus."""
    pages = corpus(middles)

    def search(query: str) -> str:
        """Find pages by words: returns the best matching page titles.

        Args:
            query: words to look for, e.g. "Ambrook"
        """
        hits: dict[int, int] = defaultdict(int)
        for word in set(_WORD.findall(query.lower())):
            for position in _index(middles).get(word, ()):
                hits[position] += 1
        if not hits:
            return "no pages found"
        best = sorted(hits, key=lambda position: (-hits[position], position))[:TOP_K]
        return "\n".join(pages[position].title for position in best)

    def read(title: str) -> str:
        """Read a page by its exact title.

        Args:
            title: a title that search returned
        """
        for page in pages:
            if page.title == title.strip():
                return page.text
        return f"no page titled {title!r}"

    return [search, read]


#: The tools over the corpus every measurement so far used.
search, read = tools()


#: A question: its text, the page it is about, and the answer.
Question = tuple[str, Page, str]


#: Every `HELD_OUT`-th town of the corpus is asked about only in the eval split.
HELD_OUT = 4


def questions(pages: list[Page]) -> list[Question]:
    return [
        (template.format(town=page.town), page, getattr(page, field))
        for page in pages
        for template, field in QUESTIONS
    ]


def make_splits(
    num_train: int, num_eval: int, seed: int, middles: int = 1
) -> tuple[list[Question], list[Question]]:
    """(train, eval) questions about disjoint towns of `corpus(middles)`, so eval tests the
    search-and-read skill and not what training saw of a page. `seed` orders train; eval is
    the same for every seed.
    """
    pages = corpus(middles)
    train = questions([p for i, p in enumerate(pages) if i % HELD_OUT])
    held_out = questions([p for i, p in enumerate(pages) if not i % HELD_OUT])
    if num_train > len(train) or num_eval > len(held_out):
        raise ValueError(
            f"corpus-search has {len(train)} train and {len(held_out)} held-out questions "
            f"(asked for {num_train} and {num_eval})"
        )
    random.Random(seed).shuffle(train)
    random.Random(EVAL_SEED).shuffle(held_out)
    return train[:num_train], held_out[:num_eval]


def _tagged(completion: Any) -> str | None:
    """The last reply's last tagged answer, stripped and lower-cased (None: no tag)."""
    replies = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    found = _ANSWER.findall(replies[-1]) if replies else []
    return found[-1].strip().lower() if found else None


def exact_fact(completion: Any, answer: str, **_: Any) -> float:
    """1 when the last reply's tagged answer is the fact, ignoring case."""
    return float(_tagged(completion) == answer.lower())


def near_fact(completion: Any, answer: str, info: dict[str, Any], **_: Any) -> float:
    """1 for the exact fact, else `NEAR_CREDIT` × the larger of the tagged answer's similarity
    to the fact (where at least `NEAR_MIN`) and `READ_SHARE` × how near the closest title read
    comes to the town's page (`above_guess`)."""
    tagged, fact = _tagged(completion), answer.lower()
    if tagged == fact:
        return 1.0
    near = similarity(tagged, fact)
    titles = called_arguments(completion, "read", "title")
    # as `read` takes them: stripped, case kept
    read_near = max((above_guess(similarity(t.strip(), info["title"])) for t in titles), default=0)
    return NEAR_CREDIT * max(near if near >= NEAR_MIN else 0.0, READ_SHARE * read_near)


def above_guess(alike: float) -> float:
    """A similarity rescaled so that `NEAR_MIN` (what a guess reaches) is 0 and equal is 1."""
    return max(0.0, (alike - NEAR_MIN) / (1 - NEAR_MIN))


def sft_examples(
    num_examples: int, seed: int = 0, system_prompt: str = SYSTEM_PROMPT, middles: int = 1
) -> list[dict[str, Any]]:
    """Gold tool conversations on train-split questions: search the town, read its page,
    answer."""
    train, _ = make_splits(num_examples, 0, seed, middles)
    search_tool, read_tool = tools(middles)
    schemas = tool_schemas([search_tool, read_tool])
    return [
        {
            "messages": [
                *single_turn_prompt(question, system_prompt),
                tool_call("call_0", "search", query=page.town),
                tool_result("call_0", search_tool(page.town)),
                tool_call("call_1", "read", title=page.title),
                tool_result("call_1", read_tool(page.title)),
                {"role": "assistant", "content": f"<answer>{answer}</answer>"},
            ],
            "tools": schemas,
        }
        for question, page, answer in train
    ]


def load_environment(
    num_train_examples: int = 360,
    num_eval_examples: int = 120,
    seed: int = 0,
    max_turns: int = 4,
    system_prompt: str = SYSTEM_PROMPT,
    middles: int = 1,
) -> vf.Environment:
    """A verifiers tool environment over the local corpus of `middles` × 160 towns, with
    `search` and `read`."""
    from datasets import Dataset

    def rows(questions: list[Question]) -> Dataset:
        return Dataset.from_list(
            [
                {
                    "prompt": single_turn_prompt(question, system_prompt),
                    "answer": answer,
                    "info": {"title": page.title},
                }
                for question, page, answer in questions
            ]
        )

    def splits() -> tuple[list[Question], list[Question]]:
        return make_splits(num_train_examples, num_eval_examples, seed, middles)

    rubric = vf.Rubric(funcs=[near_fact])
    rubric.add_metric(exact_fact)
    return vf.ToolEnv(
        tools=tools(middles),
        dataset=lambda: rows(splits()[0]),
        eval_dataset=lambda: rows(splits()[1]),
        rubric=rubric,
        max_turns=max_turns,
        pass_threshold=1.0,
    )
