"""One request for a group's identical prompts: concurrent identical turns merged into n samples.

Every rollout of a group asks for its first turn with the same prompt ids and sampling, at the
same moment (the group's rollouts start together). Sent apart, they cost the server a request
each: its HTTP handling, prefill, output processing. `CoalescingSampler` sends the calls that
arrive in one turn of the event loop with the same prompt and sampling as one request for the
sum of their `n`, and hands each caller its own share of the samples: vLLM prefills the prompt
once and samples the sequences independently, as it would have apart. On the CPU demo's vLLM
server, 128 samples as 16 requests of n = 8 took 0.85 s against 1.3 s as 128 requests
(docs/benchmarks.md). Later turns of multi-turn rollouts differ, and go alone as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config.orchestrator import SamplingConfig
from engine.envs.sampler import Sample, Sampler


@dataclass
class _Merged:
    """The calls joined into one request: how many samples each asked for, in order."""

    prompt_ids: list[int]
    sampling: SamplingConfig
    samples: asyncio.Future[Sequence[Sample]]
    shares: list[int] = field(default_factory=list)
    waiting: int = 0
    request: asyncio.Task[Sequence[Sample]] | None = None


class CoalescingSampler:
    """A `Sampler` over `sampler` that merges identical calls made in one event-loop turn."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self._open: dict[tuple[tuple[int, ...], str], _Merged] = {}

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, *, n: int = 1
    ) -> Sequence[Sample]:
        """`n` samples of `prompt_ids`: this call's share of one merged request."""
        key = (tuple(prompt_ids), sampling.model_dump_json())
        merged = self._open.get(key)
        if merged is None:
            loop = asyncio.get_running_loop()
            merged = self._open[key] = _Merged(list(prompt_ids), sampling, loop.create_future())
            # Runs after the calls already scheduled in this turn: a group's other rollouts.
            loop.call_soon(self._send, key)
        offset = sum(merged.shares)
        merged.shares.append(n)
        merged.waiting += 1
        try:
            samples = await asyncio.shield(merged.samples)
        finally:
            merged.waiting -= 1
            if merged.waiting == 0 and merged.request is not None:
                merged.request.cancel()  # every caller gave up: nobody needs the samples
        return samples[offset : offset + n]

    def _send(self, key: tuple[tuple[int, ...], str]) -> None:
        merged = self._open.pop(key)
        if merged.waiting == 0:  # cancelled before it was sent
            merged.samples.cancel()
            return
        request = self.sampler.generate(merged.prompt_ids, merged.sampling, n=sum(merged.shares))
        merged.request = asyncio.ensure_future(request)
        merged.request.add_done_callback(lambda done: _settle(merged.samples, done))


def _settle(
    samples: asyncio.Future[Sequence[Sample]], request: asyncio.Task[Sequence[Sample]]
) -> None:
    """Hand the request's outcome to the callers waiting on `samples`."""
    if samples.done():
        return
    if request.cancelled():
        samples.cancel()
    elif (error := request.exception()) is not None:
        samples.set_exception(error)
    else:
        samples.set_result(request.result())
