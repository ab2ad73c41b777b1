"""An async client over the pool: token ids in; sampled token ids, log-probs and text out.

RL trains on exactly the tokens the policy sampled, with the log-probabilities the sampler
used, so this client never sends or re-tokenises text: prompts go to vLLM's completions API as
token ids, and each sample's ids and log-probs come back from the server (`return_token_ids`,
`logprobs=0`). Each sample is stamped with the policy version its server was serving when the
request was sent: the pool updates that version before a reloaded server resumes, so the stamp
is never newer than the policy that produced any of the sample's tokens.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from engine.config.orchestrator import SamplingConfig
from engine.inference.endpoint import Endpoint

if TYPE_CHECKING:
    from engine.inference.serving import PolicyServing

#: HTTP statuses worth retrying: rate limiting, and the server being busy or restarting.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: Connections per httpx client. httpcore's pool walks all its connections, and for each idle
#: one all of them again, every time it assigns or releases a request: with 256 connections
#: (multi-turn rollouts send one request per turn) that walk took half the orchestrator's time
#: (docs/benchmarks.md, "Agentic rollouts' throughput"). Small pools, many of them, keep it short.
CONNECTIONS_PER_CLIENT = 16


class InferenceError(RuntimeError):
    """A request that failed for good: permanent (bad request, bad key) or out of retries."""

    def __init__(self, message: str, *, status: int | None = None, transient: bool = False):
        super().__init__(message)
        self.status = status
        self.transient = transient


@dataclass(frozen=True)
class Sample:
    """One sampled completion, exactly as the server produced it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    policy_version: int
    server: int  # the pool's index of the server that sampled it
    policy_lineage: str = ""  # the `lineage_id` of `policy_version` (`Endpoint`)

    @property
    def is_truncated(self) -> bool:
        """Stopped by `max_tokens` (or the context) rather than by EOS or a stop string."""
        return self.finish_reason == "length"


