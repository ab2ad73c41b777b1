"""Shared pieces of the environment tests: the tiny model's tokenizer and a scripted policy.

The inference pool is the one external service here; `ScriptedPolicy` stands in for it with a
deterministic policy over the real tokenizer (it answers from the prompt text), so environment
logic, token bookkeeping and scoring can be checked exactly without a server. The same code
runs against the real vLLM server in `tests/integration/orchestrator`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.config.orchestrator import SamplingConfig
from engine.envs import ChatTokenizer, TurnGenerator
from engine.models.char_tokenizer import IM_END, write_tokenizer


@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(Path(folder), model_max_length=4096)
    return AutoTokenizer.from_pretrained(str(folder))


@dataclass
class Completion:
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    policy_version: int
    policy_lineage: str = ""


@dataclass
class ScriptedPolicy:
    """A `Sampler` that samples `reply(prompt_text)` and then `stop_token`, like vLLM would.

    The reply may contain special tokens; as with vLLM, the returned text leaves them out while
    the ids keep them.
    """

    tokenizer: Any
    reply: Callable[[str], str]
    policy_version: int = 0
    policy_lineage: str = ""
    stop_token: str = IM_END
    requests: list[tuple[list[int], SamplingConfig]] = field(default_factory=list)

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, *, n: int = 1
    ) -> list[Completion]:
        self.requests.append((list(prompt_ids), sampling))
        raw = self.reply(self.tokenizer.decode(list(prompt_ids)))
        ids = self.tokenizer.encode(raw, add_special_tokens=False)
        ids.append(self.tokenizer.convert_tokens_to_ids(self.stop_token))
        finish = "stop"
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        logprobs = [-0.01 * (index + 1) for index in range(len(ids))]
        return [
            Completion(ids, logprobs, text, finish, self.policy_version, self.policy_lineage)
            for _ in range(n)
        ]


@pytest.fixture
def policy(hf_tokenizer: Any) -> Callable[..., ScriptedPolicy]:
    def make(reply: Callable[[str], str], **kwargs: Any) -> ScriptedPolicy:
        return ScriptedPolicy(hf_tokenizer, reply, **kwargs)

    return make


@pytest.fixture
def generator(hf_tokenizer: Any) -> Callable[..., TurnGenerator]:
    def make(sampler: Any, max_seq_len: int = 1024) -> TurnGenerator:
        return TurnGenerator(sampler, ChatTokenizer(hf_tokenizer), max_seq_len)

    return make


def last_user_text(prompt: str) -> str:
    """The content of the last user message in a ChatML-rendered prompt."""
    return prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
