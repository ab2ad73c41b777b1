"""The chat rows of the built-in environments: a single-turn prompt, SFT conversations, and the
tool-call messages of a demonstration, spelt once for all so that what SFT trains on renders
exactly as RL's rollouts do."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import verifiers as vf


def single_turn_prompt(user: str, system_prompt: str) -> list[dict[str, str]]:
    """The chat prompt of a single-turn task."""
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}]


def sft_conversation(
    prompt: list[dict[str, Any]], reply: str, tools: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """An SFT row (`sft_examples`' shape): `prompt` answered by its gold `reply`, with the tool
    schemas its template renders (`tool_schemas`) where the environment has tools."""
    row: dict[str, Any] = {"messages": [*prompt, {"role": "assistant", "content": reply}]}
    if tools:
        row["tools"] = tools
    return row


def native_tool(tool: vf.Tool) -> dict[str, Any]:
    """A verifiers tool as the chat template's `tools` entry (OpenAI's function schema)."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": dict(tool.parameters),
        },
    }


def tool_schemas(tools: list[Callable[..., Any]]) -> list[dict[str, Any]]:
    """The `tools` a chat template renders for these functions: what a `vf.ToolEnv` over them
    sends on every turn, so an SFT row's prompt is the rollouts' prompt to the character."""
    # Imported here: it loads verifiers' whole message model (~3 s on the 2-core machine),
    # which an SFT trainer building tool-free rows (reverse-text) would otherwise pay at start.
    from verifiers.utils.tool_utils import convert_func_to_tool_def

    return [native_tool(convert_func_to_tool_def(tool)) for tool in tools]


def tool_call(call_id: str, name: str, **arguments: Any) -> dict[str, Any]:
    """A demonstration's assistant turn that calls tool `name` and says nothing else; its
    arguments are JSON as the client writes a parsed call's (`engine.envs.client`)."""
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def called_arguments(completion: Any, name: str, argument: str) -> list[str]:
    """The string `argument` of every call to tool `name` in a rollout's `completion`, in
    order (a call whose arguments are not JSON, or lack it, is skipped): what a reward reads
    of the steps that led to an answer."""
    found = []
    for message in completion:
        for call in message.get("tool_calls") or []:
            if call.get("name") != name:
                continue
            try:
                value = json.loads(call.get("arguments") or "{}").get(argument)
            except (ValueError, AttributeError):
                continue
            if isinstance(value, str):
                found.append(value)
    return found


def tool_result(call_id: str, content: str) -> dict[str, str]:
    """The tool's reply to call `call_id` in a demonstration."""
    return {"role": "tool", "tool_call_id": call_id, "content": content}
