"""The client's concurrency cap counts samples in flight, and never deadlocks."""

from __future__ import annotations

import asyncio

from engine.inference.client import _Slots


async def hold(slots: _Slots, n: int, seen: list[int], in_flight: list[int]) -> None:
    await slots.acquire(n)
    in_flight[0] += n
    seen.append(in_flight[0])
    await asyncio.sleep(0.01)
    in_flight[0] -= n
    slots.release(n)


def test_samples_in_flight_never_exceed_the_cap() -> None:
    async def scenario() -> list[int]:
        slots, seen, in_flight = _Slots(8), [], [0]
        await asyncio.gather(*(hold(slots, n, seen, in_flight) for n in [3, 4, 2, 8, 1] * 6))
        assert slots.used == 0
        return seen

    seen = asyncio.run(scenario())
    assert len(seen) == 30 and max(seen) <= 8 and max(seen) == 8


def test_a_request_larger_than_the_cap_runs_alone() -> None:
    async def scenario() -> list[int]:
        slots, seen, in_flight = _Slots(4), [], [0]
        await asyncio.gather(*(hold(slots, n, seen, in_flight) for n in [2, 16, 2, 16, 1]))
        return seen

    seen = asyncio.run(scenario())
    assert len(seen) == 5
    assert all(value == 16 for value in seen if value >= 16)  # nothing beside it


def test_cancelled_waiters_give_their_slots_back() -> None:
    async def scenario() -> int:
        slots = _Slots(2)
        await slots.acquire(2)
        waiting = asyncio.create_task(slots.acquire(1))
        await asyncio.sleep(0)
        waiting.cancel()
        slots.release(2)
        await asyncio.gather(waiting, return_exceptions=True)
        await asyncio.wait_for(slots.acquire(2), timeout=1)
        return slots.used

    assert asyncio.run(scenario()) == 2
