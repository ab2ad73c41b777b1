"""Reading a run's checkpoint events back from the Prefect server the tests share."""

from __future__ import annotations

import asyncio
import time

from prefect.client.orchestration import get_client
from prefect.events import Event
from prefect.events.filters import EventAnyResourceFilter, EventFilter, EventNameFilter

from tasks.reporting import CHECKPOINT_EVENT


def checkpoint_events(run: str, stage: str) -> list[Event]:
    """Every checkpoint event of `run`'s `stage`, all pages (other modules' runs share the
    server, so a first page of every checkpoint event may hold none of this run's)."""

    async def read() -> list[Event]:
        async with get_client() as client:
            page = await client.read_events(
                filter=EventFilter(
                    event=EventNameFilter(name=[CHECKPOINT_EVENT]),
                    any_resource=EventAnyResourceFilter(id=[f"primeflow.run.{run}"]),
                ),
                limit=50,
            )
            events = list(page.events)
            while page.next_page:
                page = await client.read_events_page(str(page.next_page))
                events += page.events
            return [event for event in events if event.payload.get("stage") == stage]

    return asyncio.run(read())


def event_steps(run: str, stage: str, expected: list[int], timeout_s: float = 20.0) -> list[int]:
    """The steps of `run`'s `stage` checkpoint events, sorted, duplicates kept: as soon as they
    are `expected`, else after `timeout_s` (the server ingests events in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        steps = sorted(event.payload["step"] for event in checkpoint_events(run, stage))
        if steps == expected or time.monotonic() > deadline:
            return steps
        time.sleep(0.5)
