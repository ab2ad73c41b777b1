"""One model turn: chat messages → prompt token ids → the sampler → the sampled tokens.

The chat template is applied by the tokenizer once per turn to build the prompt; the sampled
ids and log-probs come back from the server and are kept as they are. On later turns of a
conversation the earlier tokens are reused verbatim: the new prompt is the previous prompt, the
previous sampled ids, then only the newly rendered tail (the environment's reply and the
generation prompt). That is possible only when the template re-renders the history as the same
text; when it does not (a template that rewrites earlier turns), the turn starts from a fresh
rendering and `trajectory.assemble` splits the conversation there instead of training on
tokens the model never saw.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.config.orchestrator import SamplingConfig
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
    #: Rendered prompt + decoded completion, special tokens kept: a later rendering that starts
    #: with this text extends this turn verbatim.
    history_text: str

    @property
    def is_truncated(self) -> bool:
        return self.finish_reason == "length"


class ChatTokenizer:
    """The three tokenizer operations turns need, over a Hugging Face tokenizer."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None):
        self._tokenizer = tokenizer
        self._template_kwargs = dict(chat_template_kwargs or {})

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[ChatMessage] | None) -> str:
        """The chat template applied to `messages`, ending in the generation prompt."""
        return self._tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            tokenize=False,
            **self._template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        # The template already wrote any BOS/special tokens as text; adding more would double them.
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)


def next_prompt_ids(
    rendered: str, previous: Turn | None, encode: Callable[[str], list[int]]
) -> list[int]:
    """Prompt ids for `rendered`, reusing the previous turn's tokens when it extends them."""
    if previous is not None and rendered.startswith(previous.history_text):
        tail = rendered[len(previous.history_text) :]
        return [*previous.prompt_ids, *previous.completion_ids, *encode(tail)]
    return encode(rendered)


class TurnGenerator:
    """Runs one model turn against a `Sampler`, keeping every sequence within the context."""

    def __init__(self, sampler: Sampler, tokenizer: ChatTokenizer, max_seq_len: int):
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len

    async def generate(
        self,
        messages: Sequence[ChatMessage],
        sampling: SamplingConfig,
        *,
        tools: Sequence[ChatMessage] | None = None,
        previous: Turn | None = None,
    ) -> Turn:
        rendered = self.tokenizer.render(messages, tools)
        prompt_ids = next_prompt_ids(rendered, previous, self.tokenizer.encode)
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
        completion_ids = tuple(int(token) for token in sample.completion_ids)
        return Turn(
            prompt_ids=tuple(prompt_ids),
            completion_ids=completion_ids,
            logprobs=tuple(float(value) for value in sample.logprobs),
            policy_version=int(sample.policy_version),
            finish_reason=sample.finish_reason,
            text=sample.text,
            history_text=rendered + self.tokenizer.decode(completion_ids),
        )
