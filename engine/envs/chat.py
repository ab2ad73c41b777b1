"""The chat rows of the built-in single-turn environments: one system turn and one user turn as
the prompt, and that prompt with its gold reply as an SFT conversation, spelt once for all."""

from __future__ import annotations

from typing import Any


def single_turn_prompt(user: str, system_prompt: str) -> list[dict[str, str]]:
    """The chat prompt of a single-turn task."""
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}]


def sft_conversation(prompt: list[dict[str, str]], reply: str) -> dict[str, Any]:
    """An SFT row (`sft_examples`' shape): `prompt` answered by its gold `reply`."""
    return {"messages": [*prompt, {"role": "assistant", "content": reply}]}
