"""Deterministic text for the built-in environments: fixed word lists and seeded draws.

The built-in environments generate their data rather than download it, so they work offline
and every machine sees the same examples. Words are short, lowercase ASCII: the tiny model's
tokenizer is character-level, so short texts keep sequences short and every character is in
its vocabulary.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from typing import TypeVar

_WORDS_TEXT = (
    "able acid aged also area army away baby back ball band bank base bath bear beat bell belt "
    "best bird blow blue boat body bone book boot born both bowl busy cake call calm camp card "
    "care cart case cash cast cell chip city clay club coal coat code cold cook cool cope copy "
    "core corn cost crew crop dark data date dawn days dead deal dear debt deep deer desk dial "
    "diet dish dock door dose down draw drop drum dust duty each earn east easy edge else even "
    "ever face fact fair fall farm fast fear feed feel file fill film find fine fire firm fish "
    "five flat flow fold folk food foot form fort four free frog fuel full fund gain game gate "
    "gear gift girl give glad goal gold golf good gray grow hair half hall hand hang hard harm "
    "hat head heat help hero high hill hold hole home hope horn host hour huge idea inch iron "
    "item jazz join joke jump jury keen keep kind king kite knee lake lamp land lane last late "
    "lead leaf lean left lend life lift line link lion list live load loan lock long look loop "
    "lord lose loud love luck mail main make male many map mark mass meal meat mild milk mill "
    "mind mine mint miss mode moon more most move much must name navy near neck need nest news "
    "nice nine node none nose note oak open oven over pace pack page pain pair palm park part "
    "pass path peak pick pile pine pink pipe plan play plot plus poem pole pond pool poor port "
    "post pull pure push quiz race rail rain rank rare rate read real rest rice rich ride ring "
    "rise risk road rock role roof room root rope rose rule rush safe sail salt sand save seat "
    "seed seek ship shoe shop shot show sick side sign silk sing site size skin slow snow soft "
    "soil song soon sort soup spin spot star stay step stop such suit sure swim tail take tale "
    "talk tall tank tape task team tell tent term test text then tide tile time tiny tone tool "
    "tour town tree trip true tube tune turn twin type unit upon used vast very view vote wage "
    "wait wake walk wall want warm wash wave weak wear week well west wide wild will wind wine "
    "wing wire wise wish wolf wood wool word work yard year zero zone"
)
WORDS = tuple(_WORDS_TEXT.split())

_NAMES_TEXT = (
    "Abe Ada Al Ali Amy Ann Ava Bea Ben Bo Cal Cy Dan Dee Dot Ed Eli Eva Fay Flo Gil Gus Hal Ian "
    "Ida Ike Ivy Jan Jay Jo Kai Kay Ken Kim Lee Leo Liv Lou Lu Mae Max May Mia Ned Nia Noa Ola "
    "Pam Pat Per Quin Ray Rex Rio Ron Roy Sal Sam Sol Sue Tam Ted Tia Tom Ty Uma Val Vic Wes Wyn "
    "Xia Yas Zac Zoe"
)
NAMES = tuple(_NAMES_TEXT.split())


def distinct_draws(
    count: int,
    rng: random.Random,
    draw: Callable[[random.Random], str],
    exclude: Collection[str] = (),
    max_tries_per_item: int = 100,
) -> list[str]:
    """`count` distinct values from `draw`, none in `exclude`, in draw order."""
    seen = set(exclude)
    out: list[str] = []
    tries = 0
    while len(out) < count:
        tries += 1
        if tries > max_tries_per_item * max(count, 1):
            raise ValueError(f"could not draw {count} distinct values; widen the settings")
        value = draw(rng)
        if value not in seen:
            seen.add(value)
            out.append(value)
    return out


def phrase(rng: random.Random, min_words: int, max_words: int) -> str:
    """A few words joined by spaces."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))


#: Held-out splits are drawn from this seed whatever a run's seed is, and train splits exclude
#: the first `EVAL_RESERVE` of those draws, so no seed's training data (RL or SFT) can contain
#: a held-out example of any eval size up to the reserve.
EVAL_SEED = 2_024_0607
EVAL_RESERVE = 2048


T = TypeVar("T")


def disjoint_splits(
    num_train: int,
    num_eval: int,
    seed: int,
    draw: Callable[[random.Random], T],
    key: Callable[[T], str],
) -> tuple[list[T], list[T]]:
    """(train, eval) examples from `draw`, distinct by `key`: eval from `EVAL_SEED` (the same
    for every seed), train from `seed`, never one of the reserved eval draws."""
    drawn: dict[str, T] = {}

    def draw_key(rng: random.Random) -> str:
        example = draw(rng)
        drawn[key(example)] = example
        return key(example)

    reserved = distinct_draws(max(num_eval, EVAL_RESERVE), random.Random(EVAL_SEED), draw_key)
    train = distinct_draws(num_train, random.Random(seed), draw_key, exclude=reserved)
    return [drawn[k] for k in train], [drawn[k] for k in reserved[:num_eval]]
