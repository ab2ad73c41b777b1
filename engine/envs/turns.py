"""One model turn: chat messages → prompt token ids → the sampler → the sampled tokens.

The chat template is applied by the tokenizer once per turn to build the prompt; the sampled
ids and log-probs come back from the server and are kept as they are. On later turns of a
conversation the earlier tokens are reused verbatim — the previous prompt ids and the previous
sampled ids, exactly, even where the sampled ids hold special tokens the decoded text leaves
out — followed by only what the template adds: the closing of the model's turn (less the stop
token the model already emitted), the environment's messages and the generation prompt.

That needs a template that only appends: rendering the conversation so far must extend the
previous rendering, and render the model's reply as the text it sampled. When a template
rewrites history instead (reasoning templates that drop earlier thoughts, tool calls re-rendered
in another format) the turn starts from a fresh rendering and `trajectory.assemble` splits the
conversation there rather than train on tokens the model never saw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from engine.config.orchestrator import SamplingConfig
from engine.envs.coalescing import CoalescingSampler
from engine.envs.sampler import Sampler

ChatMessage = Mapping[str, Any]


class PromptTooLongError(Exception):
    """The rendered prompt leaves no room for a single sampled token in the context."""


class SamplerFailedError(Exception):
    """The inference pool failed a request after its own retries; the run cannot go on."""


@dataclass(frozen=True)
class Turn:
    """One model call: the exact prompt sent and what the server sampled for it."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_version: int
    finish_reason: str
    #: The completion as the server decoded it (what the environment reads).
    text: str
    #: The messages the prompt was rendered from, and the template's rendering of them.
    prompt_messages: tuple[ChatMessage, ...] = ()
    prompt_text: str = ""
    #: The lineage id of `policy_version` ('' when unknown).
    policy_lineage: str = ""

    @property
    def is_truncated(self) -> bool:
        return self.finish_reason == "length"


class ChatTokenizer:
    """The tokenizer operations turns need, over a Hugging Face tokenizer."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None):
        self._tokenizer = tokenizer
        self._template_kwargs = dict(chat_template_kwargs or {})

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ChatMessage] | None,
        *,
        generation_prompt: bool = True,
    ) -> str:
        """The chat template applied to `messages` (ending in the generation prompt)."""
        text = self._tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **self._template_kwargs,
        )
        return cast(str, text)  # tokenize=False: the rendered text

    def encode(self, text: str) -> list[int]:
        # The template already wrote any BOS/special tokens as text; adding more would double them.
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return cast(str, self._tokenizer.decode(list(token_ids), skip_special_tokens=False))


def continuation(
    messages: Sequence[ChatMessage],
    tools: Sequence[ChatMessage] | None,
    previous: Turn,
    rendered: str,
    tokenizer: ChatTokenizer,
) -> str | None:
    """Text to append after `previous`'s prompt and sampled ids, or None if history changed.

    `messages` must be the previous prompt's messages, the model's reply, then anything new;
    `rendered` is their full rendering.
    """
    count = len(previous.prompt_messages)
    if len(messages) <= count or tuple(messages[:count]) != previous.prompt_messages:
        return None
    if messages[count].get("role") != "assistant":
        return None
    history = tokenizer.render(messages[: count + 1], tools, generation_prompt=False)
    if not (history.startswith(previous.prompt_text) and rendered.startswith(history)):
        return None
    reply = history[len(previous.prompt_text) :]
    if not reply.startswith(previous.text):
        return None
    closing = reply[len(previous.text) :]
    if previous.finish_reason == "stop" and previous.completion_ids:
        stop_token = tokenizer.decode(previous.completion_ids[-1:])
        if closing.startswith(stop_token):
            closing = closing[len(stop_token) :]  # the model's own stop token closed its turn
    return closing + rendered[len(history) :]


class TurnGenerator:
    """Runs one model turn against a `Sampler`, keeping every sequence within the context."""

    def __init__(self, sampler: Sampler, tokenizer: ChatTokenizer, max_seq_len: int):
        # A group's rollouts ask for their first turn together: one request for all of them.
        self.sampler = CoalescingSampler(sampler)
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len

    def prompt_ids(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ChatMessage] | None,
        previous: Turn | None,
        rendered: str,
    ) -> list[int]:
        """The previous turn's tokens plus the new tail when possible, else a fresh rendering."""
        if previous is not None:
            tail = continuation(messages, tools, previous, rendered, self.tokenizer)
            if tail is not None:
                return [
                    *previous.prompt_ids,
                    *previous.completion_ids,
                    *self.tokenizer.encode(tail),
                ]
        return self.tokenizer.encode(rendered)

    async def generate(
        self,
        messages: Sequence[ChatMessage],
        sampling: SamplingConfig,
        *,
        tools: Sequence[ChatMessage] | None = None,
        previous: Turn | None = None,
    ) -> Turn:
        rendered = self.tokenizer.render(messages, tools)
        prompt_ids = self.prompt_ids(messages, tools, previous, rendered)
        room = self.max_seq_len - len(prompt_ids)
        if room < 1:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens; the context holds {self.max_seq_len}"
            )
        bounded = sampling.model_copy(update={"max_tokens": min(sampling.max_tokens, room)})
        try:
            (sample,) = await self.sampler.generate(prompt_ids, bounded, n=1)
        except Exception as exc:
            raise SamplerFailedError(f"{type(exc).__name__}: {exc}") from exc
        return Turn(
            prompt_ids=tuple(prompt_ids),
            completion_ids=tuple(int(token) for token in sample.completion_ids),
            logprobs=tuple(float(value) for value in sample.logprobs),
            policy_version=int(sample.policy_version),
            finish_reason=sample.finish_reason,
            text=sample.text,
            prompt_messages=tuple(dict(message) for message in messages),
            prompt_text=rendered,
            policy_lineage=str(sample.policy_lineage),
        )
