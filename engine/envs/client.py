"""verifiers' model-client interface, served by primeflow's `TurnGenerator`.

Classic verifiers environments call `client.get_response(messages, ..., state=state)` once per
model turn. This client answers from the inference pool with token ids: the tokenizer renders the
chat template, the server samples, and every turn is recorded in the rollout's state under
`TURNS_KEY` so the orchestrator builds training sequences from the exact tokens, not from the
messages verifiers keeps.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, cast

import verifiers as vf

from engine.config.orchestrator import SamplingConfig
from engine.envs.chat import native_tool
from engine.envs.turns import PromptTooLongError, Turn, TurnGenerator

#: State key holding the rollout's list of `Turn`s.
TURNS_KEY = "primeflow_turns"
#: Key of the rollout's `SamplingConfig` in the sampling arguments verifiers passes through.
SAMPLING_KEY = "primeflow_sampling"

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, str]]]:
    """Split a completion into its text and Hermes-style `<tool_call>{json}</tool_call>` calls.

    Hermes tags are what Qwen-family templates teach models to emit (vLLM's `hermes` parser
    reads the same). Returns the text before the first call and each call's name and JSON
    arguments. Anything malformed leaves the whole completion as text, so the environment sees
    what the model wrote.
    """
    start = text.find("<tool_call>")
    bodies = _TOOL_CALL.findall(text, start) if start >= 0 else []
    if not bodies:
        return text, []
    calls = []
    for index, body in enumerate(bodies):
        try:
            parsed = json.loads(body)
            name, arguments = parsed["name"], parsed.get("arguments", {})
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, []
        if not isinstance(name, str):
            return text, []
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        calls.append({"id": f"call_{index}", "name": name, "arguments": arguments})
    return text[:start], calls


def _text(content: Any) -> str:
    """Message content as plain text (text parts joined; other parts have no tokens here)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") == "text":
            parts.append(part.get("text", ""))
    return "".join(parts)


def to_chat_message(message: Any) -> dict[str, Any]:
    """A verifiers message as the plain dict Hugging Face chat templates take."""
    role = message.get("role")
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
    tool_calls = message.get("tool_calls") if role == "assistant" else None
    if tool_calls:
        out["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": call.get("name"), "arguments": call.get("arguments")},
            }
            for call in tool_calls
        ]
    if role == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
    return out


@dataclass(frozen=True)
class _Native:
    turn: Turn
    model: str
    parse_tools: bool


class SamplerClient(vf.Client):
    """A `vf.Client` whose every model call is one `TurnGenerator` turn."""

    def __init__(self, generator: TurnGenerator) -> None:
        super().__init__(generator)

    @property
    def generator(self) -> TurnGenerator:
        return cast(TurnGenerator, self.client)  # what __init__ handed vf.Client

    def setup_client(self, config: vf.ClientConfig) -> TurnGenerator:
        raise TypeError("SamplerClient wraps a TurnGenerator; it is not built from a config")

    async def to_native_tool(self, tool: vf.Tool) -> dict[str, Any]:
        return native_tool(tool)

    async def to_native_prompt(
        self, messages: vf.Messages
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return [to_chat_message(message) for message in messages], {}

    async def get_native_response(
        self,
        prompt: list[dict[str, Any]],
        model: str,
        sampling_args: vf.SamplingArgs,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> _Native:
        state = kwargs["state"]
        turns: list[Turn] = state.setdefault(TURNS_KEY, [])
        sampling: SamplingConfig = sampling_args[SAMPLING_KEY]
        try:
            turn = await self.generator.generate(
                prompt, sampling, tools=tools, previous=turns[-1] if turns else None
            )
        except PromptTooLongError as exc:
            raise vf.OverlongPromptError(str(exc)) from exc
        turns.append(turn)
        return _Native(turn=turn, model=model, parse_tools=bool(tools))

    async def raise_from_native_response(self, response: _Native) -> None:
        return None

    async def from_native_response(self, response: _Native) -> vf.Response:
        turn = response.turn
        content, calls = parse_tool_calls(turn.text) if response.parse_tools else (turn.text, [])
        finish_reason = "tool_calls" if calls else "length" if turn.is_truncated else "stop"
        prompt_len, completion_len = len(turn.prompt_ids), len(turn.completion_ids)
        return vf.Response(
            id=uuid.uuid4().hex,
            created=int(time.time()),
            model=response.model,
            usage=vf.Usage(
                prompt_tokens=prompt_len,
                reasoning_tokens=0,
                completion_tokens=completion_len,
                total_tokens=prompt_len + completion_len,
            ),
            message=vf.ResponseMessage(
                content=content,
                tool_calls=[vf.ToolCall(**call) for call in calls] or None,
                finish_reason=finish_reason,
                is_truncated=turn.is_truncated,
                tokens=vf.ResponseTokens(
                    prompt_ids=list(turn.prompt_ids),
                    prompt_mask=[0] * prompt_len,
                    completion_ids=list(turn.completion_ids),
                    completion_mask=[1] * completion_len,
                    completion_logprobs=list(turn.logprobs),
                ),
            ),
        )

    async def close(self) -> None:
        return None