class _Slots:
    """A FIFO weighted semaphore: a request for `n` samples takes `n` of the `limit` slots.

    Waiters queue in arrival order and a release wakes only those that now fit, so thousands of
    queued requests cost O(1) each (a condition variable would wake them all on every release).
    A request larger than the whole limit still runs, alone, so nothing waits forever.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    async def acquire(self, n: int) -> None:
        if not self._waiters and self._fits(n):
            self.used += n
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiters.append((n, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(n)  # slots were handed over just as we were cancelled
            raise

    def release(self, n: int) -> None:
        self.used -= n
        while self._waiters and self._fits(self._waiters[0][0]):
            wanted, granted = self._waiters.popleft()
            if not granted.cancelled():
                self.used += wanted
                granted.set_result(None)


class InferenceClient:
    """Spreads requests over the pool's servers (least busy first) under a concurrency cap."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        api_key: str,
        *,
        max_concurrent: int = 64,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
    ) -> None:
        if not endpoints:
            raise ValueError("the client needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.retries = retries
        self.backoff_s = backoff_s
        self._slots = _Slots(max_concurrent)
        self._busy = [0] * len(self.endpoints)
        self._next = 0
        pools = math.ceil(max_concurrent / CONNECTIONS_PER_CLIENT)
        limits = httpx.Limits(
            max_connections=math.ceil(max_concurrent / pools), max_keepalive_connections=None
        )
        self._http = [
            httpx.AsyncClient(
                headers={"Authorization": f"Bearer {api_key}"},
                timeout=httpx.Timeout(timeout_s, connect=10.0),
                limits=limits,
            )
            for _ in range(pools)
        ]
        self._http_load = [0] * pools

    @property
    def requests_in_flight(self) -> int:
        """Requests sent (each stamped with its server's policy version) and not answered."""
        return sum(self._busy)

    @classmethod
    def from_pool(cls, pool: PolicyServing, *, max_concurrent: int = 64) -> InferenceClient:
        """A client on a running pool, sharing its endpoints (and so their policy versions)."""
        config = pool.config
        return cls(
            pool.endpoints,
            pool.api_key,
            max_concurrent=max_concurrent,
            timeout_s=config.request_timeout_s,
            retries=config.request_retries,
        )

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections."""
        for http in self._http:
            await http.aclose()

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, *, n: int = 1
    ) -> list[Sample]:
        """`n` samples for one token-id prompt, in the order the server returned them."""
        if not prompt_ids:
            raise ValueError("the prompt must have at least one token")
        body = request_body(list(prompt_ids), sampling, n)
        await self._slots.acquire(n)
        try:
            return await self._with_retries(body)
        finally:
            self._slots.release(n)

    async def generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, n: int = 1
    ) -> list[list[Sample]]:
        """`n` samples for each prompt, all in flight at once up to the concurrency cap."""
        return list(await asyncio.gather(*(self.generate(p, sampling, n=n) for p in prompts)))

    def _pick(self, avoid: int | None) -> int:
        """The least busy server (round-robin among equals), avoiding one that just failed."""
        count = len(self.endpoints)
        order = [(self._next + i) % count for i in range(count)]
        if avoid is not None and count > 1:
            order.remove(avoid)
        choice = min(order, key=lambda index: self._busy[index])
        self._next = (choice + 1) % count
        return choice

    async def _with_retries(self, body: dict[str, Any]) -> list[Sample]:
        failed: int | None = None
        for attempt in range(self.retries + 1):
            index = self._pick(failed)
            try:
                return await self._send(index, body)
            except InferenceError as exc:
                if not exc.transient or attempt == self.retries:
                    raise
                failed = index
            delay = self.backoff_s * 2**attempt
            await asyncio.sleep(delay * (0.5 + random.random()))
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _send(self, index: int, body: dict[str, Any]) -> list[Sample]:
        endpoint = self.endpoints[index]
        version, lineage = endpoint.policy_version, endpoint.policy_lineage
        pool = min(range(len(self._http)), key=self._http_load.__getitem__)
        self._busy[index] += 1
        self._http_load[pool] += 1
        try:
            response = await self._http[pool].post(
                f"{endpoint.base_url}/v1/completions", json={**body, "model": endpoint.model}
            )
        except httpx.TransportError as exc:
            raise InferenceError(
                f"server {index} ({endpoint.base_url}): {type(exc).__name__}: {exc}",
                transient=True,
            ) from exc
        finally:
            self._busy[index] -= 1
            self._http_load[pool] -= 1
        if response.status_code != 200:
            raise InferenceError(
                f"server {index} answered {response.status_code}: {_error_message(response)}",
                status=response.status_code,
                transient=response.status_code in TRANSIENT_STATUS,
            )
        return _samples(body["prompt"], response.json(), version, lineage, endpoint.index)


def request_body(prompt_ids: list[int], sampling: SamplingConfig, n: int) -> dict[str, Any]:
    """The body of one generation request: what the client asks the server for, in one place
    (tests/bench/inference/bench_logprob_strings.py measures it against what it leaves out)."""
    return {
        "prompt": prompt_ids,
        "n": n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        "stop": list(sampling.stop),
        "logprobs": 0,
        "return_token_ids": True,
        # The ids come back in `token_ids`; without this the server also decodes every sampled
        # token to a string for `logprobs.tokens`, which nothing reads (1.02-1.18x a CPU server's
        # sampled tokens/s: tests/bench/inference/bench_logprob_strings.py).
        "return_tokens_as_token_ids": True,
    }


def _samples(
    prompt_ids: list[int], payload: dict[str, Any], version: int, lineage: str, server: int
) -> list[Sample]:
    samples = []
    for choice in sorted(payload["choices"], key=lambda c: c["index"]):
        ids = list(choice["token_ids"])
        logprobs = list(choice["logprobs"]["token_logprobs"]) if choice.get("logprobs") else []
        if len(logprobs) != len(ids):
            raise InferenceError(
                f"server {server} returned {len(ids)} tokens but {len(logprobs)} log-probs"
            )
        samples.append(
            Sample(
                prompt_ids=prompt_ids,
                completion_ids=ids,
                logprobs=[float(lp) for lp in logprobs],
                text=choice["text"],
                finish_reason=choice.get("finish_reason") or "length",
                policy_version=version,
                server=server,
                policy_lineage=lineage,
            )
        )
    return samples


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", response.text)
    except ValueError:
        return response.text[:500]
    if isinstance(error, dict):
        return str(error.get("message", error))[:500]
    return str(error)[:500]
