"""What environments need from an inference pool: token ids in, sampled tokens out.

Environments and the orchestrator depend on this protocol, not on the pool's client, so they
can be built and tested on their own and any client with this shape serves them. Prompts go in
as token ids because the orchestrator renders the chat template once and must train on exactly
the tokens the model saw; text in would let the server re-tokenise and break that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.config.orchestrator import SamplingConfig


class Sample(Protocol):
    """One sampled completion, as the server produced it."""

    @property
    def completion_ids(self) -> Sequence[int]:
        """Sampled token ids, the stop token included when the model emitted one."""
        ...

    @property
    def logprobs(self) -> Sequence[float]:
        """The inference log-probability of each sampled token (one per completion id)."""
        ...

    @property
    def text(self) -> str:
        """The decoded completion (without a stop token)."""
        ...

    @property
    def finish_reason(self) -> str:
        """`stop` (stop token or string) or `length` (hit `max_tokens`)."""
        ...

    @property
    def policy_version(self) -> int:
        """The oldest policy version (checkpoint step) that produced any of its tokens."""
        ...

    @property
    def policy_lineage(self) -> str:
        """The lineage id of `policy_version` ('' when unknown): which trainer published it."""
        ...


class Sampler(Protocol):
    """An async client over the inference pool (`engine.inference.client.InferenceClient`)."""

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, *, n: int = 1
    ) -> Sequence[Sample]:
        """`n` completions of one token-id prompt."""
        ...
